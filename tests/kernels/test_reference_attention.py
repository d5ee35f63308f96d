"""The CPU attention (kernels.reference: the engine's attention on CPU and the Triton kernels'
ground truth) against attention spelled out densely, in float64.

The problems give it block tables of one run of consecutive blocks, a few runs and many, GQA
groups of 1 to 8, one-token and many-token queries with and without a cached prefix, and NaN
in every cache slot no sequence owns (kernels.testing.make_problem).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from pagedrag.kernels import reference, testing


def _dense(p: testing.PagedProblem) -> torch.Tensor:
    """Each query row over its sequence's positions up to its own, as softmax(q k^T) v."""
    out = torch.empty(p.query.shape, dtype=torch.float64)
    block_size, heads = p.k_cache.shape[1], p.query.shape[1]
    starts, totals = p.query_start_loc.tolist(), p.context_lens.tolist()
    for b, total in enumerate(totals):
        positions = torch.arange(total)
        slots = p.block_tables[b].long()[positions // block_size] * block_size + positions % block_size
        group = heads // p.k_cache.shape[2]
        keys, values = (cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1) for cache in (p.k_cache, p.v_cache))
        q_len = starts[b + 1] - starts[b]
        for row in range(q_len):
            seen = total - q_len + row + 1
            query = p.query[starts[b] + row].double()  # [heads, d]
            scores = torch.einsum("hd,nhd->hn", query, keys[:seen]) * p.scale
            out[starts[b] + row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values[:seen])
    return out


def _contiguous_tables(p: testing.PagedProblem, runs_per_sequence: int) -> None:
    """Rewrite the block tables so that each sequence's blocks come in about this many runs of
    consecutive ids (the cache's contents move with them)."""
    block_size = p.k_cache.shape[1]
    next_block = 0
    old_caches = (p.k_cache.clone(), p.v_cache.clone())
    for cache in (p.k_cache, p.v_cache):
        cache.fill_(float("nan"))
    for b, total in enumerate(p.context_lens.tolist()):
        count = -(-total // block_size)
        old = p.block_tables[b, :count].long()
        new = []
        for run in torch.tensor_split(torch.arange(count), runs_per_sequence):
            new += list(range(next_block, next_block + len(run)))
            next_block += len(run) + 1  # a gap: the next run starts elsewhere
        p.block_tables[b, :count] = torch.tensor(new, dtype=torch.int32)
        for cache, old_cache in zip((p.k_cache, p.v_cache), old_caches):
            cache[torch.tensor(new)] = old_cache[old]


@pytest.mark.parametrize("query_lens,context_lens,heads,kv_heads,block_size,runs", [
    ([1, 1, 1], [1, 40, 1600], 9, 3, 16, 1),       # decode, SmolLM2's heads, one run
    ([1, 1], [300, 77], 8, 2, 16, 3),              # decode over a few runs
    ([1, 1], [700, 129], 8, 8, 8, 20),             # decode over many runs
    ([9, 1, 32], [1312, 50, 32], 9, 3, 16, 2),     # verification, decode, a prefill without prefix
    ([40, 7, 130], [900, 7, 200], 16, 2, 32, 6),   # prefill over a prefix in many runs
    ([5], [5], 4, 1, 1, 1),                        # block size 1, MQA
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_attention_equals_dense_attention(query_lens, context_lens, heads, kv_heads, block_size, runs, dtype):
    seed = random.SystemRandom().randrange(2**31)
    p = testing.make_problem(query_lens, context_lens, heads, kv_heads, 64, block_size, dtype, "cpu", seed,
                             spare_blocks=2 * sum(context_lens) // block_size + 8)
    _contiguous_tables(p, runs)
    expected = _dense(p)
    out = reference.prefix_prefill_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc,
                                             p.context_lens, p.scale)
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert testing.relative_error(out, expected) < tolerance, f"seed={seed}"
    if set(query_lens) == {1}:
        decoded = reference.paged_decode_attention(p.query, p.k_cache, p.v_cache, p.block_tables,
                                                   p.context_lens, p.scale)
        assert testing.relative_error(decoded, expected) < tolerance, f"seed={seed}"


def test_a_block_table_changed_in_place_is_read_anew():
    """Each step's plan of where the contexts are is kept for the step's later layers (the same
    tensors): a table rewritten in place (its blocks moved, the old ones NaN) must not reuse it."""
    p = testing.make_problem([1, 1], [300, 77], 8, 2, 64, 16, torch.float64, "cpu", 0, spare_blocks=64)
    _contiguous_tables(p, 3)
    args = (p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    assert testing.relative_error(reference.paged_decode_attention(*args), _dense(p)) < 1e-12
    _contiguous_tables(p, 1)
    assert testing.relative_error(reference.paged_decode_attention(*args), _dense(p)) < 1e-12


def test_threads_gathering_contexts_at_once_each_read_their_own():
    """Contexts in several runs are gathered into a buffer each thread keeps and reuses (for every
    layer and step): threads attending at once (tensor-parallel ranks in one process, engines in
    one server) must each read their own rows, for sequences longer and shorter than the last."""
    problems = [testing.make_problem([1, 1], lengths, 8, 2, 64, 16, torch.float64, "cpu", seed, spare_blocks=96)
                for seed, lengths in enumerate(([300, 77], [40, 520], [129, 700]))]
    for p in problems:
        _contiguous_tables(p, 4)
    expected = [_dense(p) for p in problems]
    errors: list[float] = []

    def attend(index: int) -> None:
        p = problems[index]
        for _ in range(20):
            decoded = reference.paged_decode_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                                                       p.scale)
            errors.append(testing.relative_error(decoded, expected[index]))

    threads = [threading.Thread(target=attend, args=(index,)) for index in range(len(problems))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 60 and max(errors) < 1e-12


def test_the_gather_buffer_serves_calls_in_and_out_of_inference_mode():
    """The engine runs under torch.inference_mode, HF comparisons and tests under no_grad: a buffer
    first made in one must take gathers in the other (an inference tensor would refuse them)."""
    p = testing.make_problem([1, 1], [300, 77], 8, 2, 64, 16, torch.float64, "cpu", 1, spare_blocks=64)
    _contiguous_tables(p, 3)
    args = (p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    with torch.inference_mode():
        inside = reference.paged_decode_attention(*args)
    with torch.no_grad():
        outside = reference.paged_decode_attention(*args)
    assert torch.equal(inside, outside)
    assert testing.relative_error(outside, _dense(p)) < 1e-12
