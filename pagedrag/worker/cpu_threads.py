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

from pagedrag.worker.fork_trial import HUNG, UNKNOWN, exit_code_in_a_fork, on_the_forking_thread
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


def threads_start_in_a_fork(threads: int, timeout_s: float = 2.0) -> int:
    """How a trial of ``threads`` OpenMP threads started from this thread ends in a fork of this
    process: 0 where they ran, else fork_trial's HUNG, UNKNOWN or an exit code.

    GNU OpenMP (torch's CPU build) cannot start them from the copy of a thread that had run a
    parallel region before the fork: that region never returns (a gunicorn --preload or Celery
    prefork worker whose parent had embedded documents). Other threads, and new ones, start
    theirs. In a process forked by this thread, and that has not run torch on it since, the
    answer holds for the process itself."""
    def trial() -> int:
        torch.set_num_threads(threads)
        torch.ones(1 << 20).cos_()  # far above ATen's grain size: a parallel region
        return 0

    return exit_code_in_a_fork(trial, timeout_s)


def configure_cpu_threads(requested: int | None, processes: int = 1) -> ThreadTuner | None:
    """Set torch's intra-op threads to ``requested`` or, by default, this process's share of
    the physical cores (``processes`` tensor-parallel ranks share them). Returns the tuner
    that adjusts the count step by step: only by default and in a process of its own (ranks
    of one step wait on each other, so one rank's timing says little about its threads).
    Called on the forking thread of a forked process, where OpenMP may not start threads
    (``threads_start_in_a_fork``), it sets one thread, for the whole process, with a warning;
    so also where this thread ran torch since the fork (the trial fails then too): one thread
    is the safe side."""
    threads = requested if requested is not None else max(physical_cores_available() // processes, 1)
    trial = threads_start_in_a_fork(threads) if threads > 1 and on_the_forking_thread() else 0
    if trial != 0:
        outcome = "hung" if trial == HUNG else "could not be read" if trial == UNKNOWN else f"exited {trial}"
        logger.warning("CPU compute threads: 1, not %d%s: this process is a fork, and a trial of %d OpenMP "
                       "threads from this thread %s (GNU OpenMP cannot start threads from the copy of a "
                       "thread that ran torch on several before the fork: they hang). Start engine "
                       "processes with the 'spawn' method, or load the app after forking (gunicorn "
                       "without --preload), to use more.",
                       threads, " (cpu_threads)" if requested is not None else "", threads, outcome)
        requested = threads = 1
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    tuned = requested is None and processes == 1 and threads > 1
    logger.info("CPU compute threads: %s%s", f"1 to {threads}" if tuned else threads,
                " (measured per step size; cpu_threads to fix)" if tuned else "")
    return ThreadTuner(threads) if tuned else None
