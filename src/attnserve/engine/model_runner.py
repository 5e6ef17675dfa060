"""`ModelRunner`: the model, the KV pools and the attention backend of one engine.

It sizes and owns the two-level KV cache (`ReqToTokenPool` + `TokenToKVPoolAllocator` +
`MHATokenToKVPool`/`MLATokenToKVPool`), chooses the attention backend(s), and runs one
forward step from a `ForwardBatch` (`forward`), replaying a CUDA graph for decode batches
when one is captured. The scheduler builds the batch (`attnserve.engine.step_inputs`);
`build_forward_batch` builds one from host lists for tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import List

import torch

from attnserve.attention.backend_config import AttentionBackendConfig
from attnserve.attention.radix_attention import RadixAttention
from attnserve.attention.selection import (
    DeviceCaps,
    backend_workspace_bytes,
    choose_backends,
    create_backends,
)
from attnserve.engine.memory_sizing import default_mem_fraction_static, kv_pool_tokens, resolve_serving_limits
from attnserve.forward_batch import ForwardBatch, ForwardMode
from attnserve.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from attnserve.models.layers.fused_kernels import set_fused_kernels

logger = logging.getLogger(__name__)

#: KV pool on CPU when --max-total-tokens is not given: the bytes of this many tokens in the
#: model dtype (an FP8 cache holds 4x the tokens of a float32 one in them).
CPU_DEFAULT_MAX_TOTAL_TOKENS = 32768


class ModelRunner:
    """Runs forward steps of a loaded model.

    Args:
        server_args: `ServerArgs` (device, dtype, page size, KV size, backends, graphs).
        loaded: a `LoadedModel` from `attnserve.model_loader.loader.load_model`.
        extra_kv_bytes_per_token: KV bytes per token of another pool of the same size
            (a speculative draft model's), counted when the pool is sized from free memory.
        draft_of: the target's runner when this one runs a speculative draft model: it
            shares the target's ``req_to_token`` rows and slot allocator (a token's draft K/V
            sit at the same slot as its target K/V, in a pool of the draft's own shape) and
            captures no graphs.
        tp: this rank's `TPGroup` under tensor parallelism (None: one device). The pools
            and backends hold this rank's heads; the pool size is the smallest any rank can
            hold (rank 0 hands out slots that must exist on every rank).
    """

    def __init__(self, server_args, loaded, extra_kv_bytes_per_token: int = 0, draft_of: "ModelRunner" = None,
                 tp=None):
        from attnserve.distributed.group import TPGroup
        from attnserve.distributed.partition import kv_head_range, q_head_range

        self.server_args = server_args
        self.tp = tp or TPGroup.single()
        self.device = torch.device(server_args.resolved_device())
        self.dtype = server_args.resolved_dtype()
        self.kv_cache_dtype = server_args.resolved_kv_cache_dtype()
        self.model = loaded.model
        self.model_config = loaded.model_config
        self.extra_kv_bytes_per_token = int(extra_kv_bytes_per_token)
        self.draft_of = draft_of
        set_fused_kernels(self.model, not server_args.disable_fused_kernels)
        if self.device.type == "cuda":
            from attnserve.models.layers.weight_layout import apply_weight_layout

            relaid = apply_weight_layout(self.model)  # opt-in experiment (ATTNSERVE_WEIGHT_LAYOUT=kn)
            if relaid:
                logger.info("%d projection weights stored K-major (ATTNSERVE_WEIGHT_LAYOUT=kn)", relaid)
        if self.device.type == "cpu":
            from attnserve.engine.host_malloc import tune_glibc_malloc

            tune_glibc_malloc()  # decode's growing host tensors reuse the heap (see host_malloc)
        mc = self.model_config
        #: this rank's attention heads (all of them on one device)
        self.tp_q_head_num = q_head_range(mc.num_attention_heads, self.tp.size, self.tp.rank).count
        self.tp_k_head_num = 1 if mc.attention_arch == "mla" else \
            kv_head_range(mc.num_key_value_heads, self.tp.size, self.tp.rank).count
        self.context_len = draft_of.context_len if draft_of is not None else server_args.context_length or mc.context_len
        self.page_size = server_args.page_size
        self.backend_choice = choose_backends(server_args, DeviceCaps.detect(self.device), mc.attention_arch)
        self._check_kv_cache_dtype()
        facts = self._init_memory_pool()
        self.attn_backend_config = facts.with_pools(self.req_to_token_pool, self.token_to_kv_pool)
        self.attn_backend = create_backends(self.attn_backend_config, self.backend_choice,
                                            server_args.speculative_attention_mode)
        self.cuda_graph_runner = None
        #: decode forwards that ran eagerly (no captured graph fits, or graphs are off): on the
        #: GPU each launches every kernel from Python (benchmarks report it per workload)
        self.eager_decode_steps = 0
        if draft_of is None:
            self._init_cuda_graphs()

    # ---- memory ------------------------------------------------------------------------
    def _layer_windows(self) -> tuple:
        """Sliding window of each layer id, read from the model's `RadixAttention` layers.

        Raises:
            ValueError: two attention modules of one layer id disagree on the window.
        """
        windows = [-1] * self.model_config.num_hidden_layers
        seen = {}
        for m in self.model.modules():
            if isinstance(m, RadixAttention) and m.layer_id < len(windows):  # a self-draft runs the first layers
                w = seen.setdefault(m.layer_id, m.sliding_window_size)
                if w != m.sliding_window_size:
                    raise ValueError(f"layer {m.layer_id} has attention modules with windows {w} and "
                                     f"{m.sliding_window_size}")
                windows[m.layer_id] = w
        return tuple(windows)

    def _check_kv_cache_dtype(self) -> None:
        """Refuse an FP8 KV cache where it cannot run.

        Raises:
            ValueError: a GPU below compute capability 8.9 (no FP8 conversions in Triton),
                or a chosen backend that does not read FP8 caches.
        """
        from attnserve.attention.registry import get_attention_backend_class
        from attnserve.mem_cache.kv_quant import is_fp8

        if not is_fp8(self.kv_cache_dtype):
            return
        name = self.server_args.kv_cache_dtype
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            cap = ".".join(map(str, torch.cuda.get_device_capability(self.device)))
            raise ValueError(f"--kv-cache-dtype {name} needs a GPU of compute capability >= 8.9 (Ada, Hopper); "
                             f"this one is {cap}: use --kv-cache-dtype auto")
        for backend in dict.fromkeys((self.backend_choice.prefill, self.backend_choice.decode)):
            if not get_attention_backend_class(backend).supports_fp8_kv:
                raise ValueError(f"attention backend '{backend}' cannot read an FP8 KV cache (--kv-cache-dtype "
                                 f"{name}); use triton, triton_mla or torch_native, or --kv-cache-dtype auto")

    def _backend_config(self, max_batch_size: int) -> AttentionBackendConfig:
        """Model facts and limits for the attention backends (pools attached later);
        ``max_batch_size``: the most requests one step can hold."""
        mc, args = self.model_config, self.server_args
        mla = mc.attention_arch == "mla"
        return AttentionBackendConfig(
            device=self.device, dtype=self.dtype, attention_arch=mc.attention_arch,
            num_q_heads=self.tp_q_head_num, num_kv_heads=self.tp_k_head_num,
            head_dim=mc.kv_lora_rank + mc.qk_rope_head_dim if mla else mc.head_dim,
            v_head_dim=mc.kv_lora_rank if mla else mc.v_head_dim,
            kv_lora_rank=mc.kv_lora_rank if mla else 0, qk_rope_head_dim=mc.qk_rope_head_dim if mla else 0,
            layer_windows=self._layer_windows(), page_size=self.page_size,
            max_batch_size=max_batch_size, deterministic=args.enable_deterministic_inference,
            num_kv_splits=args.triton_attention_num_kv_splits, split_tile_size=args.triton_attention_split_tile_size,
        )

    def _pool_tokens(self, workspace_bytes: int) -> int:
        """KV pool tokens from memory alone (`memory_sizing.kv_pool_tokens`; CPU: the bytes
        of `CPU_DEFAULT_MAX_TOTAL_TOKENS` tokens in the model dtype)."""
        mc, heads = self.model_config, self.tp_k_head_num
        if self.device.type == "cpu":
            budget = CPU_DEFAULT_MAX_TOTAL_TOKENS * mc.kv_cache_bytes_per_token(self.dtype, heads)
            return budget // mc.kv_cache_bytes_per_token(self.kv_cache_dtype, heads)
        free, total = torch.cuda.mem_get_info(self.device)
        fraction = self.server_args.mem_fraction_static
        if fraction is None:
            fraction = default_mem_fraction_static(total, self.tp.size,
                                                   self.server_args.speculative_algorithm is not None)
        return kv_pool_tokens(free, total, fraction, workspace_bytes,
                              mc.kv_cache_bytes_per_token(self.kv_cache_dtype, heads) + self.extra_kv_bytes_per_token)

    def _init_memory_pool(self) -> AttentionBackendConfig:
        """Size the KV pool and the serving limits (`memory_sizing`), build the pools.

        Returns:
            the backends' `AttentionBackendConfig` (before the pools are attached).

        Raises:
            ValueError: the GPU cannot hold two pages of KV cache.
        """
        args = self.server_args
        mc = self.model_config
        heads = self.tp_k_head_num
        if self.draft_of is not None:
            limits = self.draft_of.serving_limits
            size = self.draft_of.max_total_num_tokens
        else:
            total_gpu = torch.cuda.mem_get_info(self.device)[1] if self.device.type == "cuda" else 0
            # the request count bounds the attention workspace, which the pool's budget pays for:
            # derive it from the pool without a workspace, then size the pool with that workspace
            mrr = args.max_running_requests
            if mrr is None:
                first = args.max_total_tokens if args.max_total_tokens is not None else self._pool_tokens(0)
                mrr = resolve_serving_limits(first, self.device.type, total_gpu,
                                             speculative=args.speculative_algorithm is not None).max_running_requests
            workspace = backend_workspace_bytes(self._backend_config(mrr), self.backend_choice)
            size = args.max_total_tokens if args.max_total_tokens is not None else self._pool_tokens(workspace)
            if self.device.type == "cuda" and args.max_total_tokens is None and size < self.page_size * 2:
                raise ValueError(
                    "not enough GPU memory for the KV cache; raise --mem-fraction-static or set --max-total-tokens"
                )
            size = self.tp.min_int(size)  # every rank must hold every slot rank 0 hands out
            limits = resolve_serving_limits(
                size, self.device.type, total_gpu, max_running_requests=mrr,
                chunked_prefill_size=self.context_len if args.chunked_prefill_size == -1 else args.chunked_prefill_size,
                cuda_graph_max_bs=args.cuda_graph_max_bs,
                max_total_tokens_chosen=args.max_total_tokens is None,
                params=sum(p.numel() for p in self.model.parameters()), num_layers=mc.num_hidden_layers,
                speculative=args.speculative_algorithm is not None)
            if args.max_running_requests is None:  # the count derived from the first estimate was its default
                limits = dataclasses.replace(limits, chosen=limits.chosen + ("max_running_requests",))
            if args.chunked_prefill_size == -1:  # SGLang's -1: prompts are prefilled whole, never split
                limits = dataclasses.replace(limits, chunk_prompts=False)
        #: the limits this engine runs with (flags, or the memory rules where flags are unset)
        self.serving_limits = limits
        facts = self._backend_config(limits.max_running_requests)
        self.attn_workspace_bytes = backend_workspace_bytes(facts, self.backend_choice)
        size -= size % self.page_size
        if size < self.page_size:
            raise ValueError(f"--page-size {self.page_size} is larger than the KV pool ({limits.max_total_tokens} tokens); "
                             "use a smaller page size or raise --max-total-tokens")
        if size != limits.max_total_tokens:  # what the pool holds, whole pages (the log and the scheduler say so)
            limits = self.serving_limits = dataclasses.replace(limits, max_total_tokens=size)
        self.max_total_num_tokens = size
        if self.draft_of is not None:
            self.req_to_token_pool = self.draft_of.req_to_token_pool
            self.token_to_kv_pool_allocator = self.draft_of.token_to_kv_pool_allocator
        else:
            self.req_to_token_pool = ReqToTokenPool(limits.max_running_requests + 1, self.context_len + 1, self.device)
            self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(size, self.page_size)
        if mc.attention_arch == "mla":
            self.token_to_kv_pool = MLATokenToKVPool(
                size, self.page_size, self.kv_cache_dtype, mc.kv_lora_rank, mc.qk_rope_head_dim, mc.num_hidden_layers,
                self.device, use_fused_store=not args.disable_fused_kernels,
            )
        else:
            self.token_to_kv_pool = MHATokenToKVPool(
                size, self.page_size, self.kv_cache_dtype, heads, mc.head_dim, mc.num_hidden_layers,
                self.device, v_head_dim=mc.v_head_dim, use_fused_store=not args.disable_fused_kernels,
            )
        logger.info(
            "%sKV cache: %d tokens (%s), page_size %d, %.1f MiB; attention workspace %.1f MiB (%s, up to %d "
            "requests)", "draft model " if self.draft_of is not None else "", size,
            str(self.kv_cache_dtype).replace("torch.", ""), self.page_size,
            self.token_to_kv_pool.mem_bytes() / 2**20, self.attn_workspace_bytes / 2**20,
            self.backend_choice.decode, limits.max_running_requests,
        )
        if self.draft_of is None:
            logger.info("serving limits: %s", limits.describe())
        return facts

    def _init_cuda_graphs(self) -> None:
        """Capture decode graphs on CUDA with a capturable backend (the default there).

        Raises:
            ValueError: graphs explicitly requested (--cuda-graph-bs/--cuda-graph-max-bs)
                on CPU or with a backend that cannot be captured.
        """
        args = self.server_args
        if args.disable_cuda_graph:
            return
        if self.device.type != "cuda":
            if args.cuda_graph_requested():
                raise ValueError("CUDA graphs need a CUDA device; drop --cuda-graph-bs/--cuda-graph-max-bs on CPU")
            return
        if not self.attn_backend.supports_cuda_graph:
            if args.cuda_graph_requested():
                raise ValueError(
                    f"CUDA graphs need a capturable decode backend, but '{self.backend_choice.decode}' is not; "
                    "pass --disable-cuda-graph or --decode-attention-backend triton"
                )
            logger.warning("decode backend '%s' cannot be captured: CUDA graphs off", self.backend_choice.decode)
            return
        from attnserve.engine.cuda_graph_runner import CudaGraphRunner

        self.cuda_graph_runner = CudaGraphRunner(self)

    def release_cuda_graphs(self, drain_timeout_s: float = 10.0) -> bool:
        """Wait up to ``drain_timeout_s`` s for the device to finish the work queued so far,
        then destroy the captured decode graphs (eager decode from then on).

        Tensor-parallel shutdown calls it before tearing down the process groups, which
        cannot finish while a graph that captured a collective is alive (see
        `CudaGraphRunner.release`).

        Returns:
            True when there were no graphs or they were released; False (graphs kept,
            logged) when the device did not drain in time, e.g. a collective waits on a
            rank that died.
        """
        if self.cuda_graph_runner is None:
            return True
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + drain_timeout_s
        while not done.query():
            if time.monotonic() >= deadline:
                logger.warning("the device did not finish its queued work in %.0f s; CUDA graphs kept", drain_timeout_s)
                return False
            time.sleep(0.001)
        self.cuda_graph_runner.release()
        self.cuda_graph_runner = None
        return True

    def release(self, drain_timeout_s: float = 10.0) -> bool:
        """Give back every device allocation this runner owns; the runner cannot run afterwards.

        Drops, in order: the captured decode graphs with their private memory pool
        (`release_cuda_graphs`, which first waits up to ``drain_timeout_s`` s for queued
        work), the attention backend (its CUDA-graph metadata buffers, workspaces and
        last-step metadata: `AttentionBackend.release`, which also breaks the cycle of a
        backend that keeps a `ForwardBatch` pointing back at it), the KV pool, the
        ``req_to_token`` table with its host mirror, the slot allocator and the model's
        weights. A draft runner drops its references to the target's shared
        ``req_to_token`` and allocator. Tensors go back to PyTorch's caching allocator once
        nothing else refers to them; the caller empties that cache
        (`attnserve.engine.engine.Engine.shutdown`). Idempotent.

        Returns:
            True when released; False (nothing released, logged by `release_cuda_graphs`)
            when the device did not finish its queued work in time.
        """
        if self.cuda_graph_runner is not None and not self.release_cuda_graphs(drain_timeout_s):
            return False
        backend = getattr(self, "attn_backend", None)
        if backend is not None:
            backend.release()
        self.attn_backend = self.attn_backend_config = None
        self.token_to_kv_pool = self.req_to_token_pool = self.token_to_kv_pool_allocator = None
        self.model = None
        self.draft_of = None
        return True

    # ---- forward -----------------------------------------------------------------------
    def build_forward_batch(
        self, mode: ForwardMode, input_ids: List[int], req_pool_indices: List[int], prefix_lens: List[int],
        extend_lens: List[int], out_cache_loc: torch.Tensor, spec_info=None,
    ) -> ForwardBatch:
        return ForwardBatch.init_new(
            mode, input_ids, req_pool_indices, prefix_lens, extend_lens, out_cache_loc,
            self.req_to_token_pool, self.token_to_kv_pool, self.attn_backend, self.device, spec_info=spec_info,
        )

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, return_all_logits: bool = False, prompt_plan=None) -> torch.Tensor:
        """Run the model on ``fb``; ``prompt_plan`` (a `PromptLogprobPlan`, extend steps)
        computes the logprobs of chosen prompt positions from the hidden states.

        Returns:
            float32 logits: ``[bs, V]`` of each request's last token, or ``[T, V]`` of every
            token when ``return_all_logits``.
        """
        if (
            self.cuda_graph_runner is not None
            and not return_all_logits
            and prompt_plan is None
            and self.cuda_graph_runner.can_run(fb)
        ):
            return self.cuda_graph_runner.replay(fb)
        if fb.forward_mode.is_decode():
            self.eager_decode_steps += 1
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        if prompt_plan is not None:
            prompt_plan.consume(hidden, self.model.compute_logits)
        if not return_all_logits and not fb.forward_mode.is_decode():
            last = fb.extend_start_loc.to(torch.int64) + fb.extend_seq_lens.to(torch.int64) - 1
            hidden = hidden[last]
        return self.model.compute_logits(hidden)
