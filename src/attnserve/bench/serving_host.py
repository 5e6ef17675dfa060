"""Host-time counters of a served benchmark run (`attnserve.bench.serving`).

Before and after each run the benchmark reads the engine loop's cumulative counters from
``/debug/state`` (engine steps; the loop thread's CPU seconds in all and inside
`Engine.step` alone, `attnserve.server.engine_loop.EngineLoop`) and, for a server it
launched, the CPU seconds of the server process and of its children (the engine process,
tensor-parallel ranks) from ``/proc`` (Linux; absent elsewhere).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional


def _loop_counters(base_url: str, api_key: Optional[str]) -> Dict[str, float]:
    """The engine loop's cumulative counters from ``/debug/state`` ({} when absent)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        st = httpx.get(base_url + "/debug/state", headers=headers, timeout=10.0).json()
    except Exception:
        return {}
    return {k: float(st[k]) for k in ("num_steps", "loop_cpu_seconds", "step_cpu_seconds") if k in st}


def _proc_cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _child_pids(pid: int) -> List[int]:
    out: List[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def cpu_snapshot(base_url: str, api_key: Optional[str], pid: Optional[int]) -> Dict[str, Any]:
    """Counters read before and after a run: the engine loop's (`_loop_counters`) and,
    for a launched server, the CPU seconds of its process and of each child (the engine
    process, tensor-parallel ranks)."""
    snap: Dict[str, Any] = {"loop": _loop_counters(base_url, api_key)}
    if pid is not None:
        snap["server_process_s"] = _proc_cpu_seconds(pid)
        snap["children_s"] = {c: _proc_cpu_seconds(c) for c in _child_pids(pid)}
    return snap


def cpu_delta(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, Any]:
    """Per-run host time: engine steps, the loop thread's CPU per step inside the
    scheduler (``step_cpu_ms_per_step``) and outside it (``serving_cpu_ms_per_step``:
    commands, stream events, state; with the engine in a thread of the HTTP process this
    work holds the GIL the scheduler needs), and CPU seconds of the server process and of
    its children over the run."""
    b, a = before.get("loop", {}), after.get("loop", {})
    out: Dict[str, Any] = {}
    if all(k in a and k in b for k in ("num_steps", "loop_cpu_seconds", "step_cpu_seconds")):
        steps = a["num_steps"] - b["num_steps"]
        step = a["step_cpu_seconds"] - b["step_cpu_seconds"]
        loop = a["loop_cpu_seconds"] - b["loop_cpu_seconds"]
        out.update(engine_steps=int(steps), loop_cpu_s=loop, step_cpu_s=step,
                   step_cpu_ms_per_step=1e3 * step / max(steps, 1),
                   serving_cpu_ms_per_step=1e3 * (loop - step) / max(steps, 1))
    if before.get("server_process_s") is not None and after.get("server_process_s") is not None:
        out["server_process_cpu_s"] = after["server_process_s"] - before["server_process_s"]
        kids = [after["children_s"][c] - before["children_s"].get(c, 0.0)
                for c in after.get("children_s", {}) if after["children_s"][c] is not None]
        out["children_cpu_s"] = sum(x for x in kids if x is not None)
    return out
