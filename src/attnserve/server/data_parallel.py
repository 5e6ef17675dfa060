"""Data parallelism (``--dp-size N``): N engine replicas behind one server.

Each replica is an engine process (`attnserve.server.engine_process`) with its own
scheduler, KV pools and radix cache, built from the same `ServerArgs` with ``dp_size=1``;
replica ``i`` sees GPUs ``[i*tp, (i+1)*tp)`` of the visible ones (``CUDA_VISIBLE_DEVICES``
set in its process before CUDA starts; its tensor-parallel ranks inherit it), and on CPU
it gets ``cores / (dp_size * tp_size)`` threads so that the replicas do not oversubscribe
the cores. Every replica runs in a process group of its own.

`DataParallelController` stands where one `EngineClient` stands for the HTTP handlers
(`submit`, `abort`, `state`, drain, start and stop): it owns one `EngineClient` per replica,
all on the app's event loop, and sends each request to the replica a
`attnserve.distributed.dp_balancer.LoadBalancer` picks (least outstanding work with prefix
affinity by default; ``--load-balance-method``), a request's work being its estimated share
of the floor (`attnserve.distributed.dp_request_cost.RequestCost`, from replica 0's model
facts) until it ends. `DataParallelController.submit_many` places a batch sent at once
costliest first (``DataParallelLLM.generate``).

A replica that dies (its process exits, or its engine loop does) ends only its own requests,
at once, with 503 ``engine_dead`` naming it (``data-parallel replica 1 died; ...``); what it
left behind in its process group is killed; the server logs which replica died and how many
still serve; ``/health`` answers 200 ``{"status": "degraded", "dead_replicas": [1]}``
(503 once none is left); new requests go to the live replicas only. SGLang's
``--dp-size`` runs its replicas behind a data-parallel controller the same way (one
scheduler process per replica), without the per-replica failure isolation.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import os
import signal
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

from attnserve.distributed.dp_balancer import LoadBalancer, NoLiveReplica, ReplicaLoad
from attnserve.distributed.dp_request_cost import RequestCost
from attnserve.server.engine_client import EngineClient, RemoteEngine
from attnserve.server.engine_loop import EngineError, StreamEvent, SubmitCommand

logger = logging.getLogger(__name__)


def _all_dead() -> EngineError:
    return EngineError(503, "every data-parallel replica has died", "server_error", "engine_dead")


def _shutting_down() -> EngineError:
    return EngineError(503, "the server is shutting down", "server_error", "shutting_down")


def replica_devices(server_args, visible: Optional[List[str]] = None) -> List[Optional[str]]:
    """``CUDA_VISIBLE_DEVICES`` of each replica (None entries on CPU).

    Args:
        visible: the GPUs this process sees (default: ``CUDA_VISIBLE_DEVICES`` if set, else
            ``0 .. device_count-1``).

    Raises:
        ValueError: fewer than ``dp_size * tp_size`` GPUs are visible.
    """
    dp, tp = server_args.dp_size, server_args.tp_size
    if server_args.resolved_device() != "cuda":
        return [None] * dp
    if visible is None:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        if env:
            visible = [d.strip() for d in env.split(",") if d.strip()]
        else:
            import torch

            visible = [str(i) for i in range(torch.cuda.device_count())]
    if len(visible) < dp * tp:
        raise ValueError(f"--dp-size {dp} x --tp-size {tp} needs {dp * tp} GPUs, but {len(visible)} are visible")
    return [",".join(visible[i * tp:(i + 1) * tp]) for i in range(dp)]


def replica_threads(server_args) -> Optional[int]:
    """Torch threads per replica on CPU (cores shared by every replica's ranks); None on CUDA."""
    if server_args.resolved_device() == "cuda":
        return None
    return max(1, (os.cpu_count() or 1) // (server_args.dp_size * server_args.tp_size))


class DataParallelController:
    """The engine-loop interface over several replicas (see the module doc).

    Args:
        clients: one started-or-not `EngineClient` per replica, ``dp_rank`` = index.
        balancer: the routing policy.
        tokenizer: the (shared) tokenizer, or None.
        metrics: the server's metrics (a `DataParallelMetrics` gets per-replica series).
        request_cost: a request's estimated work (default `RequestCost.tokens`).
    """

    def __init__(self, clients: List[EngineClient], balancer: LoadBalancer, tokenizer=None, metrics=None,
                 request_cost: Optional[RequestCost] = None):
        self.clients = clients
        self.balancer = balancer
        self.request_cost = request_cost or RequestCost.tokens()
        self.tokenizer = tokenizer
        self._metrics = None
        self.metrics = metrics
        self.routed = [0] * len(clients)  # requests sent to each replica since start
        self._draining = False
        self._stopping = False
        for c in clients:
            c.on_closed = self._on_replica_closed_cb(c.dp_rank)

    # ---- metrics -------------------------------------------------------------------------
    @property
    def metrics(self):
        return self._metrics

    @metrics.setter
    def metrics(self, metrics) -> None:
        self._metrics = metrics
        for i, c in enumerate(self.clients):
            if metrics is None:
                c.metrics = None
            elif hasattr(metrics, "for_replica"):
                c.metrics = metrics.for_replica(i)
            else:
                c.metrics = metrics

    # ---- lifecycle -----------------------------------------------------------------------
    async def start_async(self) -> None:
        """Connect every replica on the running event loop (the app's lifespan calls it)."""
        for c in self.clients:
            await c.start_async()

    @property
    def thread_id(self) -> Optional[int]:
        return self.clients[0].thread_id

    def is_alive(self) -> bool:
        """True while at least one replica serves and no stop was asked."""
        return not self._stopping and any(c.is_alive() for c in self.clients)

    def dead_replicas(self) -> List[int]:
        """``dp_rank`` of every replica that died (not counting a stop)."""
        if self._stopping:
            return []
        return [c.dp_rank for c in self.clients if c.thread_id is not None and not c.is_alive()]

    async def stop_async(self, timeout: float = 10.0) -> None:
        self._stopping = True
        await asyncio.gather(*(c.stop_async(timeout) for c in self.clients))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every replica (their requests end with 503 ``shutting_down``); idempotent."""
        self._stopping = True
        for c in self.clients:
            c.stop(timeout)

    def begin_drain(self, grace_s: float) -> None:
        self._draining = True
        for c in self.clients:
            c.begin_drain(grace_s)

    @property
    def draining(self) -> bool:
        return self._draining

    def wait_drained(self, timeout: Optional[float] = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for c in self.clients:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not c.wait_drained(left):
                return False
        return True

    # ---- requests ------------------------------------------------------------------------
    def loads(self) -> List[ReplicaLoad]:
        return [ReplicaLoad(alive=c.is_alive() or (c.thread_id is None and c.process.is_alive()),
                            num_requests=c.num_in_flight, outstanding_work=c.outstanding_work)
                for c in self.clients]

    def cost(self, cmd: SubmitCommand) -> float:
        """``cmd``'s estimated work (`request_cost` of its prompt and ``max_new_tokens``)."""
        return self.request_cost(len(cmd.prompt_ids), cmd.sampling_params.max_new_tokens)

    def submit(self, cmd: SubmitCommand) -> Optional[int]:
        """Send the request to the replica the balancer picks (503 when none is alive).

        Returns:
            the chosen ``dp_rank``, or None when the request was refused here."""
        if self._stopping or self._draining:
            self._push(cmd.stream, StreamEvent(error=_shutting_down()))
            return None
        try:
            rank = self.balancer.select(cmd.prompt_ids, self.loads())
        except NoLiveReplica:
            self._push(cmd.stream, StreamEvent(error=_all_dead()))
            return None
        self.routed[rank] += 1
        self.clients[rank].submit(cmd, self.cost(cmd))
        return rank

    def submit_many(self, cmds: List[SubmitCommand]) -> List[Optional[int]]:
        """`submit` for a batch sent at once: placed costliest first
        (`LoadBalancer.select_many`), then sent in the given order.

        Returns:
            each request's ``dp_rank``, None where it was refused here."""
        costs = [self.cost(c) for c in cmds]
        refused = _shutting_down() if self._stopping or self._draining else None
        if refused is None:
            try:
                ranks = self.balancer.select_many([c.prompt_ids for c in cmds], costs, self.loads())
            except NoLiveReplica:
                refused = _all_dead()
        if refused is not None:
            for c in cmds:
                self._push(c.stream, StreamEvent(error=refused))
            return [None] * len(cmds)
        for cmd, rank, cost in zip(cmds, ranks, costs):
            self.routed[rank] += 1
            self.clients[rank].submit(cmd, cost)
        return list(ranks)

    def abort(self, rid: str) -> None:
        """Abort ``rid`` on whichever replica has it (unknown ids are ignored)."""
        for c in self.clients:
            c.abort(rid)

    def flush_cache(self) -> None:
        """`EngineClient.flush_cache` on every live replica."""
        for c in self.clients:
            if c.is_alive() or c.thread_id is None:
                c.flush_cache()

    def state(self) -> Dict[str, Any]:
        """The replicas' snapshots summed (`dp_metrics.sum_states`), plus ``replicas``: one
        entry per replica with its ``dp_rank``, ``alive``, ``in_flight``, ``routed`` and
        snapshot, and ``dead_replicas``."""
        from attnserve.server.dp_metrics import sum_states

        states = [c.state() for c in self.clients]
        out = sum_states(states)
        out["dp_size"] = len(self.clients)
        out["dead_replicas"] = self.dead_replicas()
        out["replicas"] = [{"dp_rank": i, "alive": c.is_alive(), "pid": c.process.pid, "in_flight": c.num_in_flight,
                            "routed": self.routed[i], **states[i]} for i, c in enumerate(self.clients)]
        return out

    # ---- plumbing ------------------------------------------------------------------------
    def _push(self, stream, event: StreamEvent) -> None:
        import threading

        if threading.get_ident() == self.thread_id:
            stream.put(event)
        else:
            stream.push(event)

    def _on_replica_closed_cb(self, dp_rank: int):
        ref = weakref.ref(self)

        def cb(err: EngineError) -> None:
            me = ref()
            if me is not None:
                me._on_replica_closed(dp_rank, err)

        return cb

    def _on_replica_closed(self, dp_rank: int, err: EngineError) -> None:
        client = self.clients[dp_rank]
        _kill_group(client.process)
        if self._stopping or err.code == "shutting_down":
            return
        if self._metrics is not None and hasattr(self._metrics, "set_replica_up"):
            self._metrics.set_replica_up(dp_rank, False)
        live = [c.dp_rank for c in self.clients if c.is_alive()]
        logger.critical("attnserve: data-parallel replica %d (pid %s, exit code %s) died; %d of %d replicas still "
                        "serve: %s", dp_rank, client.process.pid, client.process.exitcode, len(live),
                        len(self.clients), live)


def _kill_group(process) -> None:
    """Kill what is left of a replica's process group (its tensor-parallel ranks) and reap
    the replica's own process."""
    pid = process.pid
    if pid is not None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass
    process.join(2.0)


def _stop_at_exit(ref) -> None:
    ctl = ref()
    if ctl is not None:
        ctl.stop(timeout=5.0)


def start_data_parallel(server_args, log_level: Optional[int] = None, poll_s: float = 0.5, with_metrics: bool = True,
                        model_name: Optional[str] = None) -> Tuple[RemoteEngine, DataParallelController]:
    """Start ``server_args.dp_size`` engine processes at once and wait until all are ready.

    ``with_metrics``: give the controller a `DataParallelMetrics` (needs
    ``prometheus_client``; the offline `DataParallelLLM` goes without), labelled
    ``model_name`` (``--served-model-name``; default ``server_args.model``).

    Returns:
        ``(engine facts for the handlers, the controller to pass as `create_app`'s loop)``;
        the facts are replica 0's (every replica runs the same model and limits), and their
        `RemoteEngine.shutdown` stops every replica.

    Raises:
        as `attnserve.server.engine_client.start_engine_process`; any replica failing to
        start stops the others.
    """
    from attnserve.server.engine_client import spawn_engine_process, wait_engine_ready

    dp = server_args.dp_size
    replica_args = dataclasses.replace(server_args, dp_size=1)
    devices = replica_devices(server_args)
    threads = replica_threads(server_args)
    spawned = []
    try:
        for i in range(dp):
            env = {"CUDA_VISIBLE_DEVICES": devices[i]} if devices[i] is not None else None
            spawned.append(spawn_engine_process(replica_args, log_level, name=f"attnserve-dp{i}", env=env,
                                                num_threads=threads, new_process_group=True))
        ready = [wait_engine_ready(proc, conn, poll_s) for proc, conn in spawned]
    except BaseException:
        for proc, conn in spawned:
            if proc.is_alive():
                proc.kill()
            _kill_group(proc)
            conn.close()
        raise
    facts, tokenizer = ready[0]
    clients = [EngineClient(proc, conn, tokenizer, ready[i][0].get("state"), dp_rank=i)
               for i, (proc, conn) in enumerate(spawned)]
    balancer = LoadBalancer(dp, server_args.load_balance_method)
    request_cost = RequestCost.from_roofline_facts(facts["info"].get("roofline_model"))
    metrics = None
    if with_metrics:
        from attnserve.server.dp_metrics import DataParallelMetrics

        metrics = DataParallelMetrics(model_name or server_args.model, dp)
    ctl = DataParallelController(clients, balancer, tokenizer, metrics, request_cost)
    atexit.register(_stop_at_exit, weakref.ref(ctl))
    facts = dict(facts, info={**facts["info"], "dp_size": dp,
                              "replica_devices": devices if devices[0] is not None else None})
    logger.info("attnserve: %d data-parallel replicas ready (devices %s, %s threads each)", dp, devices, threads)
    return RemoteEngine(server_args, facts, ctl), ctl
