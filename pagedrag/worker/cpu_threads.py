"""How many threads CPU compute uses.

torch's default is one OpenMP thread per logical CPU, spinning while it waits. On a
2-core machine with other work running, that ran a batch-1 generate 7-10x slower than
one thread: threads that spin or share a core wait on each other every operator. The
default here is one thread per physical core this process may run on.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

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


def configure_cpu_threads(requested: int | None, processes: int = 1) -> int:
    """Set torch's intra-op threads to ``requested`` or, by default, this process's share of
    the physical cores (``processes`` tensor-parallel ranks share them); returns it."""
    threads = requested if requested is not None else max(physical_cores_available() // processes, 1)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    logger.info("CPU compute threads: %d%s", threads, "" if requested else " (physical cores; cpu_threads to change)")
    return threads
