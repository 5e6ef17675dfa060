"""Start, watch and stop the processes of a tensor-parallel engine.

`--tp-size N` runs one process per rank. Rank 0 is the engine's own process (scheduler,
tokenizer, server); `TPRuntime` spawns the other local ranks (``spawn`` start method,
daemonic, SIGINT ignored so that Ctrl-C reaches rank 0 alone, which then stops them),
joins them in one ``torch.distributed`` world (NCCL on CUDA, gloo on CPU, plus a gloo group
for rank 0's step messages, which on one node travel through shared memory instead:
`step_channel`) and watches them: a rank that exits while the engine runs
stops the engine with an error naming it. With ``--nnodes`` > 1 every node runs
``ranks = tp_size / nnodes`` of them; nodes other than 0 run `run_worker_node`, which
follows rank 0 until it shuts down (``--dist-init-addr host:port`` of node 0 is the
rendezvous, as in SGLang). On one node the rendezvous is a free loopback port.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from attnserve.distributed.group import TPGroup

logger = logging.getLogger(__name__)

#: the step-message group waits this long for rank 0's next step (an idle server)
_IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class DistConfig:
    """Where one rank sits.

    Attributes:
        rank / world_size: in the tensor-parallel group.
        local_rank: index on this node (the CUDA device index).
        init_method: ``tcp://host:port`` rendezvous.
        device_type: ``"cuda"`` or ``"cpu"``.
        timeout_s: collective and rendezvous timeout of the device group.
        disable_custom_all_reduce: ``--disable-custom-all-reduce`` (NCCL for every size).
        step_broadcast: ``"shm"`` or ``"gloo"``: how rank 0's step messages travel
            (`step_channel.step_broadcast_mode`; rank 0's value decides).
        disable_allreduce_fusion: ``--disable-allreduce-fusion`` (`TPGroup.allreduce_fusion`).
    """

    rank: int
    world_size: int
    local_rank: int
    init_method: str
    device_type: str
    timeout_s: float = 600.0
    disable_custom_all_reduce: bool = False
    step_broadcast: str = "gloo"
    disable_allreduce_fusion: bool = False


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ranks_per_node(server_args) -> int:
    return server_args.tp_size // server_args.nnodes


def init_rank(cfg: DistConfig) -> TPGroup:
    """Join the world and build this rank's `TPGroup` (CUDA device ``local_rank``)."""
    import torch.distributed as dist

    backend = "nccl" if cfg.device_type == "cuda" else "gloo"
    kwargs = {}
    if cfg.device_type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast (forbidden on the machines here)
        torch.cuda.set_device(cfg.local_rank)
        kwargs["device_id"] = torch.device("cuda", cfg.local_rank)
    dist.init_process_group(backend, init_method=cfg.init_method, world_size=cfg.world_size, rank=cfg.rank,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s), **kwargs)
    world = dist.group.WORLD
    # a second gloo group for the step messages, which may wait as long as the server idles
    cpu_group = dist.new_group(list(range(cfg.world_size)), backend="gloo", timeout=_IDLE_TIMEOUT)
    tp = TPGroup(rank=cfg.rank, size=cfg.world_size, device_group=world, cpu_group=cpu_group,
                 allreduce_fusion=not cfg.disable_allreduce_fusion)
    if cfg.device_type == "cuda":  # create the NCCL communicator before any graph capture
        tp.all_reduce(torch.zeros(1, device="cuda"))
        tp.init_custom_all_reduce(torch.device("cuda", cfg.local_rank), disable=cfg.disable_custom_all_reduce)
    from attnserve.engine.tp.step_channel import setup_step_queue

    tp.step_queue = setup_step_queue(tp, cfg.step_broadcast, cfg.device_type, cfg.timeout_s)
    return tp


def set_cpu_threads(server_args) -> None:
    """Share this node's cores between its ranks (CPU devices)."""
    if server_args.resolved_device() == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_per_node(server_args)))


def _reap(p: mp.Process, timeout: float = 2.0) -> None:
    """Wait for ``p``'s exit code (another thread may be reaping it at the same time, and
    then ``exitcode`` stays None here until that thread has stored it)."""
    deadline = time.monotonic() + timeout
    while p.exitcode is None and time.monotonic() < deadline:
        p.join(0.05)


class RankDied(RuntimeError):
    """A tensor-parallel rank exited while the engine was running."""


class TPStepFailed(RuntimeError):
    """A step raised on rank 0 under tensor parallelism; the engine stopped its ranks."""


class TPRuntime:
    """The other local ranks of rank 0's node (or of a worker node): spawn, watch, stop.

    Args:
        server_args: the engine's `ServerArgs` (``tp_size`` > 1).
        first_rank: rank of this process (0 on node 0, ``node_rank * ranks_per_node``
            on the others); the processes it spawns take the next local ranks.
    """

    def __init__(self, server_args, first_rank: int = 0):
        self.server_args = server_args
        self.first_rank = first_rank
        self.procs: List[mp.Process] = []
        self.failure: Optional[str] = None
        self._stopping = False
        self.tp: Optional[TPGroup] = None
        from attnserve.engine.tp.step_channel import step_broadcast_mode

        self.step_broadcast = step_broadcast_mode(server_args)
        from attnserve.engine.tp.step_sync import tp_sample_mode

        tp_sample_mode()  # a bad ATTNSERVE_TP_SAMPLE is refused before any rank starts
        if server_args.nnodes > 1:
            self.init_method = f"tcp://{server_args.dist_init_addr}"
        else:
            self.init_method = f"tcp://127.0.0.1:{free_port()}"

    def config(self, rank: int) -> DistConfig:
        return DistConfig(rank, self.server_args.tp_size, rank - self.first_rank, self.init_method,
                          self.server_args.resolved_device(), self.server_args.dist_timeout,
                          getattr(self.server_args, "disable_custom_all_reduce", False), self.step_broadcast,
                          getattr(self.server_args, "disable_allreduce_fusion", False))

    def start(self) -> TPGroup:
        """Spawn the other local ranks, join the world as ``first_rank`` and start the
        watchdog. Raises `RankDied` when a rank exits before the world is complete."""
        from attnserve.engine.tp.worker import worker_main

        ctx = mp.get_context("spawn")
        for rank in range(self.first_rank + 1, self.first_rank + ranks_per_node(self.server_args)):
            p = ctx.Process(target=worker_main, args=(self.server_args, self.config(rank), os.getpid()),
                            name=f"attnserve-tp{rank}", daemon=True)
            p.start()
            self.procs.append(p)
        set_cpu_threads(self.server_args)
        result: dict = {}

        def join():
            try:
                result["tp"] = init_rank(self.config(self.first_rank))
            except BaseException as e:  # reported by the waiting thread
                result["error"] = e

        t = threading.Thread(target=join, name="attnserve-tp-init", daemon=True)
        t.start()
        while t.is_alive():  # the rendezvous cannot be interrupted: watch the ranks meanwhile
            t.join(0.2)
            dead = self._dead()
            if dead is not None and t.is_alive():
                self.stop()
                raise RankDied(f"tensor-parallel rank {dead[0]} exited with code {dead[1]} during start-up "
                               "(its error is logged above)")
        if "error" in result:
            self.stop()
            raise result["error"]
        self.tp = result["tp"]
        if self.tp.step_queue is not None and self.tp.step_queue.is_writer:
            self.tp.step_queue.abort_check = lambda: self.failure  # a dead rank ends a wait on a full ring
        threading.Thread(target=self._watch, name="attnserve-tp-watchdog", daemon=True).start()
        return self.tp

    def _dead(self):
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                return self.first_rank + 1 + i, p.exitcode
        return None

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}
        while sentinels and not self._stopping:
            ready = wait(list(sentinels), timeout=1.0)
            if self._stopping:
                return
            for s in ready:
                i = sentinels.pop(s)
                p = self.procs[i]
                _reap(p)
                self.failure = (f"tensor-parallel rank {self.first_rank + 1 + i} (pid {p.pid}) exited with code "
                                f"{p.exitcode}; the engine stopped")
                logger.error("%s", self.failure)
                self._kill_all()
                if self.server_args.resolved_device() == "cuda":
                    # NCCL collectives do not notice a dead peer: give the engine's own error
                    # path a moment, then end the process rather than hang
                    time.sleep(10.0)
                    logger.error("exiting: %s", self.failure)
                    os._exit(1)
                return

    def check(self, wait_s: float = 0.0) -> None:
        """Raise `RankDied` if a rank has died (waiting up to ``wait_s`` for the watchdog to
        notice: a collective may fail a moment before the rank's exit is seen)."""
        if self.failure is None and wait_s <= 0:  # the per-step path: the watchdog's verdict only
            return
        deadline = time.monotonic() + wait_s
        while True:
            dead = self._dead()
            if self.failure is None and dead is not None and not self._stopping:
                self.failure = f"tensor-parallel rank {dead[0]} exited with code {dead[1]}; the engine stopped"
            if self.failure is not None:
                raise RankDied(self.failure)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def abort(self, reason: str) -> None:
        """Stop every rank now, without the SHUTDOWN message (they may be waiting inside a
        collective that will never complete): kill them and release the process groups.
        Later `check` calls raise `RankDied` with ``reason``."""
        if self.failure is None:
            self.failure = reason
        self.stop(timeout=0.0)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5.0)

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to ``timeout`` s for the ranks to exit (after rank 0 sent SHUTDOWN),
        then kill what is left; destroys this process's process group."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        if self.tp is not None:
            self.tp.close_step_queue()
        _release_process_groups()


def _release_process_groups(timeout_s: float = 10.0) -> None:
    """Tear down this process's groups without ever hanging the caller.

    gloo: ``destroy_process_group``. NCCL: ``destroy_process_group`` was seen to wait forever
    in ``ncclCommDestroy`` once CUDA graphs had captured the communicator and the other ranks
    had exited (2 H200s, torch 2.11, NCCL 2.28); the teardown runs as ``_abort_process_group``
    (no wait on peers; also resets the default group so another engine can start) in a
    daemon thread, and after ``timeout_s`` the engine stops waiting for it (logged).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return

    def release():
        try:
            if dist.get_backend() == "nccl":
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
            else:
                dist.destroy_process_group()
        except Exception:  # a broken group (a rank died): nothing left to release
            pass

    t = threading.Thread(target=release, name="attnserve-tp-teardown", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        logger.warning("tensor-parallel process group teardown did not finish in %.0f s; continuing without it "
                       "(another tensor-parallel engine cannot start in this process)", timeout_s)


def run_worker_node(server_args) -> int:
    """Run the ranks of node ``node_rank`` > 0 until rank 0 shuts the engine down.

    Returns:
        the number of steps this node's first rank ran.
    """
    from attnserve.engine.tp.worker import build_rank, follow

    server_args.check()
    if server_args.node_rank == 0:
        raise ValueError("run_worker_node is for --node-rank >= 1; node 0 runs the engine itself")
    runtime = TPRuntime(server_args, first_rank=server_args.node_rank * ranks_per_node(server_args))
    tp = runtime.start()
    runner = None
    try:
        runner = build_rank(server_args, tp)
        return follow(runner, tp)
    finally:
        try:
            if runner is not None:
                runner.release_cuda_graphs()  # before the groups: see `ModelRunner.release_cuda_graphs`
        finally:
            runtime.stop()
