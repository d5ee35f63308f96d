"""The tensor-parallel group: which rank this process is, and the collectives the model
and the step loop use.

Two process groups over the same ranks: the *device* group (NCCL on CUDA, gloo on CPU)
carries activations (all-reduce, all-gather, the input ids of in-flight tokens), and the
*control* group (always gloo, on the host) carries rank 0's step plans.

Invariants:
- At size 1 every collective is the identity and nothing of torch.distributed is touched,
  so the one-device path is exactly what it was before tensor parallelism.
- Every rank calls the same collectives in the same order; rank 0 decides (the plan) and
  the others follow, so an error between the plan's broadcast and the step's last
  collective cannot be recovered from: it is raised as TensorParallelFailure, which the
  engine treats as fatal.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class TensorParallelFailure(RuntimeError):
    """A worker died, or the ranks fell out of step: the engine cannot go on."""


@dataclass
class TensorParallelGroup:
    """Rank ``rank`` of ``size``. ``check_peers`` raises TensorParallelFailure when a worker
    this process started has exited (a no-op where the ranks were started by torchrun)."""

    rank: int = 0
    size: int = 1
    device_group: object | None = None
    control_group: object | None = None
    check_peers: Callable[[], None] = field(default=lambda: None)

    @property
    def is_driver(self) -> bool:
        """Rank 0: it schedules, samples and talks to the user."""
        return self.rank == 0

    # ---- loading: which part of a full tensor this rank holds -----------------
    def part(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's share of ``total`` rows split evenly; the last
        shares may be short or empty when ``size`` does not divide ``total`` (vocab padding)."""
        per_rank = -(-total // self.size)
        start = min(self.rank * per_rank, total)
        return start, min(per_rank, total - start)

    # ---- collectives on activations (device group) ----------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place (capturable in a CUDA graph under NCCL)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` (same shape everywhere) joined along ``dim``, rank r's part r-th:
        [..., C, ...] -> [..., size * C, ...]."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place (same shape and dtype everywhere)."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=0, group=self.device_group)
        return x

    # ---- the step plan and start-up agreement (control group) -----------------
    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` (any picklable value) on every rank; the others pass nothing."""
        if self.size == 1:
            return obj
        if self.is_driver:
            self.check_peers()
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self._control(torch.distributed.broadcast, length, src=0)
        if not self.is_driver:
            payload = torch.empty(int(length), dtype=torch.uint8)
        self._control(torch.distributed.broadcast, payload, src=0)
        return obj if self.is_driver else pickle.loads(payload.numpy().tobytes())

    def all_gather_object(self, obj: object) -> list:
        """Every rank's ``obj`` (any picklable value), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        gathered: list = [None] * self.size
        try:
            torch.distributed.all_gather_object(gathered, obj, group=self.control_group)
        except RuntimeError as error:
            self.check_peers()
            raise TensorParallelFailure(f"tensor-parallel rank {self.rank} lost its peers: {error}") from error
        return gathered

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` any rank holds (e.g. the KV blocks every device can fit)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        self._control(torch.distributed.all_reduce, tensor, op=torch.distributed.ReduceOp.MIN)
        return int(tensor)

    def _control(self, collective, tensor: torch.Tensor, **kwargs) -> None:
        try:
            collective(tensor, group=self.control_group, **kwargs)
        except RuntimeError as error:  # gloo: a peer closed its connection or timed out
            self.check_peers()
            raise TensorParallelFailure(f"tensor-parallel rank {self.rank} lost its peers: {error}") from error


SINGLE = TensorParallelGroup()
