"""Copies between host and device that never wait for the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of ``values`` (a list, or a list of equal-length lists) on ``device``.

    On CUDA the values are staged in pinned memory and copied without blocking: the
    copy is queued behind the work already on the stream and the host goes on at once,
    where a copy from pageable memory would first wait for that work to finish. (The
    caching host allocator keeps the pinned staging buffer alive until the copy ran.)
    """
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def device_to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying ``tensor`` to the host: (host tensor, event to synchronize before reading it).

    On CUDA the copy goes into pinned memory without blocking, and the event is recorded
    right after it: work queued on the device later (the next step) does not delay the
    wait. Elsewhere the tensor comes back as it is, with no event (reading it waits).
    """
    if tensor.device.type != "cuda":
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
