"""Start-up warm-up: compile every kernel variant serving launches before the first request.

Why. Triton compiles a kernel once per *specialisation* (``JITFunction.run``): one binary
per combination of its ``tl.constexpr`` values, of each integer argument's class (equal to
1, divisible by 16, or neither; unless listed in ``do_not_specialize``) and of each
pointer's 16-byte alignment. CUDA-graph capture runs the decode step at every captured
batch size, but nothing else; before this module a fresh engine paid the rest inside its
first requests (issue 33: Llama-3-8B shape, 64 x 2,080-token prompts -> 32 tokens took
6.37 s on a fresh server against 4.22 s warm, and the first batch with prefix hits 3.76 s
against 0.73 s).

How. `run_warmup` pushes small real requests through the engine (`Engine.add_request` /
`Engine.step`: the scheduler, the packed step inputs, the forward, sampling and the prefix
cache exactly as serving runs them), then gives back everything they took (`_restore`):
KV slots, ``req_to_token`` rows (both allocators are reset to their start-up order), cached
prefixes, request records, the future-token map and the scheduler's counters. The
requests carry explicit seeds and ids of their own, so the engine's seed generator and
request counter are untouched. The phases of `build_warmup_plan`, and what each one
compiles (the integer and alignment classes come from `attnserve.engine.step_inputs`,
where every per-token int64 tensor is a view at byte ``8 * T * k`` of one packed copy and
the int32 lengths follow at ``4 * bs`` strides):

==========  ==========================================================================
phase       variants
==========  ==========================================================================
prefill     extend without a cached prefix (``has_prefix`` False: no prefix tile); the
            extend kernel's ``num_m_blocks = cdiv(longest extend, BLOCK_M)`` equal to 1,
            neither, and divisible by 16 for query tiles of 32, 64 and 128 rows
            (extends of 7, 200, 512, 1024, 2048 tokens, or the longest that fits), and
            for sm_90's long-prefill tiles above 2,048 tokens (`long_plain_lengths`:
            2,049 and 4,096 tokens, where they fit);
            ``positions`` 16-byte aligned or not (odd and even token counts, for RoPE);
            the prefix-length view aligned or not (``bs % 4``, for the KV-index
            kernel); one step of ``chunked_prefill_size`` tokens, which also grows
            PyTorch's caching allocator to the largest prefill step
prefix      the same classes with a cached prefix (``has_prefix`` True: the separate
            prefix tile), including the one-token extend of a fully cached prompt
chunked     a prompt longer than ``chunked_prefill_size`` (when the context allows
            one): a non-emitting chunk, then a chunk over its own prefix
mixed       a prefill arriving while a request decodes (a MIXED step with
            ``--enable-mixed-chunk``, else an extend between decode steps)
sampling    greedy and sampled rows in one batch (temperature, top-k, top-p, min-p),
            and a temperature-only batch (no sort, no min-p)
decode      eager decode steps at the batch sizes no CUDA graph serves (above the
            largest captured batch, or all of them without graphs; not with speculative
            decoding, whose steps verify instead, as in every other phase): one batch size per
            distinct (next power of two, integer class of ``bs``, ``bs`` parity,
            integer class of the Triton decode kernel's split grid) key
            (`eager_decode_batch_sizes`)
==========  ==========================================================================

Whatever the model and flags select (dtype, FP8 KV cache, page size, sliding windows,
logit cap, fused kernels, skinny GEMMs, tensor parallelism, speculative verify) runs
as it will in serving, because these are real steps. Decode inside captured graphs needs
nothing: capture compiled it.

Off on CPU (PyTorch kernels only, nothing to compile) and with ``--skip-server-warmup``
(SGLang's flag). A second start-up finds the compiled binaries in Triton's on-disk cache
(``TRITON_CACHE_DIR``, default ``~/.triton/cache``) and warms up in a fraction of the time.

Measured on an H100 (`attnserve.bench.startup`, fresh processes with empty Triton caches,
bf16, default flags, 2026-11): after graph capture the warm-up compiles 12 Triton
specialisations (``_extend_fwd_kernel`` 6, ``_num_kv_splits_kernel`` 4 for the eager
decode sizes above the 256-row graphs, ``_rope_kernel`` 1 for odd token counts,
``_create_kv_indices_kernel`` 1 for unaligned prefix lengths) in 12.2 s on the Qwen3-0.6B
shape (1.0 s from the disk cache) and 15.3 s on the Llama-3-8B shape. First batch / the
same batch again, Llama-3-8B shape, 64 x 2,080 -> 32 tokens: 3.602 / 3.601 s (without the
warm-up 10.84 / 3.62 s, 4 kernels compiled in the first); 64 prompts with 1,920 cached
tokens each: 0.696 / 0.700 s. (Measured before the sm_90 plain-prefill rule of
`attnserve.attention.triton_ops.extend_tuning`, which adds two plain-prefill extend
specialisations on sm_90: the long tiles' 2,049- and 4,096-token waves.)
"""

from __future__ import annotations

import itertools
import logging
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from attnserve.engine.sampling_params import SamplingParams
from attnserve.engine.schedule_batch import SchedulerStats

logger = logging.getLogger(__name__)

#: extend lengths that make ``cdiv(length, BLOCK_M)`` 1, "neither", and a multiple of 16
#: for the extend kernel's query tiles of 32, 64 and 128 rows (``extend_config``)
EXTEND_LENGTHS = (7, 200, 512, 1024, 2048)
#: extra prompt lengths of the four-request waves (token counts and ``bs % 4`` classes)
_SIDE_LENGTHS = (9, 24, 31)
#: cached prefix of the prefix phase, in tokens (rounded up to whole pages)
_PREFIX_TOKENS = 32
#: output tokens of a warm-up request that only needs its prefill (one decode step too)
_NEW_TOKENS = 2
#: engine steps one wave may take before the warm-up gives up (a scheduler bug)
_MAX_WAVE_STEPS = 100_000


@dataclass(frozen=True)
class WarmupRequest:
    """One request of a wave: submitted once the wave has run ``after_steps`` engine steps."""

    prompt_ids: Tuple[int, ...]
    params: SamplingParams
    after_steps: int = 0


@dataclass(frozen=True)
class WarmupWave:
    """Requests run together to completion; ``fresh_cache``: drop every cached prefix first
    (so that no earlier warm-up prompt is matched)."""

    requests: Tuple[WarmupRequest, ...]
    fresh_cache: bool = False


@dataclass(frozen=True)
class WarmupPhase:
    """A named group of waves (see the table in the module docstring)."""

    name: str
    waves: Tuple[WarmupWave, ...]


@dataclass(frozen=True)
class WarmupLimits:
    """What the plan must respect, read from a built engine (`from_engine`).

    Attributes:
        vocab_size: prompt ids are drawn from ``[0, vocab_size)``.
        max_request_tokens: prompt + output of one request at most (context and pool).
        pool_tokens: KV slots of the pool.
        max_running_requests / chunked_prefill_size: the scheduler's limits.
        graph_max_bs: largest decode batch a captured CUDA graph serves (0: none).
        page_size: KV page size (cached prefixes are whole pages).
        max_queued_requests: the waiting-queue bound (None: unbounded).
        grid_splits: the Triton decode kernel's split grid for ``bs`` rows
            (`triton_decode_grid`), or None when decode does not run that kernel.
        speculative: decoding runs speculative verify steps (no plain decode steps to warm).
    """

    vocab_size: int
    max_request_tokens: int
    pool_tokens: int
    max_running_requests: int
    chunked_prefill_size: int
    graph_max_bs: int
    page_size: int = 1
    max_queued_requests: Optional[int] = None
    grid_splits: Optional[Callable[[int], int]] = None
    speculative: bool = False

    @classmethod
    def from_engine(cls, engine) -> "WarmupLimits":
        runner, args = engine.model_runner, engine.server_args
        limits = getattr(runner, "serving_limits", None)  # the memory-sized limits, where the runner has them
        mrr = limits.max_running_requests if limits is not None else args.max_running_requests
        chunk = limits.chunked_prefill_size if limits is not None else args.chunked_prefill_size
        graphs = runner.cuda_graph_runner
        return cls(
            vocab_size=engine.model_config.vocab_size, max_request_tokens=engine.max_request_tokens,
            pool_tokens=engine.max_total_tokens, max_running_requests=int(mrr), chunked_prefill_size=int(chunk),
            graph_max_bs=graphs.max_bs if graphs is not None else 0, page_size=runner.page_size,
            max_queued_requests=args.max_queued_requests, grid_splits=triton_decode_grid(runner),
            speculative=engine.scheduler.spec is not None,
        )


@dataclass
class WarmupReport:
    """What `run_warmup` did: per-phase seconds (in plan order), engine steps, requests,
    total seconds, and the Triton kernel specialisations compiled meanwhile: their number
    (None when they cannot be counted: no Triton, or the interpreter) and how many of each
    kernel (``kernel name -> count``)."""

    phase_seconds: Dict[str, float] = field(default_factory=dict)
    steps: int = 0
    requests: int = 0
    seconds: float = 0.0
    triton_compiles: Optional[int] = None
    compiled_kernels: Dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineOccupancy:
    """What an idle engine holds: free KV slots, free ``req_to_token`` rows, tokens in the
    prefix cache, request records. `run_warmup` leaves these as it found them."""

    free_slots: int
    free_rows: int
    cached_tokens: int
    requests: int

    @classmethod
    def of(cls, engine) -> "EngineOccupancy":
        s = engine.scheduler
        return cls(s.allocator.available_size(), s.req_to_token_pool.available_size(), s.tree_cache.total_size(),
                   len(s.requests))


class TritonCompileCounter:
    """Context manager recording each Triton kernel specialisation compiled (or loaded
    from the on-disk cache) in this process while it is active, through Triton's
    ``knobs.runtime.jit_cache_hook`` (called on every in-process kernel-cache miss; any
    hook already installed is still called, and its answer kept).

    Attributes:
        kernels: one description per specialisation (kernel name, launch options and
            argument types, as Triton formats it).
        available: False when nothing can be counted (no ``triton.knobs``, or
            ``TRITON_INTERPRET``, which compiles nothing).
    """

    def __init__(self) -> None:
        self.kernels: List[str] = []
        self.available = False
        self._runtime = None
        self._previous = None

    def __enter__(self) -> "TritonCompileCounter":
        from attnserve.triton_env import triton_interpreting

        try:
            from triton import knobs
        except ImportError:  # no Triton, or one older than its knobs (3.4)
            return self
        if triton_interpreting() or not hasattr(knobs.runtime, "jit_cache_hook"):
            return self
        self._runtime, self._previous = knobs.runtime, knobs.runtime.jit_cache_hook
        self._runtime.jit_cache_hook = self._hook
        self.available = True
        return self

    def _hook(self, *args, **kwargs):
        self.kernels.append(str(kwargs.get("repr") or kwargs.get("fn") or "?"))
        return self._previous(*args, **kwargs) if self._previous is not None else None

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook = self._previous
            self._runtime = None

    @property
    def count(self) -> Optional[int]:
        return len(self.kernels) if self.available else None

    def by_kernel(self) -> Dict[str, int]:
        """``kernel name -> specialisations compiled``."""
        out: Dict[str, int] = {}
        for k in self.kernels:
            name = k.split("[", 1)[0]
            out[name] = out.get(name, 0) + 1
        return out


# ---- the plan --------------------------------------------------------------------------
def _int_class(n: int) -> str:
    """Triton's specialisation of an integer argument: 1, a multiple of 16, or neither."""
    return "1" if n == 1 else ("16" if n % 16 == 0 else "n")


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def triton_decode_grid(runner) -> Optional[Callable[[int], int]]:
    """The split-grid size (``grid_splits``, an integer argument of the Triton decode
    kernel's first stage) that `decode_attention_fwd` launches for ``bs`` rows on this
    engine, as a function of ``bs``; None when decode does not run the ``triton`` backend.

    Mirrors `decode_attention_fwd`: ``decode_grid_splits(bs, Hkv * head blocks,
    max_kv_splits, SMs)`` with the head blocks of ``decode_config``'s ``block_h``.
    """
    from attnserve.attention.triton_backend import TritonAttnBackend

    backend = getattr(runner.attn_backend, "decode_backend", runner.attn_backend)
    if not isinstance(backend, TritonAttnBackend):
        return None
    from attnserve.attention.triton_ops.decode_attention import decode_config, decode_grid_splits

    dev = torch.device(backend.device)
    cuda = dev.type == "cuda"
    props = torch.cuda.get_device_properties(dev) if cuda else None
    group = backend.num_q_heads // backend.num_kv_heads
    cfg = decode_config(backend.config.head_dim, group, runner.kv_cache_dtype, is_hip=torch.version.hip is not None,
                        max_shared_mem=int(getattr(props, "shared_memory_per_block_optin", 0) or 0) if cuda else 0,
                        device_name=torch.cuda.get_device_name(dev) if cuda else "")
    block_h = max(16, cfg.block_h) if cfg.block_h > 1 else 1
    head_blocks = 1 if block_h == 1 and group == 1 else -(-group // block_h)
    head_programs = backend.num_kv_heads * head_blocks
    sms = props.multi_processor_count if cuda else 4  # the interpreter's pretend GPU (decode_attention)
    max_splits = backend.max_kv_splits
    return lambda bs: decode_grid_splits(bs, head_programs, max_splits, sms)


def eager_decode_batch_sizes(lo: int, hi: int, grid_splits: Optional[Callable[[int], int]] = None) -> List[int]:
    """Batch sizes in ``[lo, hi]``, descending, one per distinct key ``(next_pow2(bs),
    class of bs, bs % 2, class of grid_splits(bs))`` (classes: `_int_class`): the block
    sizes derived from the batch, the ``bs`` argument of the split-count kernel, the
    16-byte alignment of the packed per-token int64 views at byte ``8 * bs * k``, and the
    decode kernel's split grid. The largest size of each key is kept. Empty if ``lo > hi``."""
    chosen: Dict[tuple, int] = {}
    for bs in range(hi, max(lo, 1) - 1, -1):
        g = _int_class(grid_splits(bs)) if grid_splits is not None else None
        chosen.setdefault((_next_pow2(bs), _int_class(bs), bs % 2, g), bs)
    return sorted(chosen.values(), reverse=True)


class _Prompts:
    """Seeded random prompts; the first tokens of one wave's prompts differ (no shared
    uncached prefix, which would hold requests back from the same step)."""

    def __init__(self, vocab_size: int, seed: int):
        self.vocab = vocab_size
        self.rng = random.Random(seed)
        self.first = itertools.count(self.rng.randrange(vocab_size))

    def make(self, n: int) -> Tuple[int, ...]:
        return (next(self.first) % self.vocab,) + tuple(self.rng.randrange(self.vocab) for _ in range(n - 1))


def _greedy(max_new: int = _NEW_TOKENS, seed: int = 0) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, seed=seed)


def _wave(prompts: Sequence[Tuple[int, ...]], fresh: bool = False, max_new: int = _NEW_TOKENS) -> WarmupWave:
    return WarmupWave(tuple(WarmupRequest(p, _greedy(max_new, i)) for i, p in enumerate(prompts)), fresh)


def _lengths(limit: int) -> List[int]:
    """`EXTEND_LENGTHS` capped at ``limit`` (so ``limit`` itself, the class of the longest
    extend serving can run, when 2048 does not fit)."""
    return sorted({max(1, min(n, limit)) for n in EXTEND_LENGTHS})


def long_plain_lengths(limit: int) -> List[int]:
    """Plain-prefill lengths above ``extend_tuning.SM90_SHORT_MAX_LEN``, where sm_90 takes
    the ``SM90_LONG`` tiles (`extend_tuning.sm90_plain_prefill_config`): the shortest whose
    ``cdiv(length, SM90_LONG.block_m)`` is "neither" (2,049: 17 tiles of 128 rows) and the
    shortest whose count is a multiple of 16 (4,096: 32), each capped at ``limit`` (the
    longest plain extend the engine can run); empty when ``limit`` does not exceed the
    threshold (serving never launches those tiles)."""
    from attnserve.attention.triton_ops.extend_tuning import SM90_LONG, SM90_SHORT_MAX_LEN

    if limit <= SM90_SHORT_MAX_LEN:
        return []
    bm, first = SM90_LONG.block_m, SM90_SHORT_MAX_LEN + 1
    tiles = -(-first // bm)
    neither = first if _int_class(tiles) == "n" else tiles * bm + 1
    sixteen = -(-tiles // 16) * 16 * bm
    return sorted({min(neither, limit), min(sixteen, limit)})


def build_warmup_plan(limits: WarmupLimits, seed: int = 0) -> List[WarmupPhase]:
    """The warm-up phases for an engine with ``limits`` (module docstring), every request
    within them: prompt + output fit ``max_request_tokens``, no step holds more than the
    pool, the running-request count or the chunk, the queue bound is respected."""
    p = _Prompts(limits.vocab_size, seed)
    chunk = limits.chunked_prefill_size
    longest = min(limits.max_request_tokens - _NEW_TOKENS, chunk, limits.pool_tokens // 2)
    lengths = _lengths(longest)
    four = [min(n, longest) for n in (EXTEND_LENGTHS[1],) + _SIDE_LENGTHS]
    phases = []

    # plain prefill: bs 1 / T odd; bs 4 / T even; each longer length alone; a full chunk
    waves = [_wave([p.make(lengths[0])], fresh=True), _wave([p.make(n) for n in four], fresh=True)]
    waves += [_wave([p.make(n)], fresh=True) for n in lengths[2:]]
    waves += [_wave([p.make(n)], fresh=True) for n in long_plain_lengths(longest) if n not in lengths]
    fill, per = min(chunk, limits.pool_tokens // 2), lengths[-1]
    full = ([per] * (fill // per) + ([fill % per] if fill % per else []))[:limits.max_running_requests]
    if len(full) > 1:
        waves.append(_wave([p.make(n) for n in full], fresh=True))
    phases.append(WarmupPhase("prefill", tuple(waves)))

    # the same over a cached prefix of whole pages
    ps = limits.page_size
    pre = -(-_PREFIX_TOKENS // ps) * ps
    room = min(limits.max_request_tokens - _NEW_TOKENS - pre, limits.pool_tokens // 4 - pre, chunk)  # one step
    if room >= 1:
        bases = [p.make(pre + 1) for _ in range(4)]
        waves = [_wave(bases, fresh=True), _wave([bases[0]])]  # a fully cached prompt: a one-token extend
        sides = [min(n, room) for n in four]
        waves.append(_wave([bases[i][:pre] + p.make(n) for i, n in enumerate(sides)]))
        waves += [_wave([bases[i % 4][:pre] + p.make(n)]) for i, n in enumerate(_lengths(room)[2:])]
        phases.append(WarmupPhase("prefix", tuple(waves)))

    # a prompt longer than one chunk (needs a context and a pool above the chunk)
    over = min(chunk + EXTEND_LENGTHS[1], limits.max_request_tokens - _NEW_TOKENS, limits.pool_tokens // 2)
    if over > chunk:
        phases.append(WarmupPhase("chunked", (_wave([p.make(over)], fresh=True),)))

    # a prefill arriving while another request decodes
    short = min(16, longest)
    arrival = (WarmupRequest(p.make(short), _greedy(8, 0)),
               WarmupRequest(p.make(min(40, longest)), _greedy(_NEW_TOKENS, 1), after_steps=2))
    phases.append(WarmupPhase("mixed", (WarmupWave(arrival, fresh_cache=True),)))

    # samplers: greedy, top-k, top-p, min-p in one batch; temperature alone in another
    kinds = (dict(temperature=0.0), dict(temperature=0.8, top_k=20), dict(temperature=1.0, top_p=0.9),
             dict(temperature=1.0, min_p=0.05))
    mixed = tuple(WarmupRequest(p.make(short), SamplingParams(max_new_tokens=4, ignore_eos=True, seed=i, **kw))
                  for i, kw in enumerate(kinds))
    plain = tuple(WarmupRequest(p.make(short), SamplingParams(max_new_tokens=4, temperature=0.7, ignore_eos=True,
                                                              seed=10 + i)) for i in range(2))
    phases.append(WarmupPhase("sampling", (WarmupWave(mixed, fresh_cache=True), WarmupWave(plain))))

    decode = None if limits.speculative else _eager_decode_wave(limits, p)
    if decode is not None:
        phases.append(WarmupPhase("decode", (decode,)))
    return phases


def _eager_decode_wave(limits: WarmupLimits, p: _Prompts) -> Optional[WarmupWave]:
    """One-token prompts whose outputs end in turn, so that successive decode steps run
    exactly the batch sizes of `eager_decode_batch_sizes` (largest first): with ``b_s`` rows
    at decode step ``s`` (``b_{k+1} = 0``), ``b_s - b_{s+1}`` requests generate ``s + 1``
    tokens. None when every decode batch size has a graph."""
    hi = min(limits.max_running_requests, limits.chunked_prefill_size, limits.max_queued_requests or 1 << 30)
    sizes = eager_decode_batch_sizes(limits.graph_max_bs + 1, hi, limits.grid_splits)
    # every request holds 1 + its tokens; keep to half the pool
    while sizes and sizes[0] * (len(sizes) + 2) > limits.pool_tokens // 2:
        sizes = sizes[1:]
    if not sizes:
        return None
    reqs = []
    for s, (b, nxt) in enumerate(zip(sizes, sizes[1:] + [0]), start=1):
        reqs += [WarmupRequest(p.make(1), _greedy(s + 1, len(reqs) + i)) for i in range(b - nxt)]
    return WarmupWave(tuple(reqs), fresh_cache=True)


# ---- running it ------------------------------------------------------------------------
def warmup_enabled(server_args, device_type: str) -> bool:
    """The start-up warm-up runs on CUDA unless ``--skip-server-warmup``."""
    return device_type == "cuda" and not server_args.skip_server_warmup


def warm_up_at_start(engine) -> Optional[WarmupReport]:
    """`run_warmup` when `warmup_enabled` (called once by `Engine` after the scheduler and
    the CUDA graphs exist, so before a server reports healthy); logs its total time."""
    if not warmup_enabled(engine.server_args, engine.model_runner.device.type):
        return None
    report = run_warmup(engine)
    compiled = "" if report.triton_compiles is None else f", {report.triton_compiles} Triton kernel variants compiled"
    logger.warning("warm-up: %d phases (%s), %d requests, %d steps%s in %.2f s", len(report.phase_seconds),
                   ", ".join(report.phase_seconds), report.requests, report.steps, compiled, report.seconds)
    return report


def run_warmup(engine, plan: Optional[List[WarmupPhase]] = None, progress: Optional[bool] = None) -> WarmupReport:
    """Run ``plan`` (default: `build_warmup_plan` of the engine's limits) through
    ``engine``, then give back everything it took (see the module docstring).

    Args:
        engine: an idle `attnserve.engine.engine.Engine` (its prefix cache is flushed).
        progress: a tqdm bar over the waves (default: when stderr is a terminal; otherwise
            one INFO log line per phase).

    Returns:
        a `WarmupReport`.

    Raises:
        RuntimeError: the engine has requests, a wave does not finish, or the engine is
            not left as it was found (a bug, named).
    """
    sched = engine.scheduler
    if sched.has_work():
        raise RuntimeError("the warm-up needs an idle engine (requests are waiting or running)")
    sched.flush_prefix_cache()
    start = EngineOccupancy.of(engine)
    plan = build_warmup_plan(WarmupLimits.from_engine(engine)) if plan is None else plan
    show = sys.stderr.isatty() if progress is None else progress
    from tqdm import tqdm

    bar = tqdm(total=sum(len(ph.waves) for ph in plan), desc="warm-up", unit="batch", disable=not show)
    report, rids = WarmupReport(), []
    t0 = time.perf_counter()
    try:
        with TritonCompileCounter() as compiles:
            for phase in plan:
                t = time.perf_counter()
                bar.set_postfix_str(phase.name)
                for wave in phase.waves:
                    report.steps += _run_wave(engine, wave, rids)
                    bar.update(1)
                report.phase_seconds[phase.name] = time.perf_counter() - t
                if not show:
                    logger.info("warm-up %s: %d batches in %.2f s", phase.name, len(phase.waves),
                                report.phase_seconds[phase.name])
        report.triton_compiles, report.compiled_kernels = compiles.count, compiles.by_kernel()
    finally:
        bar.close()
    _restore(engine, rids, start)
    report.requests = len(rids)
    report.seconds = time.perf_counter() - t0
    return report


def _run_wave(engine, wave: WarmupWave, rids: List[str]) -> int:
    """Submit ``wave``'s requests (each once ``after_steps`` steps have run and the waiting
    queue is below ``--max-queued-requests``) and step until all are finished and
    processed; returns the steps taken."""
    if wave.fresh_cache and not engine.scheduler.flush_prefix_cache():
        raise RuntimeError("the warm-up could not flush the prefix cache between waves")
    todo = sorted(wave.requests, key=lambda r: r.after_steps)
    bound = engine.server_args.max_queued_requests or len(todo) + 1
    reqs, steps = [], 0
    while todo or not all(r.finished for r in reqs):
        while todo and todo[0].after_steps <= steps and len(engine.scheduler.waiting) < bound:
            r = todo.pop(0)
            prompt = list(r.prompt_ids)
            engine.check_prompt(prompt, r.params)
            rid = f"warmup-{len(rids)}"
            reqs.append(engine.add_request(prompt, r.params, rid=rid))
            rids.append(rid)
        engine.step()
        steps += 1
        if steps > _MAX_WAVE_STEPS:
            raise RuntimeError(f"a warm-up wave did not finish in {_MAX_WAVE_STEPS} steps")
    engine.scheduler.flush()
    failed = [f"{r.rid}: {r.error}" for r in reqs if r.error]
    if failed:
        raise RuntimeError(f"warm-up requests failed ({'; '.join(failed)})")
    return steps


def _restore(engine, rids: Sequence[str], start: EngineOccupancy) -> None:
    """Forget the warm-up's requests and cached prefixes, check that every slot and row
    came back, and reset the allocators' order, the future-token map and the counters."""
    sched = engine.scheduler
    sched.flush()
    for rid in rids:
        sched.forget(rid)
    if not sched.flush_prefix_cache():
        raise RuntimeError("the warm-up left requests in the scheduler")
    now = EngineOccupancy.of(engine)
    if now != start:
        raise RuntimeError(f"the warm-up did not give back what it took: {now} after, {start} before")
    if sched.allocator.available_size() == sched.allocator.size:
        sched.allocator.clear()  # hand out slots in the start-up order again
    if sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size:
        sched.req_to_token_pool.clear()
    sched.token_map.zero_()
    sched.stats = SchedulerStats()
    sched.new_token_ratio = sched.policy.init_ratio
    if sched.spec is not None:
        sched.spec.stats = type(sched.spec.stats)()
