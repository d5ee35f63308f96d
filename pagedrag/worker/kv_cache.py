"""The KV cache tensors: one K and one V tensor per layer on the device, the
same shapes in CPU swap space, and the sizing of both from memory budgets."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from types import ModuleType

import torch

from pagedrag.config import GIB_BYTES
from pagedrag.core.block_pool import blocks_for
from pagedrag.core.kv_cache_manager import SwapPlan
from pagedrag.distributed.group import SINGLE, TensorParallelGroup
from pagedrag.worker.transfer import adjacent_runs, device_to_host, host_to_device

logger = logging.getLogger("pagedrag")


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across every layer."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_in(self, num_bytes: float) -> int:
        return int(num_bytes // self.bytes_per_block)


def _allocate(shape: CacheShape, num_blocks: int, device: torch.device, pin: bool = False) -> torch.Tensor:
    """One tensor [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim] for the whole cache."""
    dims = (shape.num_layers, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    return torch.empty(dims, dtype=shape.dtype, device=device, pin_memory=pin)


def _layers(pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) views of a cache tensor: contiguous [blocks, block_size, heads, dim]."""
    return [(layer[0], layer[1]) for layer in pool]


class KVCacheTensors:
    """The paged cache on the device plus the CPU swap space. ``device_pool`` holds every
    layer's K and V in one tensor (so a move across all layers is one indexing op);
    ``device_layers`` are its per-layer (K, V) views, which the model and kernels take.

    Whole blocks (the KV tiers' unit) hold every tensor-parallel rank's KV heads, rank r's
    at heads [r * kv_heads, (r + 1) * kv_heads): ``gather_blocks`` and ``load_blocks`` are
    collectives every rank calls, rank 0 holding the whole blocks on the host."""

    def __init__(self, shape: CacheShape, num_blocks: int, num_cpu_blocks: int,
                 device: torch.device, ops: ModuleType, group: TensorParallelGroup = SINGLE):
        self.shape = shape
        self.ops = ops
        self.group = group
        self.device_pool = _allocate(shape, num_blocks, device)
        self.device_layers = _layers(self.device_pool)
        pin = device.type == "cuda"
        self.cpu_layers = _layers(_allocate(shape, num_cpu_blocks, torch.device("cpu"), pin))

    def gather_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor | None, torch.cuda.Event | None]:
        """Start copying whole blocks to rank 0's host, each block's layers contiguous: (a host
        tensor [n, layers, 2, block_size, every rank's kv_heads, head_dim], an event to wait on
        before reading it); (None, None) on the other ranks. On CUDA the gather runs on the
        device and crosses in one copy (the KV tiers' writes: one large transfer moves ~30x
        faster than one per layer and block)."""
        ids = host_to_device(block_ids, torch.int64, self.device_pool.device)
        gathered = self.device_pool.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
        whole = self.group.all_gather(gathered, dim=4)
        return device_to_host(whole) if self.group.is_driver else (None, None)

    def load_blocks(self, loads: list[tuple[int, torch.Tensor | None]]) -> None:
        """Write whole blocks' K/V (rank 0's host tensors [layers, 2, block_size, every rank's
        kv_heads, head_dim], pinned on CUDA; None on the other ranks) into the pool: each block
        crosses whole (all its layers in one copy, on a stream of its own on CUDA, so the copies
        overlap the work already queued), rank 0 broadcasts them to the other ranks, and one
        scatter on the device puts this rank's heads in place before the next forward pass."""
        if not loads:
            return
        device = self.device_pool.device
        ids = host_to_device([block_id for block_id, _ in loads], torch.int64, device)
        heads = self.shape.num_kv_heads
        whole = (self.shape.num_layers, 2, self.shape.block_size, heads * self.group.size, self.shape.head_dim)
        staging = torch.empty((len(loads), *whole), dtype=self.shape.dtype, device=device)
        if self.group.is_driver:
            self._stage(staging, [kv for _, kv in loads])
        self.group.broadcast_tensor(staging)
        own = staging.narrow(4, self.group.rank * heads, heads)
        self.device_pool.index_copy_(2, ids, own.permute(1, 2, 0, 3, 4, 5))

    @staticmethod
    def _stage(staging: torch.Tensor, blocks: list[torch.Tensor]) -> None:
        """Copy host blocks into the device tensor ``staging``, a copy for each run of blocks that
        lie back to back in host memory (a side stream on CUDA)."""
        device, stream = staging.device, None
        try:
            with _copy_stream(device) as stream:
                for first, run in adjacent_runs(blocks):
                    staging[first:first + run.shape[0]].copy_(run, non_blocking=True)
        finally:  # even after a failed copy, later work (and the tiers' read events) follows those queued
            if stream is not None:
                torch.cuda.current_stream(device).wait_stream(stream)
                staging.record_stream(torch.cuda.current_stream(device))

    def apply(self, copies: list[tuple[int, int]], swaps: SwapPlan) -> None:
        """Run a step's block moves: swap-outs, then swap-ins, then copy-on-write copies."""
        self._swap(swaps.out, self.device_layers, self.cpu_layers)
        self._swap(swaps.into, self.cpu_layers, self.device_layers)
        if copies:
            mapping = host_to_device(copies, torch.int64, self.device_layers[0][0].device)
            self.ops.copy_blocks([k for k, _ in self.device_layers],
                                 [v for _, v in self.device_layers], mapping)

    def _swap(self, pairs, sources, destinations) -> None:
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for (src_k, src_v), (dst_k, dst_v) in zip(sources, destinations):
            self.ops.swap_blocks(src_k, dst_k, mapping)
            self.ops.swap_blocks(src_v, dst_v, mapping)


@contextlib.contextmanager
def _copy_stream(device: torch.device):
    """A side CUDA stream (after the work queued so far) for host-to-device copies; None on CPU."""
    if device.type != "cuda":
        yield None
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield stream


def available_cpu_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); falls back to total physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def log_pool(device: torch.device, shape: CacheShape, num_blocks: int, max_model_len: int) -> None:
    name = "num_gpu_blocks" if device.type == "cuda" else "num_cpu_blocks"
    per_seq = blocks_for(max_model_len, shape.block_size)
    logger.info("%s=%d (block_size=%d, %.3f GiB KV pool); %d sequences of max_model_len=%d fit",
                name, num_blocks, shape.block_size, num_blocks * shape.bytes_per_block / GIB_BYTES,
                num_blocks // per_seq, max_model_len)
