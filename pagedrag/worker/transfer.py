"""Host-to-device copies that never wait for the device."""

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
