"""Random paged-attention problems, and checks of a kernel against its reference.

Used by tests/kernels (Triton's interpreter on CPU, or a GPU) and by
benchmarks/gpu_kernels.py. Every problem is drawn fresh from a seed the caller
passes (tests draw a new one each run): random K/V caches (never zeros) whose
unowned slots (past each sequence's length, spare blocks) hold NaN, block tables
that are a random permutation of the pool with padding columns pointing at
arbitrary valid blocks, and queries / keys that are strided views, as the engine's
fused QKV projection produces them. Attention is compared with the reference run
in float64 by ||out - ref|| / ||ref||.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import reference

# Relative-error bounds per input dtype: bf16/fp16 round P and the output,
# fp32 runs its dots in full fp32 (no tf32).
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}


@dataclass
class PagedProblem:
    """A paged KV cache holding ``context_lens`` positions per sequence, plus queries."""

    query: torch.Tensor            # [T or B, heads, head_dim], a strided view
    k_cache: torch.Tensor          # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor     # [B, max_blocks] int32
    context_lens: torch.Tensor     # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    scale: float


def _randn(shape: Sequence[int], dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32).to(dtype)


def _strided_rows(rows: int, heads: int, head_dim: int, dtype: torch.dtype, device: str,
                  gen: torch.Generator) -> torch.Tensor:
    """[rows, heads, head_dim] whose token stride is wider than heads * head_dim."""
    return _randn((rows, heads + 3, head_dim), dtype, device, gen)[:, 1:heads + 1]


def make_problem(query_lens: Sequence[int], context_lens: Sequence[int], num_heads: int,
                 num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: str, seed: int, pad_columns: int = 1, spare_blocks: int = 3) -> PagedProblem:
    """Sequence b has context_lens[b] cached positions, the last query_lens[b] of them new.

    Block tables get ``pad_columns`` columns past the longest sequence's blocks.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-length // block_size) for length in context_lens]
    max_blocks = max(blocks_needed) + pad_columns
    num_blocks = sum(blocks_needed) + spare_blocks
    pool = torch.randperm(num_blocks, generator=cpu_gen)
    tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=cpu_gen)
    taken = 0
    for b, count in enumerate(blocks_needed):
        tables[b, :count] = pool[taken:taken + count]
        taken += count
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    k_cache = _randn(cache_shape, dtype, device, gen)
    v_cache = _randn(cache_shape, dtype, device, gen)
    for cache in (k_cache, v_cache):  # slots no sequence owns hold NaN: kernels must not read them
        cache[pool[taken:].to(device)] = float("nan")
        for b, length in enumerate(context_lens):
            if length % block_size:
                cache[int(tables[b, length // block_size]), length % block_size:] = float("nan")
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    return PagedProblem(
        query=_strided_rows(starts[-1], num_heads, head_dim, dtype, device, gen),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables.to(device=device, dtype=torch.int32),
        context_lens=as_int32(list(context_lens)),
        query_start_loc=as_int32(starts),
        scale=head_dim ** -0.5)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if out has a non-finite value)."""
    diff = out.double() - ref.double()
    if not torch.isfinite(diff).all():
        return float("nan")
    return (diff.norm() / ref.double().norm()).item()


def check_decode(impl: Callable[..., torch.Tensor], context_lens: Sequence[int], num_heads: int,
                 num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: str, seed: int, **knobs) -> float:
    """Relative error of ``impl`` (paged_decode_attention's signature) on a random problem."""
    p = make_problem([1] * len(context_lens), context_lens, num_heads, num_kv_heads, head_dim,
                     block_size, dtype, device, seed)
    out = impl(p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, **knobs)
    ref = reference.paged_decode_attention(p.query.double(), p.k_cache.double(), p.v_cache.double(),
                                           p.block_tables, p.context_lens, p.scale)
    return relative_error(out, ref)


def check_prefill(impl: Callable[..., torch.Tensor], query_lens: Sequence[int],
                  context_lens: Sequence[int], num_heads: int, num_kv_heads: int, head_dim: int,
                  block_size: int, dtype: torch.dtype, device: str, seed: int, **knobs) -> float:
    """Relative error of ``impl`` (prefix_prefill_attention's signature) on a random problem."""
    p = make_problem(query_lens, context_lens, num_heads, num_kv_heads, head_dim,
                     block_size, dtype, device, seed)
    out = impl(p.query, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc,
               p.context_lens, p.scale, **knobs)
    ref = reference.prefix_prefill_attention(
        p.query.double(), p.k_cache.double(), p.v_cache.double(), p.block_tables,
        p.query_start_loc, p.context_lens, p.scale)
    return relative_error(out, ref)


def check_store(impl: Callable[..., None], num_tokens: int, num_kv_heads: int, head_dim: int,
                block_size: int, dtype: torch.dtype, device: str, seed: int) -> bool:
    """Whether ``impl`` (store_kv's signature) leaves exactly the reference's caches.

    A third of the tokens (at least one) get slot -1; the others distinct random slots.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=cpu_gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=cpu_gen)[:max(1, num_tokens // 3)]] = -1
    slot_mapping = slots.to(device)
    key = _strided_rows(num_tokens, num_kv_heads, head_dim, dtype, device, gen)
    value = _strided_rows(num_tokens, num_kv_heads, head_dim, dtype, device, gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = _randn(cache_shape, dtype, device, gen)
    v_cache = _randn(cache_shape, dtype, device, gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    impl(key, value, k_cache, v_cache, slot_mapping)
    reference.store_kv(key, value, k_ref, v_ref, slot_mapping)
    return torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
