"""The Triton kernels against their torch references, on random problems drawn fresh each run.

Runs on CUDA tensors when a GPU is present, else on CPU tensors under Triton's
interpreter (conftest.py switches it on; one process cannot do both, as the
interpreter is chosen when the kernels are decorated). Shapes are odd on purpose:
partial last blocks, GQA ratios 1/3/4/8, head_dim 64/80/96/128, block sizes
1..256, contexts 1..4096, mixed lengths in one batch, shuffled block tables,
strided queries, NaN in every cache slot no sequence owns. The seed of each
failing case is in its assertion message.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

pytest.importorskip("triton")

from pagedrag.kernels import reference, testing, triton_ops  # noqa: E402
from pagedrag.kernels.decode_attention import paged_decode_attention  # noqa: E402
from pagedrag.kernels.prefill_attention import prefix_prefill_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture
def seed() -> int:
    return random.SystemRandom().randrange(2**31)


def test_exports_match_reference_signatures():
    for name in ("store_kv", "paged_decode_attention", "prefix_prefill_attention",
                 "copy_blocks", "swap_blocks"):
        assert inspect.signature(getattr(triton_ops, name)) == inspect.signature(getattr(reference, name))


@pytest.mark.parametrize("num_tokens,kv_heads,head_dim,block_size,dtype", [
    (37, 4, 64, 16, BF16),
    (1, 8, 128, 8, FP16),
    (100, 3, 80, 32, FP32),
    (64, 1, 128, 16, BF16),
])
def test_store_kv(num_tokens, kv_heads, head_dim, block_size, dtype, seed):
    assert testing.check_store(triton_ops.store_kv, num_tokens, kv_heads, head_dim, block_size,
                               dtype, DEVICE, seed), f"seed={seed}"


@pytest.mark.parametrize("context_lens,heads,kv_heads,head_dim,block_size,dtype", [
    ([1, 17, 100, 33], 32, 8, 128, 16, BF16),     # GQA 4, partial last blocks
    ([5, 64, 9], 4, 4, 64, 8, FP32),              # MHA
    ([31, 2, 250], 16, 2, 64, 32, FP16),          # GQA 8
    ([4096, 300, 1], 32, 4, 128, 32, BF16),       # long context, mixed lengths
    ([70, 3], 9, 3, 80, 16, BF16),                # GQA 3, head_dim 80 (masked to 128)
    ([129, 40], 12, 4, 96, 16, FP16),             # head_dim 96
])
def test_decode(context_lens, heads, kv_heads, head_dim, block_size, dtype, seed):
    err = testing.check_decode(triton_ops.paged_decode_attention, context_lens, heads, kv_heads,
                               head_dim, block_size, dtype, DEVICE, seed)
    assert err < testing.TOLERANCE[dtype], f"rel err {err}, seed={seed}"


@pytest.mark.parametrize("block_size", [1, 64, 128, 256])
def test_decode_block_sizes(block_size, seed):
    err = testing.check_decode(triton_ops.paged_decode_attention, [200, 129, 1], 8, 2, 64,
                               block_size, BF16, DEVICE, seed)
    assert err < testing.TOLERANCE[BF16], f"rel err {err}, seed={seed}"


@pytest.mark.parametrize("num_splits,tile_n", [(2, 64), (7, 32), (64, 16)])
def test_decode_split_k(num_splits, tile_n, seed):
    err = testing.check_decode(paged_decode_attention, [1, 1000, 257, 64], 16, 4, 128, 16, BF16,
                               DEVICE, seed, num_splits=num_splits, tile_n=tile_n)
    assert err < testing.TOLERANCE[BF16], f"rel err {err}, seed={seed}"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_padded_slot_gives_zeros(num_splits, seed):
    """A graph-padding slot (context_len 0) yields zeros and leaves the other rows right."""
    p = testing.make_problem([1, 1, 1], [300, 0, 45], 8, 2, 64, 16, FP32, DEVICE, seed)
    out = paged_decode_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                                 p.scale, num_splits=num_splits)
    keep = torch.tensor([0, 2], device=DEVICE)
    ref = reference.paged_decode_attention(
        p.query.double()[keep], p.k_cache.double(), p.v_cache.double(), p.block_tables[keep],
        p.context_lens[keep], p.scale)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert testing.relative_error(out[keep], ref) < testing.TOLERANCE[FP32], f"seed={seed}"


@pytest.mark.parametrize("query_lens,context_lens,heads,kv_heads,head_dim,block_size,dtype", [
    ([5, 1, 17, 0], [5, 40, 100, 8], 8, 2, 64, 16, BF16),   # cold, decode-like, prefix hit, empty
    ([33, 7], [33, 300], 8, 8, 128, 8, FP16),               # MHA
    ([20, 64], [1000, 64], 32, 4, 128, 32, BF16),           # GQA 8
    ([3, 50], [9, 77], 9, 3, 80, 16, FP32),                 # GQA 3, head_dim 80
    ([64], [4096], 8, 1, 64, 16, BF16),                     # long cached prefix
])
def test_prefill(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype, seed):
    err = testing.check_prefill(triton_ops.prefix_prefill_attention, query_lens, context_lens,
                                heads, kv_heads, head_dim, block_size, dtype, DEVICE, seed)
    assert err < testing.TOLERANCE[dtype], f"rel err {err}, seed={seed}"


@pytest.mark.parametrize("block_m,tile_n", [(16, 16), (64, 32), (128, 128)])
def test_prefill_tilings(block_m, tile_n, seed):
    """Tiles smaller and larger than a block, few tokens per tile (block_m 16 / GQA 8 = 2)."""
    err = testing.check_prefill(prefix_prefill_attention, [9, 130, 1], [9, 200, 77], 16, 2, 64, 8,
                                BF16, DEVICE, seed, block_m=block_m, tile_n=tile_n)
    assert err < testing.TOLERANCE[BF16], f"rel err {err}, seed={seed}"


@pytest.mark.parametrize("num_splits,tile_n", [(3, 64), (6, 16), (64, 16)])
def test_prefill_split_k(num_splits, tile_n, seed):
    """Prefix hits split over the cached keys; partitions past a tile's last key mark themselves empty."""
    err = testing.check_prefill(prefix_prefill_attention, [32, 1, 40, 7], [1312, 900, 300, 7],
                                8, 2, 128, 16, BF16, DEVICE, seed, num_splits=num_splits,
                                tile_n=tile_n)
    assert err < testing.TOLERANCE[BF16], f"rel err {err}, seed={seed}"


@pytest.mark.parametrize("draw", range(3))
def test_random_shapes(draw, seed):
    """Shapes drawn from the seed too: GQA 1/4/8, head_dim 64/128, block 8/16/32, lengths 1..4096."""
    rng = random.Random(seed)
    kv_heads, group = rng.choice([1, 2]), rng.choice([1, 4, 8])
    head_dim, block_size = rng.choice([64, 128]), rng.choice([8, 16, 32])
    dtype = rng.choice([BF16, FP16])
    shape = (kv_heads * group, kv_heads, head_dim, block_size, dtype, DEVICE)
    context_lens = [rng.randint(1, 4096)] + [rng.randint(1, 300) for _ in range(rng.randint(0, 3))]
    err = testing.check_decode(paged_decode_attention, context_lens, *shape, seed,
                               num_splits=rng.randint(1, 9))
    assert err < testing.TOLERANCE[dtype], f"decode rel err {err}, seed={seed}"
    query_lens = [rng.randint(1, 48)] + [rng.randint(0, 48) for _ in range(rng.randint(0, 2))]
    context_lens = [q + rng.choice([0, rng.randint(1, 2000)]) for q in query_lens]
    err = testing.check_prefill(triton_ops.prefix_prefill_attention, query_lens, context_lens, *shape,
                                seed)
    assert err < testing.TOLERANCE[dtype], f"prefill rel err {err}, seed={seed}"


def _random_caches(count: int, num_blocks: int, seed: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, 8, 2, 64, generator=gen).to(BF16).to(device) for _ in range(count)]


def test_copy_blocks(seed):
    caches = _random_caches(6, 12, seed, DEVICE)
    expected = [c.clone() for c in caches]
    mapping = torch.randperm(12, generator=torch.Generator().manual_seed(seed))[:8].view(4, 2)
    triton_ops.copy_blocks(caches[:3], caches[3:], mapping)
    reference.copy_blocks(expected[:3], expected[3:], mapping)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected)), f"seed={seed}"


@pytest.mark.parametrize("pinned", [True, False])
def test_swap_blocks_out_and_in(pinned, seed):
    """GPU <-> pinned host runs the kernel; pageable host memory takes the torch fallback."""
    if pinned and DEVICE != "cuda":
        pytest.skip("pinned memory needs CUDA")
    device_cache, = _random_caches(1, 10, seed, DEVICE)
    host_cache, = _random_caches(1, 6, seed + 1, "cpu")
    if pinned:
        host_cache = host_cache.pin_memory()
    expected_host = host_cache.clone()
    out_map = torch.tensor([[7, 0], [2, 5], [9, 3]])
    triton_ops.swap_blocks(device_cache, host_cache, out_map)
    reference.swap_blocks(device_cache, expected_host, out_map)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(host_cache, expected_host), f"seed={seed}"

    expected_device = device_cache.clone()
    in_map = torch.tensor([[5, 1], [0, 4]])
    triton_ops.swap_blocks(host_cache, device_cache, in_map)
    reference.swap_blocks(host_cache, expected_device, in_map)
    assert torch.equal(device_cache, expected_device), f"seed={seed}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_replays_in_cuda_graph(seed):
    """Captured once, replayed on new lengths and queries: no host sync inside, right answers."""
    p = testing.make_problem([1] * 4, [700] * 4, 32, 8, 128, 16, BF16, DEVICE, seed)
    p.context_lens.copy_(torch.tensor([700, 33, 1, 400], dtype=torch.int32))
    query = p.query.contiguous()
    for _ in range(2):  # compile outside the capture
        triton_ops.paged_decode_attention(query, p.k_cache, p.v_cache, p.block_tables,
                                          p.context_lens, p.scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_ops.paged_decode_attention(query, p.k_cache, p.v_cache, p.block_tables,
                                                p.context_lens, p.scale)
    p.context_lens.copy_(torch.tensor([5, 700, 64, 2], dtype=torch.int32))
    query.normal_()
    graph.replay()
    ref = reference.paged_decode_attention(query.double(), p.k_cache.double(), p.v_cache.double(),
                                           p.block_tables, p.context_lens, p.scale)
    assert testing.relative_error(out, ref) < testing.TOLERANCE[BF16], f"seed={seed}"
