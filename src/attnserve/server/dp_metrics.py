"""Prometheus metrics of a data-parallel server (``--dp-size N``): totals and per replica.

`DataParallelMetrics` is the server's `ServerMetrics` (the totals, labelled ``model_name``
only) plus one `ServerMetrics` per replica. `for_replica` gives the object an
`EngineClient` feeds: every event goes both to the replica's metrics and to the totals;
state snapshots are kept per replica and the totals' gauges take their sum (their mean for
ratios). `render` writes one exposition in which every family holds the total sample and
one sample per replica with a ``dp_rank`` label (``attnserve_num_running_reqs{model_name=
"m"}`` and ``attnserve_num_running_reqs{dp_rank="1",model_name="m"}``), plus
``attnserve_dp_replica_up{dp_rank}`` (1 while the replica serves, 0 once it died).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from attnserve.server.metrics import ServerMetrics

#: state keys averaged over replicas instead of summed
_MEAN_KEYS = ("new_token_ratio", "spec_accept_length")


def sum_states(states: List[Optional[Dict[str, Any]]]) -> Dict[str, Any]:
    """The replicas' state snapshots combined: numbers summed (`_MEAN_KEYS` averaged),
    anything else taken from the first replica that has it. None entries are skipped."""
    have = [s for s in states if s]
    out: Dict[str, Any] = {}
    for st in have:
        for k, v in st.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                out.setdefault(k, v)
            else:
                out[k] = out.get(k, 0) + v
    for k in _MEAN_KEYS:
        vals = [s[k] for s in have if k in s]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


class _ReplicaFeed:
    """What one replica's `EngineClient` calls (`ServerMetrics`'s feeding methods)."""

    def __init__(self, parent: "DataParallelMetrics", dp_rank: int):
        self.parent = parent
        self.dp_rank = dp_rank
        self.own = parent.replicas[dp_rank]

    def on_accept(self, prompt_tokens: int) -> None:
        self.own.on_accept(prompt_tokens)
        self.parent.on_accept(prompt_tokens)

    def on_reject(self, status: int) -> None:
        self.own.on_reject(status)
        self.parent.on_reject(status)

    def on_first_token(self, ttft_s: float) -> None:
        self.own.on_first_token(ttft_s)
        self.parent.on_first_token(ttft_s)

    def on_inter_token(self, gap_s: float, num_tokens: int = 1) -> None:
        self.own.on_inter_token(gap_s, num_tokens)
        self.parent.on_inter_token(gap_s, num_tokens)

    def on_generated(self, num_tokens: int) -> None:
        self.own.on_generated(num_tokens)
        self.parent.on_generated(num_tokens)

    def on_finish(self, finish_reason: str, e2e_s: float) -> None:
        self.own.on_finish(finish_reason, e2e_s)
        self.parent.on_finish(finish_reason, e2e_s)

    def set_state(self, state: Dict[str, Any]) -> None:
        self.own.set_state(state)
        self.parent.set_replica_state(self.dp_rank, state)


class DataParallelMetrics(ServerMetrics):
    """Totals (this object, a `ServerMetrics`) and ``replicas[i]`` for replica ``i``.

    Args:
        model_name: the ``model_name`` label.
        dp_size: number of replicas.
    """

    def __init__(self, model_name: str, dp_size: int):
        from prometheus_client import Gauge

        super().__init__(model_name)
        self.replicas = [ServerMetrics(model_name) for _ in range(dp_size)]
        self._states: List[Optional[Dict[str, Any]]] = [None] * dp_size
        self._up = Gauge("dp_replica_up", "1 while the data-parallel replica serves, 0 once it died.",
                         ["model_name", "dp_rank"], registry=self.registry, namespace="attnserve")
        for i in range(dp_size):
            self._up.labels(model_name, str(i)).set(1)

    def for_replica(self, dp_rank: int) -> _ReplicaFeed:
        return _ReplicaFeed(self, dp_rank)

    def set_replica_state(self, dp_rank: int, state: Dict[str, Any]) -> None:
        self._states[dp_rank] = state
        self.set_state(sum_states(self._states))

    def set_replica_up(self, dp_rank: int, up: bool) -> None:
        self._up.labels(self.model_name, str(dp_rank)).set(1 if up else 0)

    def render(self) -> bytes:
        """One exposition: each family's total sample and its per-replica samples."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged(self))
        return generate_latest(registry)


class _Merged:
    """A collector yielding the totals' families with the replicas' samples added."""

    def __init__(self, metrics: DataParallelMetrics):
        self.metrics = metrics

    def collect(self):
        fams = {f.name: f for f in self.metrics.registry.collect()}
        for rank, rep in enumerate(self.metrics.replicas):
            for fam in rep.registry.collect():
                target = fams.get(fam.name)
                if target is None:
                    continue
                target.samples.extend(s._replace(labels={**s.labels, "dp_rank": str(rank)}) for s in fam.samples)
        yield from fams.values()
