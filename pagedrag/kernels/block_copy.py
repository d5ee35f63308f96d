"""Copy whole KV blocks between cache tensors, many tensors in one launch.

Serves copy-on-write (every layer's K and V, on the GPU) and swapping (one tensor
on the GPU, one in pinned CPU memory). Each cache tensor is contiguous
[num_blocks, block_size, kv_heads, head_dim], so block b is ``block_words``
consecutive 4-byte words starting at word b * block_words; the kernel moves words,
whatever the dtype.

A launch gets two tables of base addresses (int64, on the device): for every row
(src, dst) of the mapping, block src of tensor i of the source table is copied to
block dst of tensor i of the destination table. Grid: (mapping rows, tensors,
chunks of CHUNK words per block). Source and destination blocks of one launch must
not overlap (copy-on-write copies a shared block into a fresh one).

Pinned CPU memory is addressable from the GPU (unified virtual addressing), so a
swap is this same kernel with host addresses on one side: one launch, crossing
PCIe, instead of a gather, a device-to-host copy and a CPU scatter. Launches are
stream-ordered and asynchronous: synchronize before the CPU itself reads swapped
blocks.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .paged_tile import DOT_IN_FP32

CHUNK = 2048  # words (8 KiB) per program
_INTERPRETED = DOT_IN_FP32  # under Triton's interpreter every tensor is host memory


@triton.jit
def _copy_blocks_kernel(src_table_ptr, dst_table_ptr, mapping_ptr, block_words,
                        CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    tensor = tl.program_id(1)
    chunk = tl.program_id(2)
    src_block = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst_block = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    src = tl.multiple_of(tl.load(src_table_ptr + tensor).to(tl.pointer_type(tl.int32)), 16)
    dst = tl.multiple_of(tl.load(dst_table_ptr + tensor).to(tl.pointer_type(tl.int32)), 16)
    offs = tl.max_contiguous(tl.multiple_of(chunk * CHUNK + tl.arange(0, CHUNK), CHUNK), CHUNK)
    mask = offs < block_words
    words = tl.load(src + src_block * block_words + offs, mask=mask)
    tl.store(dst + dst_block * block_words + offs, words, mask=mask)


def kernel_device(tensors: list[torch.Tensor]) -> torch.device | None:
    """The GPU whose kernel can address all of ``tensors`` (its memory or pinned host memory), else None."""
    if _INTERPRETED:
        return tensors[0].device
    gpus = {t.device for t in tensors if t.is_cuda}
    if len(gpus) != 1 or not all(t.is_cuda or t.is_pinned() for t in tensors):
        return None
    return gpus.pop()


@functools.lru_cache(maxsize=64)
def _address_table(addresses: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(addresses, dtype=torch.int64, device=device)


def copy_blocks_between(sources: list[torch.Tensor], destinations: list[torch.Tensor],
                        block_mapping: torch.Tensor) -> None:
    """For each row (src, dst) of block_mapping [N, 2]: destinations[i][dst] = sources[i][src].

    All tensors share one block shape and dtype, are contiguous and 16-byte aligned, and
    ``kernel_device`` finds a GPU that reaches them all.
    """
    if block_mapping.numel() == 0 or not sources:
        return
    device = kernel_device([*sources, *destinations])
    assert device is not None, "block copies need GPU or pinned host memory"
    block_shape, dtype = sources[0].shape[1:], sources[0].dtype
    block_bytes = sources[0][0].numel() * sources[0].element_size()
    assert block_bytes % 4 == 0
    for tensor in (*sources, *destinations):
        assert tensor.shape[1:] == block_shape and tensor.dtype == dtype and tensor.is_contiguous()
        assert tensor.data_ptr() % 16 == 0
    src_table = _address_table(tuple(t.data_ptr() for t in sources), device)
    dst_table = _address_table(tuple(t.data_ptr() for t in destinations), device)
    mapping = block_mapping.to(device=device, dtype=torch.int64).contiguous()
    block_words = block_bytes // 4
    grid = (mapping.shape[0], len(sources), triton.cdiv(block_words, CHUNK))
    _copy_blocks_kernel[grid](src_table, dst_table, mapping, block_words, CHUNK=CHUNK, num_warps=4)
