"""What the engine does when a step raises: fail only the requests the error traces to.

Validation at the edge (pagedrag.engine.inputs) keeps known bad input out of steps; this is
the net under it. A step that raises leaves the engine consistent once every request
it touched (its suspects) starts over from its known tokens, as after a preemption by
recompute. One suspect is the cause and fails alone. Several are put on probation:
each runs one step on its own; the one whose solo step raises fails, the others go
back to normal scheduling having lost only the recompute. The engine is dead only
for a device failure, or when step after step keeps failing whatever runs in it.
"""

from __future__ import annotations

import os
from collections import deque

import torch

from pagedrag.distributed.group import TensorParallelFailure

# Markers of errors that leave the device (and so every request on it) unusable.
_DEVICE_FAILURE_MARKERS = ("CUDA error", "CUBLAS_STATUS", "cuDNN error", "device-side assert",
                           "illegal memory access", "NCCL error")
# This many failed steps in a row, each failing its requests, mean the model is broken.
MAX_CONSECUTIVE_FAILED_STEPS = 8


class EngineDeadError(RuntimeError):
    """The engine cannot take requests any more (shut down, or its device or model failed)."""


FORKED = ("this engine belongs to the process this one was forked from (os.fork); "
          "make a new engine in this process")


def check_not_forked(owner_pid: int) -> None:
    """Raise EngineDeadError (FORKED) in a process forked from the one whose id is
    ``owner_pid``: the engine's threads, worker processes and tier writer stayed there."""
    if os.getpid() != owner_pid:
        raise EngineDeadError(FORKED)


class RequestFailedError(RuntimeError):
    """A step failed in a way traced to this request; the request was aborted, others went on."""


def is_device_failure(error: BaseException) -> bool:
    """True for errors of the device itself (CUDA faults, device out of memory) and for a
    tensor-parallel group that fell apart (a worker died, or the ranks fell out of step)."""
    if isinstance(error, TensorParallelFailure):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return any(marker in str(error) for marker in _DEVICE_FAILURE_MARKERS)


class Probation:
    """Request groups awaiting a step of their own after a failed step, oldest first.

    Invariant: a group is in the queue at most once; ``consecutive_failures`` counts
    failed steps since the last step that succeeded.
    """

    def __init__(self):
        self.queue: deque[str] = deque()
        self.consecutive_failures = 0

    def __bool__(self) -> bool:
        return bool(self.queue)

    def add(self, group_ids: list[str]) -> None:
        self.queue.extend(g for g in group_ids if g not in self.queue)

    def head(self) -> str:
        return self.queue[0]

    def release_head(self) -> None:
        self.queue.popleft()

    def record(self, failed: bool) -> None:
        """Count a step; raises EngineDeadError after too many failed steps in a row."""
        self.consecutive_failures = self.consecutive_failures + 1 if failed else 0
        if self.consecutive_failures >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise EngineDeadError(f"{self.consecutive_failures} engine steps in a row failed, each with "
                                  "different requests: the model or the device is broken")
