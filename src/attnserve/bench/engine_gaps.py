"""GPU idle time between and inside engine steps, from a ``torch.profiler`` Chrome trace.

The trace is one window of an engine run recorded by `attnserve.bench.engine_probe.EngineProbe`:
the main thread's ``engine.step#<i>`` ranges (``user_annotation``) and the phase ranges
inside them, the CUDA runtime/driver calls (``cuda_runtime`` / ``cuda_driver``) and the device
activity (``kernel``, ``gpu_memcpy``, ``gpu_memset``) they launched, linked by ``args.correlation``
(Kineto's Chrome trace format, as written by ``torch.profiler.profile.export_chrome_trace``).
Timestamps are microseconds on one clock for host and device (Kineto aligns CUPTI's).

Definitions, per engine step ``i`` of the window (``t_i``: host start of ``engine.step#i``):

* ``wall_us`` = ``t_{i+1} - t_i`` (the last step recorded ends at its own end);
* ``busy_us``: length of the union of device activity intervals (all streams of the device)
  clipped to ``[t_i, t_{i+1})``; ``idle_us = wall_us - busy_us``;
* ``kernel_us``: the summed durations of the device activity *launched* during step ``i``
  (programmatic dependent launch overlaps kernels, so this can exceed ``busy_us``);
* gaps: the maximal sub-intervals of the window with no device activity. A gap whose
  neighbours come from one launch call (one ``cudaGraphLaunch``) is ``in_graph``; otherwise it
  is ``between_launches`` and is attributed to ``resumed_by``, the innermost phase range around
  the call that launched the activity ending the gap, ``host_late_us`` (how long after the
  device went idle that call was made; 0 when it was made before) and ``host_at_start``, the
  innermost phase range (and runtime call, e.g. ``cudaEventSynchronize``) the host was in
  when the device went idle.

Without CUDA (a CPU engine) the main thread's ``cpu_op`` intervals stand in for the device
timeline, each op its own launch.
"""

from __future__ import annotations

import bisect
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

STEP_PREFIX = "engine.step#"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset")  # older Kineto: Kernel, Memcpy...
LAUNCH_CATS = ("cuda_runtime", "cuda_driver", "runtime", "driver")
SYNC_CALLS = ("Synchronize", "cudaMemcpy ", "cudaMemcpy(")  # host blocks on the device in these

#: kernel class -> name substrings (lower case), first match wins; memcpy/memset go by category
KERNEL_CLASSES = (
    ("attention", ("decode_stage", "attention", "attn", "flash", "fwd_kernel", "extend", "kv_indices",
                   "kv_splits", "mla", "paged")),
    ("gemm", ("gemm", "gemv", "nvjet", "cublas", "cutlass", "xmma", "splitkreduce", "scaled_mm", "matmul",
              "skinny", "sm90_", "sm80_", "ampere_", "wgmma")),
    ("norm_rope", ("norm", "rope", "rotary")),
    ("activation", ("silu", "gelu", "act_and_mul", "swiglu")),
    ("sampling", ("argmax", "sampl", "softmax", "topk", "top_k", "top_p", "multinomial", "penalt", "logit")),
)


def kernel_class(name: str, cat: str = "kernel") -> str:
    """``attention``, ``gemm``, ``norm_rope``, ``activation``, ``sampling``, ``memcpy`` or ``other``
    for a device activity of trace category ``cat`` named ``name`` (CPU ops: by name alone)."""
    if cat in ("gpu_memcpy", "gpu_memset", "memcpy", "memset") or name.startswith(("Memcpy", "Memset")):
        return "memcpy"
    low = name.lower()
    for cls, subs in KERNEL_CLASSES:
        if any(s in low for s in subs):
            return cls
    return "other"


# ----------------------------------------------------------------------------- intervals
def union_intervals(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Sorted, disjoint union of ``(start, end)`` intervals (empty or inverted ones dropped);
    touching intervals merge."""
    out: List[List[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def covered_length(merged: Sequence[Tuple[float, float]], lo: float, hi: float) -> float:
    """Length of ``merged`` (a `union_intervals` result) inside ``[lo, hi)``."""
    total = 0.0
    i = max(bisect.bisect_right(merged, (lo, float("inf"))) - 1, 0)
    for s, e in merged[i:]:
        if s >= hi:
            break
        total += max(0.0, min(e, hi) - max(s, lo))
    return total


def idle_gaps(merged: Sequence[Tuple[float, float]], lo: float, hi: float) -> List[Tuple[float, float]]:
    """The sub-intervals of ``[lo, hi)`` not covered by ``merged`` (sorted); their lengths add
    up to ``(hi - lo) - covered_length(merged, lo, hi)``."""
    gaps, t = [], lo
    first = max(bisect.bisect_right(merged, (lo, float("inf"))) - 1, 0)
    for s, e in merged[first:]:
        if e <= lo:
            continue
        if s >= hi:
            break
        if s > t:
            gaps.append((t, s))
        t = max(t, e)
    if t < hi:
        gaps.append((t, hi))
    return gaps


# ----------------------------------------------------------------------------- trace
@dataclass
class DeviceOp:
    """One device activity (or a CPU op standing in for one), times in µs."""

    start: float
    end: float
    name: str
    cat: str
    corr: Optional[int] = None  # correlation id of the launching call (one per graph launch)
    launch_ts: Optional[float] = None  # host time of the launching call
    launch_name: str = ""


@dataclass
class Range:
    name: str
    start: float
    end: float


@dataclass
class Trace:
    """The parts of a Chrome trace the analysis reads (main thread only for host ranges)."""

    steps: List[Tuple[int, float, float]]  # (engine step index, start, end), sorted
    ranges: List[Range]  # phase ranges (user annotations other than the steps), sorted by start
    calls: List[Range]  # runtime/driver calls, sorted by start
    ops: List[DeviceOp]  # device timeline, sorted by start
    device: str  # "cuda" or "cpu"


def parse_trace(events: List[dict]) -> Trace:
    """`Trace` of a Chrome trace's ``traceEvents``.

    Raises:
        ValueError: the trace has no ``engine.step#<i>`` range.
    """
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    step_ev = [e for e in xs if str(e.get("cat", "")).lower() == "user_annotation"
               and str(e.get("name", "")).startswith(STEP_PREFIX)]
    if not step_ev:
        raise ValueError(f"no '{STEP_PREFIX}<i>' range in the trace: was it recorded by EngineProbe?")
    main = Counter(e.get("tid") for e in step_ev).most_common(1)[0][0]
    base = min(float(e["ts"]) for e in xs)  # times relative to the trace's first event: exact µs arithmetic
    steps = sorted((int(e["name"][len(STEP_PREFIX):]), float(e["ts"]) - base,
                    float(e["ts"]) - base + float(e.get("dur", 0))) for e in step_ev if e.get("tid") == main)
    steps.sort(key=lambda s: s[1])
    ranges, calls, other_calls, launches, dev, cpu_ops = [], [], [], {}, [], []
    for e in xs:
        cat = str(e.get("cat", "")).lower()
        ts, dur = float(e["ts"]) - base, float(e.get("dur", 0) or 0)
        name = str(e.get("name", ""))
        args = e.get("args") or {}
        if cat == "user_annotation" and e.get("tid") == main and not name.startswith(STEP_PREFIX):
            ranges.append(Range(name, ts, ts + dur))
        elif cat in LAUNCH_CATS:
            (calls if e.get("tid") == main else other_calls).append(Range(name, ts, ts + dur))
            if "correlation" in args:
                launches[args["correlation"]] = (ts, name)
        elif cat in DEVICE_CATS:
            dev.append(DeviceOp(ts, ts + dur, name, cat, args.get("correlation")))
        elif cat == "cpu_op" and e.get("tid") == main:
            cpu_ops.append(DeviceOp(ts, ts + dur, name, cat, None, ts, name))
    for op in dev:
        ts_name = launches.get(op.corr)
        if ts_name is not None:
            op.launch_ts, op.launch_name = ts_name
    if not calls:  # runtime calls may carry another thread id than the profiler's ranges
        calls = other_calls
    if dev:
        ops = sorted(dev, key=lambda o: o.start)
    else:  # outermost CPU ops only: nested ops would count twice
        ops, end = [], float("-inf")
        for o in sorted(cpu_ops, key=lambda o: (o.start, -o.end)):
            if o.start >= end:
                ops.append(o)
                end = o.end
    ranges.sort(key=lambda r: (r.start, -r.end))
    calls.sort(key=lambda r: r.start)
    return Trace(steps, ranges, calls, ops, "cuda" if dev else "cpu")


def load_trace(path: str) -> Trace:
    """`parse_trace` of a Chrome trace file (``.json`` or ``.json.gz``)."""
    if path.endswith(".gz"):
        import gzip

        with gzip.open(path, "rt") as f:
            return parse_trace(json.load(f)["traceEvents"])
    with open(path) as f:
        return parse_trace(json.load(f)["traceEvents"])


class RangeIndex:
    """Innermost-range lookup over ranges of one thread (properly nested, as
    ``record_function`` ranges and runtime calls are): the latest range starting at or
    before ``t`` holds ``t`` or has an ancestor that does."""

    def __init__(self, ranges: Sequence[Range]):
        self.ranges = sorted(ranges, key=lambda r: (r.start, -r.end))
        self.starts = [r.start for r in self.ranges]
        self.parent: List[int] = []
        stack: List[int] = []
        for k, r in enumerate(self.ranges):
            while stack and self.ranges[stack[-1]].end <= r.start:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(k)

    def innermost(self, t: Optional[float]) -> Optional[Range]:
        """The innermost range holding ``t`` (``start <= t < end``), or None."""
        if t is None:
            return None
        k = bisect.bisect_right(self.starts, t) - 1
        while k >= 0:
            r = self.ranges[k]
            if r.start <= t < r.end:
                return r
            k = self.parent[k]
        return None


# ----------------------------------------------------------------------------- analysis
@dataclass
class StepInfo:
    """What the host launched in one engine step (from `EngineProbe`)."""

    mode: str = "none"  # forward mode of the batch, "none" when nothing was launched
    batch_size: int = 0
    context_tokens: int = 0  # Σ over the batch of the KV length after the step
    extend_tokens: int = 0  # Σ tokens computed this step


@dataclass
class WindowReport:
    steps: List[dict] = field(default_factory=list)
    gaps: List[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def _phase_name(r: Optional[Range]) -> str:
    return r.name if r is not None else "(outside phases)"


def analyse(trace: Trace, infos: Dict[int, StepInfo], first: int, last: int, top: int = 10) -> WindowReport:
    """Per-step and window figures for engine steps ``first .. last - 1`` (module doc).

    Args:
        trace: from `parse_trace`.
        infos: engine step -> `StepInfo` (missing steps count as ``none``).
        first, last: the engine steps to report (those recorded in ``trace``).
        top: how many largest gaps and idle causes to list.

    Raises:
        ValueError: none of the steps is in the trace.
    """
    idx = [k for k, (i, _, _) in enumerate(trace.steps) if first <= i < last]
    if not idx:
        raise ValueError(f"steps {first}..{last - 1} are not in the trace (recorded: "
                         f"{trace.steps[0][0]}..{trace.steps[-1][0]})")
    bounds = []
    for k in idx:
        i, s, e = trace.steps[k]
        nxt = trace.steps[k + 1][1] if k + 1 < len(trace.steps) else e
        bounds.append((i, s, max(nxt, s)))
    lo, hi = bounds[0][1], bounds[-1][2]
    ops = [o for o in trace.ops if o.end > lo and o.start < hi]
    merged = union_intervals((max(o.start, lo), min(o.end, hi)) for o in ops)
    phases, calls = RangeIndex(trace.ranges), RangeIndex(trace.calls)
    step_starts = [b[1] for b in bounds]

    def step_of(t: Optional[float]) -> Optional[int]:
        if t is None or t < lo or t >= hi:
            return None
        return bisect.bisect_right(step_starts, t) - 1

    # activity launched in each step, and kernel classes
    launched_us = [0.0] * len(bounds)
    first_launch = [None] * len(bounds)
    class_us: Dict[str, float] = defaultdict(float)
    phase_kernel_us: Dict[str, float] = defaultdict(float)
    for o in ops:
        class_us[kernel_class(o.name, o.cat)] += min(o.end, hi) - max(o.start, lo)
        k = step_of(o.launch_ts)
        if k is not None:
            launched_us[k] += o.end - o.start
            first_launch[k] = o.start if first_launch[k] is None else min(first_launch[k], o.start)
            phase_kernel_us[_phase_name(phases.innermost(o.launch_ts))] += o.end - o.start

    # gaps over the whole window, attributed
    starts = [o.start for o in ops]
    ends_sorted = sorted(ops, key=lambda o: o.end)
    end_keys = [o.end for o in ends_sorted]
    gaps = []
    for g0, g1 in idle_gaps(merged, lo, hi):
        j = bisect.bisect_left(starts, g1 - 1e-6)
        nxt = ops[j] if j < len(ops) else None
        p = bisect.bisect_right(end_keys, g0 + 1e-6) - 1
        prev = ends_sorted[p] if p >= 0 else None
        kind = "edge" if nxt is None or prev is None else (
            "in_graph" if prev.corr is not None and prev.corr == nxt.corr else "between_launches")
        host = phases.innermost(g0)
        call = calls.innermost(g0)
        resumed = "(window end)" if nxt is None else (
            "(launch not traced)" if nxt.launch_ts is None else _phase_name(phases.innermost(nxt.launch_ts)))
        k = step_of(g0)
        gaps.append({
            "start_us": g0 - lo, "dur_us": g1 - g0, "step": bounds[k][0] if k is not None else None, "kind": kind,
            "prev": prev.name[:80] if prev else None, "next": nxt.name[:80] if nxt else None,
            "resumed_by": resumed, "launch_call": nxt.launch_name if nxt else None,
            "host_late_us": None if nxt is None or nxt.launch_ts is None else max(0.0, nxt.launch_ts - g0),
            "host_at_start": _phase_name(host) + (f" / {call.name}" if call is not None else ""),
        })

    steps = []
    for k, (i, s, e) in enumerate(bounds):
        info = infos.get(i, StepInfo())
        wall = e - s
        busy = covered_length(merged, s, e)
        pieces = [g1 - g0 for g0, g1 in idle_gaps(merged, s, e)]  # the window's gaps, cut at the step's bounds
        host_end = trace.steps[idx[k]][2]
        nxt_first = first_launch[k + 1] if k + 1 < len(first_launch) else None
        steps.append({
            "step": i, "mode": info.mode, "batch_size": info.batch_size, "context_tokens": info.context_tokens,
            "extend_tokens": info.extend_tokens, "wall_us": wall, "busy_us": busy, "idle_us": wall - busy,
            "kernel_us": launched_us[k], "host_us": host_end - s,
            "wait_us": sum(min(r.end, host_end) - r.start for r in trace.ranges
                           if s <= r.start < host_end and r.name.endswith("wait_ids")),
            "gpu_wall_us": (nxt_first - first_launch[k]) if first_launch[k] is not None and nxt_first else None,
            "n_gaps": len(pieces), "largest_gap_us": max(pieces, default=0.0),
        })
    report = WindowReport(steps=steps, gaps=gaps)
    report.summary = summarise(steps, gaps, class_us, phase_kernel_us, _phase_times(trace, lo, hi), top)
    report.summary["device_timeline"] = trace.device
    report.summary["launch_attributed_share"] = sum(o.launch_ts is not None for o in ops) / max(len(ops), 1)
    return report


def _phase_times(trace: Trace, lo: float, hi: float) -> Dict[str, float]:
    """Total inclusive host µs per phase range name inside ``[lo, hi)``."""
    out: Dict[str, float] = defaultdict(float)
    for r in trace.ranges:
        if lo <= r.start < hi:
            out[r.name] += r.end - r.start
    return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarise(steps: List[dict], gaps: List[dict], class_us: Dict[str, float], phase_kernel_us: Dict[str, float],
              phase_host_us: Dict[str, float], top: int = 10) -> dict:
    """Window means (ms per step), idle share, idle by gap kind and cause, largest gaps,
    device time per kernel class and host time per phase (µs per step)."""
    n = len(steps)
    wall = sum(s["wall_us"] for s in steps)
    busy = sum(s["busy_us"] for s in steps)
    by_kind: Dict[str, List[float]] = defaultdict(list)
    causes: Dict[str, List[dict]] = defaultdict(list)
    for g in gaps:
        by_kind[g["kind"]].append(g["dur_us"])
        if g["kind"] != "in_graph":
            late = g["host_late_us"]
            key = f"{g['resumed_by']} ({'host late' if late else 'launched before idle'})"
            causes[key].append(g)
    cause_rows = sorted(({
        "cause": k, "count": len(v), "total_us_per_step": sum(g["dur_us"] for g in v) / n,
        "max_us": max(g["dur_us"] for g in v),
        "host_at_start": Counter(g["host_at_start"] for g in v).most_common(1)[0][0],
    } for k, v in causes.items()), key=lambda r: -r["total_us_per_step"])[:top]
    dec = [s for s in steps if s["mode"] == "decode"]
    return {
        "steps": n, "modes": dict(Counter(s["mode"] for s in steps)),
        "mean_wall_ms": wall / n / 1e3, "mean_busy_ms": busy / n / 1e3, "mean_idle_ms": (wall - busy) / n / 1e3,
        "idle_share": (wall - busy) / wall if wall > 0 else 0.0,
        "mean_kernel_ms": _mean([s["kernel_us"] for s in steps]) / 1e3,
        "mean_host_ms": _mean([s["host_us"] for s in steps]) / 1e3,
        "mean_wait_ms": _mean([s["wait_us"] for s in steps]) / 1e3,
        "mean_gpu_wall_ms": _mean([s["gpu_wall_us"] for s in steps if s["gpu_wall_us"] is not None]) / 1e3,
        "mean_batch": _mean([s["batch_size"] for s in steps]),
        "mean_context_per_req": (sum(s["context_tokens"] for s in steps) / max(sum(s["batch_size"] for s in steps), 1)),
        "mean_context_tokens": _mean([s["context_tokens"] for s in steps]),
        "decode_steps": len(dec), "decode_mean_wall_ms": _mean([s["wall_us"] for s in dec]) / 1e3,
        "decode_mean_busy_ms": _mean([s["busy_us"] for s in dec]) / 1e3,
        "decode_mean_batch": _mean([s["batch_size"] for s in dec]),
        "decode_mean_context_per_req": (sum(s["context_tokens"] for s in dec)
                                        / max(sum(s["batch_size"] for s in dec), 1)),
        "gaps": len(gaps), "gaps_ge_10us": sum(g["dur_us"] >= 10 for g in gaps),
        "idle_us_per_step_by_kind": {k: sum(v) / n for k, v in sorted(by_kind.items())},
        "gap_count_by_kind": {k: len(v) for k, v in sorted(by_kind.items())},
        "top_idle_causes": cause_rows,
        "largest_gaps": sorted(gaps, key=lambda g: -g["dur_us"])[:top],
        "device_us_per_step_by_class": {k: v / n for k, v in sorted(class_us.items(), key=lambda kv: -kv[1])},
        "device_us_per_step_by_launch_phase": {k: v / n for k, v in sorted(phase_kernel_us.items(),
                                                                           key=lambda kv: -kv[1])},
        "host_us_per_step_by_phase": {k: v / n for k, v in sorted(phase_host_us.items(), key=lambda kv: -kv[1])},
    }


def format_summary(title: str, s: dict) -> str:
    """A compact multi-line table of `summarise`'s dict."""
    lines = [
        f"== {title}: {s['steps']} steps {s['modes']}, batch {s['mean_batch']:.1f}, "
        f"context/req {s['mean_context_per_req']:.0f} (timeline: {s.get('device_timeline', '?')})",
        f"   step wall {s['mean_wall_ms']:.3f} ms | busy {s['mean_busy_ms']:.3f} ms | idle {s['mean_idle_ms']:.3f} ms "
        f"({100 * s['idle_share']:.1f}%) | kernels launched {s['mean_kernel_ms']:.3f} ms | host {s['mean_host_ms']:.3f}"
        f" ms (wait {s['mean_wait_ms']:.3f}) | gpu-timeline step {s['mean_gpu_wall_ms']:.3f} ms",
        "   idle us/step by kind: " + ", ".join(f"{k} {v:.1f} ({s['gap_count_by_kind'][k]} gaps)"
                                              for k, v in s["idle_us_per_step_by_kind"].items()),
        "   device us/step by class: " + ", ".join(f"{k} {v:.1f}" for k, v in s["device_us_per_step_by_class"].items()),
        "   host us/step by phase: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                               list(s["host_us_per_step_by_phase"].items())[:10]),
        "   top idle causes (us/step, count, max us, host at idle start):",
    ]
    lines += [f"     {r['total_us_per_step']:8.1f} {r['count']:5d} {r['max_us']:8.1f}  {r['cause']}  "
              f"[{r['host_at_start']}]" for r in s["top_idle_causes"]]
    lines.append("   largest gaps (us, step, kind, prev -> next, resumed by, late us, host at start):")
    lines += [f"     {g['dur_us']:8.1f} {g['step']} {g['kind']} {_short(g['prev'])} -> {_short(g['next'])} "
              f"{g['resumed_by']}/{g['launch_call']} late {g['host_late_us'] or 0:.1f} [{g['host_at_start']}]"
              for g in s["largest_gaps"]]
    return "\n".join(lines)


def _short(name: Optional[str]) -> str:
    if name is None:
        return "-"
    name = re.sub(r"<.*", "<...>", name)
    return name if len(name) <= 40 else name[:37] + "..."
