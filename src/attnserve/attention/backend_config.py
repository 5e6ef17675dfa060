"""`AttentionBackendConfig`: everything a backend may know, handed over at construction.

Backends never see the `ModelRunner`. The runner (or a test) builds one of these and every
backend reads its facts from typed fields, so a misspelt name is an ``AttributeError`` at
start-up rather than a silent default. Two stages: the model facts are known before the KV
pool is sized (`workspace_bytes` of a backend class is computed from them and counted in
the memory budget), the pools are added with `with_pools` once they exist.

Sliding windows follow SGLang's convention: a layer with window ``w > 0`` lets the query at
position ``p`` see keys ``p - w .. p`` (an HF ``sliding_window`` of ``W`` is ``w = W - 1``);
``-1`` means full attention; 0 is refused (`normalize_window`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

#: split-K partitions per request at most (SGLang's ``--triton-attention-num-kv-splits``;
#: SGLang's default is 8, ours 32 because the per-request split heuristic sizes splits by
#: length and by the SMs left free, `compute_num_kv_splits`).
DEFAULT_NUM_KV_SPLITS = 32
#: tokens per split in deterministic mode (SGLang's ``--triton-attention-split-tile-size``).
DEFAULT_SPLIT_TILE_SIZE = 256


def normalize_window(window: Optional[int]) -> int:
    """One rule for every layer, backend and kernel: None or -1 -> -1 (no window);
    ``w > 0`` -> ``w``.

    Raises:
        ValueError: for 0 (a window that shows a token only itself is almost certainly a
            mistaken "no window"; pass -1) or values below -1.
    """
    if window is None:
        return -1
    w = int(window)
    if w == -1 or w > 0:
        return w
    raise ValueError(
        f"sliding_window_size must be -1 (no window) or > 0 (keys p-w..p are visible), got {w}"
    )


@dataclass(frozen=True)
class AttentionBackendConfig:
    """What an attention backend is built from (shapes per rank).

    Attributes:
        device / dtype: where and in which dtype the KV cache lives.
        attention_arch: ``"mha"`` (MHA/GQA/MQA) or ``"mla"`` (latent cache, DeepSeek).
        num_q_heads: query heads (``tp_q_head_num``).
        num_kv_heads: cached KV heads (1 for MLA's latent).
        head_dim / v_head_dim: cached K and V widths (MLA: ``kv_lora_rank + rope`` and
            ``kv_lora_rank``).
        kv_lora_rank / qk_rope_head_dim: MLA latent widths (0 for MHA).
        layer_windows: per layer id, its sliding window (-1 = full attention).
        page_size: tokens per KV page.
        max_batch_size: most requests one step can hold (``--max-running-requests``);
            sizes decode scratch and the MLA workspace.
        deterministic: batch-invariant split counts (``--enable-deterministic-inference``).
        num_kv_splits: most split-K partitions per request in decode.
        split_tile_size: tokens per split in deterministic mode.
        req_to_token_pool / token_to_kv_pool: the pools (None until `with_pools`).
        max_total_num_tokens: KV slots of the pool (0 until `with_pools`).
        num_sms: streaming multiprocessors the split heuristics assume (None: ask the
            device; the Triton interpreter pretends 8). Set it to fake a GPU in tests.
    """

    device: torch.device
    dtype: torch.dtype
    attention_arch: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    layer_windows: Tuple[int, ...]
    page_size: int = 1
    max_batch_size: int = 64
    deterministic: bool = False
    num_kv_splits: int = DEFAULT_NUM_KV_SPLITS
    split_tile_size: int = DEFAULT_SPLIT_TILE_SIZE
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    req_to_token_pool: Optional[object] = None
    token_to_kv_pool: Optional[object] = None
    max_total_num_tokens: int = 0
    num_sms: Optional[int] = None

    def __post_init__(self):
        if self.attention_arch not in ("mha", "mla"):
            raise ValueError(f"attention_arch must be 'mha' or 'mla', got {self.attention_arch!r}")
        if self.num_kv_heads < 1 or self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.page_size < 1 or self.max_batch_size < 1:
            raise ValueError(f"page_size and max_batch_size must be >= 1, got {self.page_size}, {self.max_batch_size}")
        if self.num_kv_splits < 1 or self.split_tile_size < 1:
            raise ValueError(
                f"--triton-attention-num-kv-splits and --triton-attention-split-tile-size must be >= 1, "
                f"got {self.num_kv_splits}, {self.split_tile_size}"
            )
        object.__setattr__(self, "device", torch.device(self.device))
        object.__setattr__(self, "layer_windows", tuple(normalize_window(w) for w in self.layer_windows))

    @property
    def is_mla(self) -> bool:
        return self.attention_arch == "mla"

    def resolved_num_sms(self) -> int:
        """``num_sms``, or the device's SM count (8 off CUDA: the interpreter's stand-in)."""
        if self.num_sms is not None:
            return self.num_sms
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).multi_processor_count
        return 8

    @property
    def window_sizes(self) -> Tuple[int, ...]:
        """The distinct sliding windows (> 0) of the model's layers, ascending."""
        return tuple(sorted({w for w in self.layer_windows if w > 0}))

    def with_pools(self, req_to_token_pool, token_to_kv_pool) -> "AttentionBackendConfig":
        """A copy with the pools attached (``max_total_num_tokens`` from the KV pool).

        Raises:
            ValueError: the KV pool's shape or page size disagrees with the model facts.
        """
        pool = token_to_kv_pool
        if pool.page_size != self.page_size or pool.head_num != self.num_kv_heads or pool.head_dim != self.head_dim:
            raise ValueError(
                f"KV pool (page {pool.page_size}, {pool.head_num} heads x {pool.head_dim}) does not match the "
                f"backend config (page {self.page_size}, {self.num_kv_heads} heads x {self.head_dim})"
            )
        return dataclasses.replace(self, req_to_token_pool=req_to_token_pool, token_to_kv_pool=pool,
                                   max_total_num_tokens=int(pool.size))

    @classmethod
    def from_pools(cls, req_to_token_pool, token_to_kv_pool, num_q_heads: int,
                   layer_windows: Optional[Sequence[int]] = None, **kw) -> "AttentionBackendConfig":
        """Config whose KV facts are read from the pools (tests, benchmarks, tools).

        ``token_to_kv_pool`` is an `MHATokenToKVPool` or `MLATokenToKVPool`; windows default
        to -1 for every layer; ``kw`` sets the other fields (``max_batch_size`` defaults to
        the request pool's rows).
        """
        from attnserve.mem_cache.memory_pool import MLATokenToKVPool

        pool = token_to_kv_pool
        mla = isinstance(pool, MLATokenToKVPool)
        kw.setdefault("max_batch_size", int(req_to_token_pool.req_to_token.shape[0]))
        cfg = cls(
            device=pool.device, dtype=pool.dtype, attention_arch="mla" if mla else "mha",
            num_q_heads=num_q_heads, num_kv_heads=pool.head_num, head_dim=pool.head_dim,
            v_head_dim=pool.v_head_dim,
            layer_windows=tuple(layer_windows) if layer_windows is not None else (-1,) * pool.layer_num,
            page_size=pool.page_size,
            kv_lora_rank=pool.kv_lora_rank if mla else 0, qk_rope_head_dim=pool.qk_rope_head_dim if mla else 0,
            **kw,
        )
        return cfg.with_pools(req_to_token_pool, pool)
