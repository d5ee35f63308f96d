"""KV-tier loads into the device pool, layer by layer, so the forward pass starts on the first
layers while the later ones still cross.

A load brings whole blocks from rank 0's host memory (K/V ``[layers, 2, block_size, kv_heads,
head_dim]`` each) into fresh pool blocks. The host tier's blocks are views of layer-major slabs
(kv_tiers.host_store), so for each run of adjacent blocks one layer's K and V are one contiguous
piece: the load crosses in one copy a layer a run, on a side stream (CUDA), and each layer is
scattered into its pool blocks as soon as it is across, with an event recorded behind it. The
forward pass waits for layer i's event before layer i (AttentionMetadata.layer_ready). Blocks
that are contiguous on their own (a disk read with no host tier) cross whole, one copy a run,
before any layer.

Invariant: once ``join()`` has run, the current stream's later work sees every loaded block in
the pool. The model runner calls it as soon as the forward pass is queued, and before that
wherever other work reads the pool (block copies, chunk imports), so nothing but the layers'
own reads ever overlaps a load.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from pagedrag.worker.transfer import adjacent_runs


@dataclass
class LoadsInFlight:
    """Loads queued on ``stream`` (None: done within the call, as on CPU, or joined already):
    ``layer_ready[i]`` fires once layer i's loaded blocks are in the pool (None: no per-layer
    events; join before reading)."""

    layer_ready: list[torch.cuda.Event] | None = None
    stream: torch.cuda.Stream | None = None
    buffers: list[torch.Tensor] = field(default_factory=list)  # device memory the side stream uses

    def join(self) -> None:
        """Make the current stream's later work wait for every load; idempotent."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_stream(self.stream)
        for buffer in self.buffers:
            buffer.record_stream(self.stream)  # freed only once the side stream is done with it
        self.stream, self.layer_ready, self.buffers = None, None, []


NOTHING_LOADING = LoadsInFlight()


def stage_layers(staging: torch.Tensor, blocks: list[torch.Tensor], land_layer=None) -> LoadsInFlight:
    """Copy host ``blocks`` into ``staging`` ([layers, n, 2, block_size, kv_heads, head_dim] on the
    device, block i at index i of axis 1), then call ``land_layer(layer)`` for each layer once it
    is across (None: nothing to land; the caller joins and lands every layer at once). On CUDA
    the work runs on a side stream after the work queued so far, with an event a layer when
    ``land_layer`` is given; on an error the loads queued so far are joined before it propagates."""
    device = staging.device
    loads = LoadsInFlight(buffers=[staging])
    try:
        with _side_stream(device) as stream:
            loads.stream = stream
            runs = adjacent_runs(blocks)
            layered = [(first, span) for first, span in runs if not span[0].is_contiguous()]
            for first, span in runs:  # whole blocks: one copy a run, into the staging's layout on the device
                if span[0].is_contiguous():
                    crossed = span.to(device, non_blocking=True)
                    loads.buffers.append(crossed)
                    staging[:, first:first + span.shape[0]].copy_(crossed.transpose(0, 1))
            events = []
            for layer in range(staging.shape[0]):
                for first, span in layered:
                    staging[layer, first:first + span.shape[0]].copy_(span[:, layer], non_blocking=True)
                if land_layer is not None:
                    land_layer(layer)
                    if stream is not None:
                        events.append(stream.record_event())
            loads.layer_ready = events or None
    except BaseException:
        loads.join()
        raise
    return loads


@contextlib.contextmanager
def _side_stream(device: torch.device):
    """The device's load stream, after the work queued so far, to run the loads on; None on CPU."""
    if device.type != "cuda":
        yield None
        return
    stream = _load_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield stream


@functools.cache
def _load_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream a device for every load (making a stream each load costs host time)."""
    return torch.cuda.Stream(device)
