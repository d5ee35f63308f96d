"""Starting and stopping the tensor-parallel ranks.

Rank 0 is the engine's own process. It starts one worker process per other rank
(``python -m pagedrag.distributed.worker``, not a fork of the user's script, so a script
without a ``__main__`` guard is not run again), meets them through a TCP store on
localhost, and forms the process groups (pagedrag.distributed.group). Under torchrun the
ranks exist already: rank 0 goes on as the engine, and the other ranks become workers
inside ``LLM(...)`` and leave the process (SystemExit(0)) when rank 0's engine stops, so a
script's code after ``LLM(...)`` runs on rank 0 only.

Invariants: a worker that exits is noticed by rank 0 at its next collective (a closed
connection) or plan (its exit code is polled), and raised as TensorParallelFailure naming
it; stopping never waits on a peer for more than STOP_TIMEOUT_S seconds; a rank that stops
holds no process group afterwards (gloo's threads still alive at interpreter exit abort
the process: "terminate called without an active exception").
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedrag.distributed.group import SINGLE, TensorParallelFailure, TensorParallelGroup

logger = logging.getLogger("pagedrag")

STARTUP_TIMEOUT_S = 600  # workers import torch and load their shard before joining
STOP_TIMEOUT_S = 10
# Workers wait for rank 0's next plan however long the engine idles.
IDLE_TIMEOUT = timedelta(days=365)


class TensorParallelRanks:
    """This process's place in the tensor-parallel group, and the workers it started."""

    def __init__(self, group: TensorParallelGroup, workers: list[subprocess.Popen]):
        self.group = group
        self.workers = workers
        self.stopped = group.size == 1
        if workers:
            group.check_peers = self.check_workers

    def check_workers(self) -> None:
        """TensorParallelFailure if a worker this process started has exited."""
        for rank, worker in enumerate(self.workers, start=1):
            code = worker.poll()
            if code is not None:
                raise TensorParallelFailure(
                    f"tensor-parallel worker rank {rank} (pid {worker.pid}) exited with code {code}; "
                    "the engine cannot go on (see the worker's error above)")

    def stop(self) -> None:
        """Tell the workers to leave (rank 0's None plan), wait for them, kill stragglers,
        and leave the process groups (so that another engine may form new ones)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self.group.broadcast_object(None)
        except Exception:  # a worker is gone already: kill the rest below
            pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in self.workers:
            try:
                worker.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        _leave_groups(self.group)


def start_ranks(args) -> TensorParallelRanks:
    """The ranks of ``args.tensor_parallel_size`` (EngineArgs): one rank, or rank 0 with its
    workers started and joined. Under torchrun a rank other than 0 runs as a worker here and
    never returns (SystemExit(0) once rank 0 stops)."""
    size = args.tensor_parallel_size
    if size == 1:
        return TensorParallelRanks(SINGLE, [])
    _check_model_splits(args, size)
    device = args.resolved_device()
    device_type = device.type
    if device_type == "cuda" and torch.cuda.device_count() < (device.index or 0) + size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs from cuda:{device.index or 0} on, "
                         f"{torch.cuda.device_count()} are visible")
    if _under_torchrun():
        return _join_torchrun(args, size, device_type)
    port = free_port()
    workers = [_start_worker(rank, size, port, args) for rank in range(1, size)]
    try:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        _wait_for_workers(store, TensorParallelRanks(TensorParallelGroup(0, size), workers))
        group = join_group(0, size, device_type, store)
    except BaseException:
        for worker in workers:
            worker.kill()
        raise
    return TensorParallelRanks(group, workers)


def _check_model_splits(args, size: int) -> None:
    """ValueError, before any worker starts, when ``size`` does not divide the model's heads."""
    from pagedrag.models.llama import check_splittable
    from pagedrag.models.loader import model_config

    check_splittable(model_config(args.model, args.model_source())[1], size)


def join_group(rank: int, size: int, device_type: str, store: dist.Store | None) -> TensorParallelGroup:
    """Form the process groups (store None: torchrun's environment) and return this rank's view."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=IDLE_TIMEOUT,
                            init_method=None if store is not None else "env://")
    world = dist.group.WORLD
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if backend == "nccl" else world
    return TensorParallelGroup(rank, size, world, control)


def announce(store: dist.Store, rank: int) -> None:
    """A worker's first word to rank 0: it runs and reached the store."""
    store.set(f"pagedrag/worker/{rank}", "up")


def _wait_for_workers(store: dist.Store, ranks: TensorParallelRanks) -> None:
    """Wait until every worker announced itself, failing early (with its exit code) if one exits."""
    keys = [f"pagedrag/worker/{rank}" for rank in range(1, ranks.group.size)]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check(keys):
        ranks.check_workers()
        if time.monotonic() > deadline:
            raise TensorParallelFailure(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S} s")
        time.sleep(0.05)


def _start_worker(rank: int, size: int, port: int, args) -> subprocess.Popen:
    """``python -m pagedrag.distributed.worker``, its orders pickled on its standard input."""
    worker = subprocess.Popen([sys.executable, "-m", "pagedrag.distributed.worker"], stdin=subprocess.PIPE)
    worker.stdin.write(pickle.dumps((rank, size, port, args)))
    worker.stdin.close()
    return worker


def _under_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _join_torchrun(args, size: int, device_type: str) -> TensorParallelRanks:
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world_size != size:
        raise ValueError(f"tensor_parallel_size={size}, but torchrun started {world_size} processes")
    group = join_group(rank, size, device_type, None)
    if not group.is_driver:
        from pagedrag.distributed.worker import serve
        serve(args, group)
        _leave_groups(group)
        raise SystemExit(0)
    return TensorParallelRanks(group, [])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _leave_groups(group: TensorParallelGroup) -> None:
    """destroy_process_group, given STOP_TIMEOUT_S (NCCL teardown after collectives captured in
    CUDA graphs has been seen to hang, and a stopping engine must not). ``group`` lets go of
    the process groups first, so that destroy_process_group drops the last references and
    their threads end within it, not during interpreter exit, where gloo's abort the process."""
    group.device_group = group.control_group = None
    if not dist.is_initialized():
        return
    leaving = threading.Thread(target=dist.destroy_process_group, daemon=True)
    leaving.start()
    leaving.join(STOP_TIMEOUT_S)
    if leaving.is_alive():
        logger.warning("leaving the tensor-parallel process group did not finish in %d s; going on",
                       STOP_TIMEOUT_S)
