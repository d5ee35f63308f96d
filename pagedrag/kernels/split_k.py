"""Split-K for attention: how many key partitions to launch, and merging their results.

When the attention grid has too few programs to fill the GPU (small batch, long
context), each (query rows, KV head) program is split over the key range into
partitions of ``partition`` positions. Partition s of query row r writes, per head:
    part_max[r, h, s]      running max of its scores (log2 domain)
    part_sum[r, h, s]      sum of exp2(score - max)
    part_acc[r, h, s, :]   unnormalised output, sum of exp2(score - max) * v
all fp32. A partition with no key visible to row r leaves part_max = NEG_BIG there
(a program whose whole partition lies past its rows' keys writes only that and
exits), so the merge needs no lengths: it takes the partitions whose max is above
NEG_BIG. A row with none (a padded decode slot with context 0) gets zeros.

The split count depends only on shapes (grid size, the bound on the context length
and the SM count), never on device values, so launches stay CUDA-graph safe.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .paged_tile import NEG_BIG

MAX_SPLITS = 64      # bound on partitions per row (the merge holds them all at once)
MIN_PARTITION = 128  # fewest positions worth a partition of their own


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # interpreter: nothing to fill
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(programs: int, max_context: int, device: torch.device,
                      programs_per_sm: float, saturated_per_sm: float | None = None) -> int:
    """Partitions so that ``programs`` * splits reaches programs_per_sm * SMs; 1 when it
    already does, or when ``programs`` alone reach saturated_per_sm * SMs."""
    if saturated_per_sm is not None and programs >= saturated_per_sm * _num_sms(device):
        return 1
    wanted = triton.cdiv(int(programs_per_sm * _num_sms(device)), programs)
    return max(1, min(wanted, MAX_SPLITS, triton.cdiv(max_context, MIN_PARTITION)))


def partition_size(max_context: int, num_splits: int, tile_n: int) -> int:
    """Positions per partition: a multiple of tile_n; cdiv(max_context, it) <= num_splits."""
    return triton.cdiv(triton.cdiv(max_context, num_splits), tile_n) * tile_n


def empty_partials(rows: int, heads: int, num_splits: int, head_dim: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised (part_acc, part_max, part_sum) for ``rows`` query rows."""
    part_max = torch.empty((rows, heads, num_splits), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty((rows, heads, num_splits, head_dim), dtype=torch.float32, device=device)
    return part_acc, part_max, part_sum


def plan_splits(out: torch.Tensor, programs: int, max_context: int, tile_n: int,
                num_splits: int | None, programs_per_sm: float, saturated_per_sm: float | None = None):
    """(num_splits, partition, part_acc, part_max, part_sum) for an attention launch whose
    output ``out`` is [rows, heads, head_dim] and whose grid has ``programs`` programs
    before splitting. num_splits None picks one from the shapes (``choose_num_splits``);
    with one split the partials are unused placeholders (``out`` itself)."""
    if num_splits is None:
        num_splits = choose_num_splits(programs, max_context, out.device, programs_per_sm, saturated_per_sm)
    partition = partition_size(max_context, num_splits, tile_n)
    num_splits = triton.cdiv(max_context, partition)
    if num_splits == 1:
        return num_splits, partition, out, out, out
    rows, heads, head_dim = out.shape
    return (num_splits, partition, *empty_partials(rows, heads, num_splits, head_dim, out.device))


@triton.jit
def _merge_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
                  num_splits, stride_or, stride_oh,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    part = (row * tl.num_programs(1) + head) * num_splits + offs_s
    m = tl.load(part_max_ptr + part, mask=offs_s < num_splits, other=NEG_BIG)
    used = m > NEG_BIG
    l = tl.load(part_sum_ptr + part, mask=used, other=0.0)
    weight = tl.where(used, tl.exp2(m - tl.max(m, 0)), 0.0)
    denom = tl.sum(weight * l, 0)

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=used[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + row * stride_or + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def merge_partials(part_acc: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor,
                   out: torch.Tensor) -> None:
    """out[r, h] = softmax-weighted merge of the partitions of row r, head h (out: [rows, heads, dim])."""
    rows, heads, num_splits, head_dim = part_acc.shape
    _merge_kernel[(rows, heads)](
        part_acc, part_max, part_sum, out, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4)
