"""What every decoder-only model shares: the body (`DecoderModel`: embedding, layer loop,
final norm) and the causal LM around it (`CausalLM`: LM head, `compute_logits`,
`load_weights`).

A family's file holds only what differs: its decoder layer (attention variant, MLP or MoE
block, norms) set as ``DecoderModel.decoder_layer_cls``, the RoPE tables and embedding
scale where they differ (`DecoderModel._init_rope`, `DecoderModel.embed`), and its
checkpoint names (`CausalLM.packed_modules_mapping`, ``ignored_weight_suffixes``,
``weight_name_replacements``, ``skip_extra_layers``). Adding a family is a small file and
a registry line (`attnserve.models.registry`).

The residual convention of every layer: ``layer.forward(positions, hidden, forward_batch,
residual)`` returns ``(block output, residual stream)``; the next norm that takes
``residual`` adds the two (`RMSNorm`), the final norm included.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, Optional, Set, Tuple

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.forward_batch import ForwardBatch
from attnserve.models.layers import cpu_gemm, tp_prefill_overlap
from attnserve.models.layers.moe.sparse_block import check_experts_complete, is_expert_param, route_expert_tensors
from attnserve.models.layers.norm import RMSNorm
from attnserve.models.layers.parallel import VocabParallelEmbedding, gather_logits, load_param
from attnserve.models.layers.rotary import get_rope, rope_parameters_from_config
from attnserve.models.layers.skinny_gemm import skinny_gemm_supported, skinny_linear, skinny_rule


def attention_head_dim(config: Any) -> int:
    """``config.head_dim``, else ``hidden_size // num_attention_heads`` (HF's default)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _mm_float32_out(x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ w.T`` ([N, H] x [V, H] half precision) written as float32 by the GEMM itself
    (``torch.mm(..., out_dtype=)``, CUDA): the product is accumulated in float32 either way,
    and this skips the half-precision logits and the cast kernel that read and rewrote them
    (Qwen3-0.6B decode at 144 rows: 67 µs a step, benchmarks/results/
    h100-80gb-hbm3-profile-step-2026-11-27.json). Falls back to ``F.linear`` where the
    installed PyTorch has no ``out_dtype`` for this device (the result is then rounded to
    ``w``'s dtype first). ``out`` (float32 ``[N, V]``, contiguous rows), when given, receives
    the product (`engine.graph_output.SharedGraphOutput.target`) and is returned; one of
    another shape or layout is ignored."""
    try:
        if (out is not None and out.dtype == torch.float32 and out.shape == (x.shape[0], w.shape[0])
                and out.stride(1) == 1 and out.device == x.device):
            return torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return torch.nn.functional.linear(x, w)


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF prefix ``model.``).

    Args:
        config: HF config: ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
            ``rms_norm_eps``, plus what the RoPE table and the layers read.
        dtype: parameter dtype.
        tp: this rank's `TPGroup` (default: one device); the embedding is split by
            vocabulary rows.

    A family sets ``decoder_layer_cls`` (built as ``cls(config, layer_id, self.rotary_emb,
    dtype, tp=tp)`` by `_make_layer`) and ``norm_cls`` (the final norm), and overrides
    `_init_rope` / `_make_layer` / `embed` where it differs.
    """

    decoder_layer_cls: Any = None
    norm_cls: Any = RMSNorm

    def __init__(self, config: Any, dtype: torch.dtype, tp: Optional[TPGroup] = None):
        super().__init__()
        tp = tp or TPGroup.single()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype=dtype)
        self._init_rope(config, dtype)
        self.layers = nn.ModuleList(self._make_layer(config, i, dtype, tp) for i in range(config.num_hidden_layers))
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        from attnserve.models.layers.allreduce_fusion import link_allreduce_fusion

        # tp > 1: row-parallel sums move into the norms after them (--disable-allreduce-fusion: none)
        self.fused_allreduces = link_allreduce_fusion(self.layers, self.norm, tp)

    def _init_rope(self, config: Any, dtype: torch.dtype) -> None:
        """Build what the layers share before they are built: here one cos/sin table,
        ``self.rotary_emb``, over ``head_dim`` channels and ``max_position_embeddings``
        (default 8192) positions."""
        self.rotary_emb = get_rope(attention_head_dim(config), int(getattr(config, "max_position_embeddings", 8192)),
                                   rope_parameters_from_config(config))

    def _make_layer(self, config: Any, layer_id: int, dtype: torch.dtype, tp: TPGroup) -> nn.Module:
        return self.decoder_layer_cls(config, layer_id, self.rotary_emb, dtype, tp=tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` -> ``[T, hidden_size]`` input of the first layer."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                num_layers: Optional[int] = None) -> torch.Tensor:
        """``[T, hidden_size]`` after the first ``num_layers`` layers (all when None) and
        the final norm."""
        hidden_states = self.embed(input_ids)
        residual = None
        layer = None
        layers = self.layers[:num_layers]
        tp = getattr(layers[0], "fusion_tp", None) if len(layers) else None
        if tp is not None and tp_prefill_overlap.tp_overlap_applies(layers, hidden_states, tp):
            # a large prefill chunk under tp: all-reduces in token halves, overlapped
            for i, layer in enumerate(layers):
                hidden_states, residual = tp_prefill_overlap.overlapped_layer_forward(
                    layer, positions, hidden_states, forward_batch, residual, input_summed=i > 0)
            hidden_states, _ = self.norm(hidden_states, residual)
            return hidden_states
        for layer in layers:
            # direct ``forward`` calls on the per-layer path: no module hooks are used, and
            # ``nn.Module.__call__`` costs ~7 us a call, ~300 calls a step (~3% of a CPU step)
            hidden_states, residual = layer.forward(positions, hidden_states, forward_batch, residual)
        if getattr(layer, "mlp_output_partial", False):  # the last layer left its sum to this norm
            hidden_states, _ = self.norm.forward_all_reduce(hidden_states, residual, layer.fusion_tp)
        else:
            hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class CausalLM(nn.Module):
    """A `DecoderModel` (``self.model``, class ``model_cls``) and its LM head.

    Args:
        config: HF config (see the family's class); ``tie_word_embeddings`` (default
            ``tie_word_embeddings_default``) shares the embedding matrix with the LM head.
        dtype: parameter dtype. Parameters are created on the current default device (use
            ``with torch.device(...)`` to build directly on a GPU or on ``meta``) and are
            left uninitialised (norms are ones) until `load_weights` or
            `attnserve.model_loader.dummy.init_dummy_weights` fills them.
        tp: this rank's `TPGroup` (default: one device). Heads, MLP rows and vocabulary
            rows are split over its ranks (`attnserve.models.layers.parallel`); the loaders
            give every rank full checkpoint tensors, one at a time, and keep its slice.

    Checkpoint names are HF's; the class attributes below say how they map.
    """

    model_cls: Any = None
    tie_word_embeddings_default: bool = False
    #: fused parameter -> HF shards it is built from, as (HF module name, shard id)
    packed_modules_mapping: Dict[str, Tuple[Tuple[str, int], ...]] = {
        "qkv_proj": (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)),
        "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    }
    #: HF checkpoint tensors that have no parameter here (recomputed buffers)
    ignored_weight_suffixes: Tuple[str, ...] = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
    #: (old, new) substrings replaced in every checkpoint name before it is matched
    weight_name_replacements: Tuple[Tuple[str, str], ...] = ()
    #: skip ``model.layers.{i}.`` tensors with ``i >= num_hidden_layers`` (e.g. DeepSeek-V3's
    #: multi-token-prediction layer); otherwise they match no parameter (KeyError)
    skip_extra_layers: bool = False
    #: name missing expert tensors w1/w3/w2 under ``block_sparse_moe`` (Mixtral's checkpoints)
    mixtral_expert_names: bool = False

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, tp: Optional[TPGroup] = None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp or TPGroup.single()
        self.model = self.model_cls(config, dtype, self.tp)
        self._init_lm_head(config, dtype, tie_default=self.tie_word_embeddings_default)

    def _init_lm_head(self, config: Any, dtype: torch.dtype, tie_default: bool) -> None:
        """``lm_head`` (vocabulary-parallel rows), or None when tied to the embeddings."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", tie_default))
        self.lm_head = None
        #: the FP8 head of ``--enable-fp8-lm-head`` (`quantization.lm_head`), else None
        self.lm_head_fp8 = None
        self.lm_head_packed = cpu_gemm.PackedCPUWeight()
        if not self.tie_word_embeddings:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.tp, dtype=dtype)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                num_layers: Optional[int] = None) -> torch.Tensor:
        """Run the decoder on the step's tokens.

        Args:
            input_ids: int64 ``[T]``.
            positions: int64 ``[T]`` absolute positions (< ``max_position_embeddings``).
            forward_batch: the step's `ForwardBatch` (attention backend and KV pools).
            num_layers: run only the first ``num_layers`` layers (a self-draft); None: all.

        Returns:
            ``[T, hidden_size]`` hidden states after the final norm, in the model dtype.
        """
        return self.model(input_ids, positions, forward_batch, num_layers)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[vocab rows of this rank, hidden_size]``: the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[N, hidden_size]`` -> float32 ``[N, vocab_size]`` logits (every rank's vocabulary
        rows gathered under tensor parallelism). Decode-sized CUDA batches use the skinny
        GEMM while the model's fused kernels are on (Llama-3-8B at batch 1: 331 vs 367 µs
        for cuBLAS, benchmarks/NOTES.md, issue 33). ``out``: an optional float32 ``[N,
        vocab_size]`` tensor (a CUDA graph's shared output rows) that the cuBLAS path writes
        in place; the caller must not assume it was used (compare the returned tensor). With
        an FP8 head (``--enable-fp8-lm-head``) its FP8 GEMM gives the rows, cast to float32."""
        if self.lm_head_fp8 is not None:
            return gather_logits(self.lm_head_fp8(hidden_states), self.config.vocab_size, self.tp).float()
        w = self.lm_head_weight
        if (getattr(self.model.norm, "use_fused", False) and hidden_states.is_cuda and skinny_rule() == "v2"
                and skinny_gemm_supported(hidden_states, w)):
            local = skinny_linear(hidden_states, w)
        elif (hidden_states.is_cuda and w.dtype in (torch.bfloat16, torch.float16) and hidden_states.dim() == 2
              and self.tp.size == 1):  # under TP the all-gather would carry twice the bytes
            local = _mm_float32_out(hidden_states, w, out)
        else:
            local = cpu_gemm.linear(hidden_states, w, None, self.lm_head_packed)
        return gather_logits(local, self.config.vocab_size, self.tp).float()

    # ---- weights ------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Copy HF-named tensors into the parameters (casting to their dtype and device).

        Args:
            weights: ``(name, tensor)`` pairs with HF names, e.g.
                ``model.layers.3.self_attn.q_proj.weight``. ``lm_head.weight`` is skipped
                when the embeddings are tied; per-expert tensors go to their `FusedMoE`
                (`route_expert_tensors`); shards of ``packed_modules_mapping`` to their
                part of the fused parameter.

        Returns:
            the names of this module's parameters that were written.

        Raises:
            KeyError: for a name that matches no parameter (or experts in a dense layer).
            ValueError: for a shape mismatch, when some parameters received no weight, or
                for a missing expert tensor.
        """
        params = dict(self.named_parameters())
        loaded: Set[str] = set()
        experts: Set[Tuple[str, int, str]] = set()
        shard_map = {
            f".{hf}.": (fused, shard) for fused, shards in self.packed_modules_mapping.items() for hf, shard in shards
        }
        for name, tensor in route_expert_tensors(self, self._renamed(weights), experts):
            if name.endswith(self.ignored_weight_suffixes):
                continue
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                continue
            for key, (fused, shard) in shard_map.items():
                if key in name:
                    target = name.replace(key, f".{fused}.")
                    load_param(self._param(params, target, name), tensor, name, part=shard)
                    loaded.add(f"{target}#{shard}")
                    loaded.add(target)
                    break
            else:
                load_param(self._param(params, name, name), tensor, name)
                loaded.add(name)
        check_experts_complete(self, experts, self.mixtral_expert_names)
        self._check_complete({n: p for n, p in params.items() if not is_expert_param(n)}, loaded)
        return {n for n in loaded if "#" not in n} | {n for n in params if is_expert_param(n)}

    def _renamed(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
        """``weights`` with ``weight_name_replacements`` applied, less the layers past
        ``num_hidden_layers`` when ``skip_extra_layers``."""
        n_layers = self.config.num_hidden_layers
        for name, tensor in weights:
            for old, new in self.weight_name_replacements:
                name = name.replace(old, new)
            if self.skip_extra_layers and name.startswith("model.layers.") and int(name.split(".")[2]) >= n_layers:
                continue
            yield name, tensor

    def _param(self, params: Dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
        if target not in params:
            raise KeyError(f"checkpoint tensor {source!r} matches no parameter of {type(self).__name__}")
        return params[target]

    def _check_complete(self, params: Dict[str, nn.Parameter], loaded: Set[str]) -> None:
        """Raise ValueError naming the parameters of ``params`` (expert ones excluded) that
        ``loaded`` (names, and ``name#shard`` for fused parts) does not cover."""
        missing = []
        for pname, param in params.items():
            if getattr(param, "loaded_with_weight", False):  # FP8 scales computed with their weight
                continue
            fused = pname.split(".")[-2] if "." in pname else ""
            if fused in self.packed_modules_mapping:
                shards = self.packed_modules_mapping[fused]
                if any(f"{pname}#{shard}" not in loaded for _, shard in shards):
                    missing.append(pname)
            elif pname not in loaded:
                missing.append(pname)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint left {len(missing)} parameters unset: {shown}")
