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


def tensor_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``, copied as ``host_to_device`` copies (pinned, not waiting)."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


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


def queued_work_done(device: torch.device) -> torch.cuda.Event | None:
    """An event that fires once the work queued on ``device``'s current stream so far is done;
    None off CUDA, where work is done when its call returns."""
    if device.type != "cuda":
        return None
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    return done


def adjacent_runs(tensors: Sequence[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """(index of the first, one tensor [n, *shape] spanning them) for each run of equally shaped
    contiguous tensors that lie back to back in one storage (the host KV tier's slabs), in order:
    what crosses to the device in one copy instead of one per tensor."""
    runs: list[tuple[int, torch.Tensor]] = []
    start, first, count = 0, None, 0
    for index, tensor in enumerate(tensors):
        if first is not None and _follows(first, count, tensor):
            count += 1
            continue
        if first is not None:
            runs.append((start, _span(first, count)))
        start, first, count = index, tensor, 1
    if first is not None:
        runs.append((start, _span(first, count)))
    return runs


def _follows(first: torch.Tensor, count: int, tensor: torch.Tensor) -> bool:
    return (tensor.is_contiguous() and first.is_contiguous() and tensor.shape == first.shape
            and tensor.dtype == first.dtype
            and tensor.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and tensor.storage_offset() == first.storage_offset() + count * first.numel())


def _span(first: torch.Tensor, count: int) -> torch.Tensor:
    if count == 1:
        return first[None]
    return first.as_strided((count, *first.shape), (first.numel(), *first.stride()), first.storage_offset())
