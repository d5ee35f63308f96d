"""How many threads CPU compute uses.

torch's default is one OpenMP thread per logical CPU. On a 2-core machine with other work
running, that ran a batch-1 generate 7-10x slower than one thread: threads that share a
core wait on each other every operator. The default here is at most one thread per
physical core this process may run on, and a single process (no tensor parallelism) lets a
ThreadTuner pick, per step size, the count that measures fastest (worker/thread_tuner.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pagedrag.worker.thread_tuner import ThreadTuner

logger = logging.getLogger("pagedrag")


def physical_cores_available() -> int:
    """Distinct physical cores among the CPUs this process may run on (its affinity),
    counting hyper-thread siblings once."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = {_siblings(cpu) for cpu in cpus}
    return max(len(cores), 1)


def _siblings(cpu: int) -> str:
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        return path.read_text().strip()
    except OSError:
        return str(cpu)


def configure_cpu_threads(requested: int | None, processes: int = 1) -> ThreadTuner | None:
    """Set torch's intra-op threads to ``requested`` or, by default, this process's share of
    the physical cores (``processes`` tensor-parallel ranks share them). Returns the tuner
    that adjusts the count step by step: only by default and in a process of its own (ranks
    of one step wait on each other, so one rank's timing says little about its threads)."""
    threads = requested if requested is not None else max(physical_cores_available() // processes, 1)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    tuned = requested is None and processes == 1 and threads > 1
    logger.info("CPU compute threads: %s%s", f"1 to {threads}" if tuned else threads,
                " (measured per step size; cpu_threads to fix)" if tuned else "")
    return ThreadTuner(threads) if tuned else None
