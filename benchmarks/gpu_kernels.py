"""The kernel suite on a CUDA GPU: correctness over a large shape set, then timings.

    python benchmarks/gpu_kernels.py            # correctness table + timing table
    python benchmarks/gpu_kernels.py --splits   # also times split-K choices
    python benchmarks/gpu_kernels.py --sweep    # also sweeps tile sizes / warps / stages

1. Correctness: each Triton kernel against its torch reference (run in float64) on
   random problems (pagedrag/kernels/testing.py), larger and more varied than the unit tests.
2. Ceilings: copy bandwidth measured here (one large device-to-device copy, bytes read
   plus written); bf16 matrix rate taken as 780 TFLOP/s (DESIGN.md's measurement).
3. Timings (triton.testing.do_bench, median, L2 flushed between runs): every figure
   with its floor, the larger of bytes / copy bandwidth and FLOPs / 780 TFLOP/s.
   Attention bytes count K and V read once, plus queries read and outputs written.
   "GPU us" replays the op from a CUDA graph (as the engine runs decode): kernel
   time without host launch overhead. "eager us" launches it from Python (as the
   engine runs prefill); small ops are bound by the host there. Swap floors use the
   pinned host <-> device copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import sys

import torch
from triton.testing import do_bench

from pagedrag.kernels import testing, triton_ops
from pagedrag.kernels.decode_attention import paged_decode_attention
from pagedrag.kernels.prefill_attention import prefix_prefill_attention

PEAK_TFLOPS = 780.0
DEVICE = "cuda"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
LLAMA3_8B = dict(heads=32, kv_heads=8, head_dim=128, block_size=16)  # KV shape of one layer


def bench_ms(fn, rep: int = 200) -> float:
    """Median time of ``fn`` launched from Python (ms)."""
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def bench_graph_ms(fn, rep: int = 200) -> float:
    """Median time of ``fn`` replayed from a CUDA graph (ms): the GPU's time, no launch gaps."""
    fn()  # compile and warm the allocator outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay, rep)


# ---------------------------------------------------------------- correctness

def correctness(rng: random.Random) -> bool:
    def lens(n, hi):
        return [rng.randint(1, hi) for _ in range(n)]

    decode_cases = [
        ("Llama3-8B B64 mixed<=2048", lens(64, 2048), 32, 8, 128, 16, BF16),
        ("Llama3-8B B1 32768", [32768], 32, 8, 128, 16, BF16),
        ("Llama3-8B B8 mixed<=4096 bs32", lens(8, 4096), 32, 8, 128, 32, FP16),
        ("MHA B8 mixed<=3000 d64 bs8", lens(8, 3000), 16, 16, 64, 8, BF16),
        ("GQA8 B4 mixed<=5000 bs128", lens(4, 5000), 64, 8, 128, 128, FP32),
        ("SmolLM2 GQA3 B32 <=1500 d64", lens(32, 1500), 9, 3, 64, 16, BF16),
        ("GQA4 B16 d80 bs64", lens(16, 900), 16, 4, 80, 64, BF16),
        ("GQA4 B3 d96 bs256", lens(3, 3000), 16, 4, 96, 256, FP16),
    ]
    prefill_cases = [
        ("32 new over 1280 cached", [32], [1312], 32, 8, 128, 16, BF16),
        ("1312 cold", [1312], [1312], 32, 8, 128, 16, BF16),
        ("mixed batch", [1312, 32, 1, 500, 77], [1312, 1312, 2000, 4096, 77], 32, 8, 128, 16, BF16),
        ("MHA d64 bs8", [300, 45], [1000, 45], 16, 16, 64, 8, FP16),
        ("SmolLM2 GQA3", [200, 1000], [1200, 1000], 9, 3, 64, 16, BF16),
        ("GQA8 d128 bs32 fp32", [129, 64], [700, 3000], 64, 8, 128, 32, FP32),
    ]
    store_cases = [(8192, 8, 128, 16, BF16), (333, 3, 64, 16, FP16), (1000, 4, 80, 32, FP32)]

    ok = True
    print(f"{'kernel':<8} {'case':<34} {'dtype':<9} {'rel err':>9} {'bound':>7}  ok")
    for name, ctx, h, kvh, d, bs, dtype in decode_cases:
        err = testing.check_decode(triton_ops.paged_decode_attention, ctx, h, kvh, d, bs, dtype,
                                   DEVICE, rng.randrange(2**31))
        good = err < testing.TOLERANCE[dtype]
        ok &= good
        print(f"{'decode':<8} {name:<34} {str(dtype)[6:]:<9} {err:9.2e} {testing.TOLERANCE[dtype]:7.0e}  {good}")
    for name, q, ctx, h, kvh, d, bs, dtype in prefill_cases:
        err = testing.check_prefill(triton_ops.prefix_prefill_attention, q, ctx, h, kvh, d, bs,
                                    dtype, DEVICE, rng.randrange(2**31))
        good = err < testing.TOLERANCE[dtype]
        ok &= good
        print(f"{'prefill':<8} {name:<34} {str(dtype)[6:]:<9} {err:9.2e} {testing.TOLERANCE[dtype]:7.0e}  {good}")
    for tokens, kvh, d, bs, dtype in store_cases:
        good = testing.check_store(triton_ops.store_kv, tokens, kvh, d, bs, dtype, DEVICE,
                                   rng.randrange(2**31))
        ok &= good
        print(f"{'store':<8} {f'{tokens} tokens x {kvh}x{d} bs{bs}':<34} {str(dtype)[6:]:<9} "
              f"{'exact' if good else 'DIFF':>9} {'0':>7}  {good}")
    return ok


# ---------------------------------------------------------------- problems to time

def decode_problem(batch: int, context: int, seed: int) -> testing.PagedProblem:
    return testing.make_problem([1] * batch, [context] * batch, LLAMA3_8B["heads"],
                                LLAMA3_8B["kv_heads"], LLAMA3_8B["head_dim"],
                                LLAMA3_8B["block_size"], BF16, DEVICE, seed, pad_columns=0)


def prefill_problem(query_lens, context_lens, seed: int) -> testing.PagedProblem:
    return testing.make_problem(query_lens, context_lens, LLAMA3_8B["heads"], LLAMA3_8B["kv_heads"],
                                LLAMA3_8B["head_dim"], LLAMA3_8B["block_size"], BF16, DEVICE, seed,
                                pad_columns=0)


def decode_bytes(p: testing.PagedProblem) -> int:
    kv_row = p.k_cache.shape[2] * p.k_cache.shape[3] * p.k_cache.element_size()
    return 2 * kv_row * int(p.context_lens.sum()) + 2 * p.query.numel() * p.query.element_size()


def prefill_cost(p: testing.PagedProblem) -> tuple[float, int]:
    """(FLOPs of the causal attention, bytes of K/V read once plus Q read and out written)."""
    heads, head_dim = p.query.shape[1], p.query.shape[2]
    q_lens = (p.query_start_loc[1:] - p.query_start_loc[:-1]).tolist()
    pairs = sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(q_lens, p.context_lens.tolist()))
    flops = 4.0 * heads * head_dim * pairs
    kv_row = p.k_cache.shape[2] * p.k_cache.shape[3] * p.k_cache.element_size()
    return flops, 2 * kv_row * int(p.context_lens.sum()) + 2 * p.query.numel() * p.query.element_size()


def run_decode(p, **knobs):
    return lambda: paged_decode_attention(p.query, p.k_cache, p.v_cache, p.block_tables,
                                          p.context_lens, p.scale, **knobs)


def run_prefill(p, **knobs):
    return lambda: prefix_prefill_attention(p.query, p.k_cache, p.v_cache, p.block_tables,
                                            p.query_start_loc, p.context_lens, p.scale, **knobs)


# ---------------------------------------------------------------- sweep

def sweep(rng: random.Random, tilings: bool) -> None:
    """Time split counts (and with ``tilings`` tile/warp/stage variants) of decode and prefill."""
    def best_of(name, make_fn, knob_sets, work, unit):
        results = []
        for knobs in knob_sets:
            try:
                results.append((bench_graph_ms(make_fn(**knobs), rep=50), knobs))
            except Exception as exc:  # e.g. a tiling that needs more shared memory than there is
                print(f"sweep {name:<22} skipped {knobs}: {type(exc).__name__}", flush=True)
        results.sort(key=lambda r: r[0])
        for ms, knobs in results[:4]:
            print(f"sweep {name:<22} {ms * 1e3:8.1f} us {work / (ms * 1e-3):7.1f} {unit}  {knobs}", flush=True)
        return dict(results[0][1])

    decode_cases = {"decode B64 x 2048": (64, 2048, [1, 2, 3]),
                    "decode B1 x 32768": (1, 32768, [16, 32, 48, 64]),
                    "decode B8 x 4096": (8, 4096, [4, 8, 12, 16])}
    for name, (batch, context, split_options) in decode_cases.items():
        p = decode_problem(batch, context, rng.randrange(2**31))
        variants = [dict(tile_n=t, num_warps=w, num_stages=st)
                    for t, w, st in itertools.product([32, 64, 128], [4, 8], [2, 3, 4])]
        best = (best_of(name, functools.partial(run_decode, p), variants, decode_bytes(p) / 1e9, "GB/s")
                if tilings else {})
        best_of(name + " splits", functools.partial(run_decode, p),
                [dict(best, num_splits=n) for n in split_options], decode_bytes(p) / 1e9, "GB/s")

    prefill_cases = {"prefill 32 over 1280": ([32], [1312], [1, 2, 4, 6]),
                     "prefill 1312 cold": ([1312], [1312], [1, 2]),
                     "prefill 8 x 1312 cold": ([1312] * 8, [1312] * 8, [1])}
    for name, (q_lens, ctx, split_options) in prefill_cases.items():
        p = prefill_problem(q_lens, ctx, rng.randrange(2**31))
        tflop = prefill_cost(p)[0] / 1e12
        variants = [dict(block_m=m, tile_n=t, num_warps=w, num_stages=st)
                    for (m, w), t, st in itertools.product([(64, 4), (128, 4), (128, 8)], [32, 64, 128], [2, 3])]
        best = (best_of(name, functools.partial(run_prefill, p), variants, tflop, "TFLOP/s")
                if tilings else {})
        best_of(name + " splits", functools.partial(run_prefill, p),
                [dict(best, num_splits=n) for n in split_options], tflop, "TFLOP/s")


# ---------------------------------------------------------------- timings

def timings(rng: random.Random) -> list[tuple[str, float, float, float, str]]:
    """Rows of (what, GPU us, eager us, floor us, achieved rate from the GPU time)."""
    rows = []
    src = torch.randn(256 * 2**20, device=DEVICE)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    bandwidth = 2 * src.numel() * src.element_size() / copy_ms / 1e6  # GB/s, read + write
    rows.append(("device copy 1 GiB (read+write)", copy_ms * 1e3, copy_ms * 1e3, copy_ms * 1e3,
                 f"{bandwidth:.0f} GB/s"))
    host = torch.empty(64 * 2**20, dtype=torch.float32).pin_memory()  # 256 MiB
    link = {}
    for label, to, frm in [("out", host, src[:host.numel()]), ("in", src[:host.numel()], host)]:
        ms = bench_ms(functools.partial(to.copy_, frm, non_blocking=True))
        link[label] = host.numel() * 4 / ms / 1e6
        rows.append((f"pinned copy 256 MiB {'GPU->CPU' if label == 'out' else 'CPU->GPU'}",
                     ms * 1e3, ms * 1e3, ms * 1e3, f"{link[label]:.1f} GB/s"))

    def add(label, fn, nbytes, flops=0.0, link_bw=None, graph=True):
        gpu_ms = bench_graph_ms(fn) if graph else float("nan")
        eager_ms = bench_ms(fn)
        ms = gpu_ms if graph else eager_ms
        bw = link_bw or bandwidth
        floor_us = max(nbytes / bw / 1e3, flops / PEAK_TFLOPS / 1e6)
        gbps = nbytes / ms / 1e6
        if flops:
            rate = f"{flops / ms / 1e9:.0f} TFLOP/s = {flops / ms / 1e9 / PEAK_TFLOPS:.0%} of 780"
        else:
            rate = f"{gbps:.0f} GB/s = {gbps / bw:.0%} of {'link' if link_bw else 'copy'}"
        rows.append((label, gpu_ms * 1e3, eager_ms * 1e3, floor_us, rate))

    tokens, kvh, d = 8192, LLAMA3_8B["kv_heads"], LLAMA3_8B["head_dim"]
    key = torch.randn(tokens, kvh, d, device=DEVICE, dtype=BF16)
    value = torch.randn_like(key)
    k_cache = torch.randn(tokens // 16 + 64, 16, kvh, d, device=DEVICE, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * 16, device=DEVICE)[:tokens]
    add(f"store {tokens} tokens 8x128 bf16", lambda: triton_ops.store_kv(key, value, k_cache, v_cache, slots),
        4 * key.numel() * 2 + slots.numel() * 8)

    for batch, context in [(64, 2048), (1, 32768), (8, 4096)]:
        p = decode_problem(batch, context, rng.randrange(2**31))
        add(f"decode B{batch} x {context} (Llama3-8B KV)", run_decode(p), decode_bytes(p))

    for label, q_lens, ctx in [("prefill 32 new over 1280 cached", [32], [1312]),
                               ("prefill 1312 cold", [1312], [1312]),
                               ("prefill 8 x 1312 cold", [1312] * 8, [1312] * 8)]:
        p = prefill_problem(q_lens, ctx, rng.randrange(2**31))
        flops, nbytes = prefill_cost(p)
        add(label, run_prefill(p), nbytes, flops)

    layers, pairs = 32, 256
    caches = [torch.randn(2048, 16, kvh, d, device=DEVICE, dtype=BF16) for _ in range(2 * layers)]
    mapping = torch.randperm(2048)[:2 * pairs].view(pairs, 2)  # on the CPU, as the engine passes it
    block_bytes = caches[0][0].numel() * 2
    add(f"copy_blocks {pairs} blocks x {layers} layers K+V",
        lambda: triton_ops.copy_blocks(caches[:layers], caches[layers:], mapping),
        2 * len(caches) * pairs * block_bytes, graph=False)

    gpu_cache = torch.randn(4096, 16, kvh, d, device=DEVICE, dtype=BF16)
    host_cache = torch.empty(4096, 16, kvh, d, dtype=BF16).pin_memory()
    mapping = torch.randperm(4096)[:2048].view(1024, 2)
    for label, src_cache, dst_cache, bw in [("swap out 1024 blocks GPU->CPU", gpu_cache, host_cache, link["out"]),
                                            ("swap in 1024 blocks CPU->GPU", host_cache, gpu_cache, link["in"])]:
        add(label, functools.partial(triton_ops.swap_blocks, src_cache, dst_cache, mapping), 1024 * block_bytes,
            link_bw=bw, graph=False)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="sweep tilings and split counts first")
    parser.add_argument("--splits", action="store_true", help="sweep split counts first")
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(2**31))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"triton {__import__('triton').__version__}; seed {args.seed}", flush=True)

    ok = correctness(rng)
    if args.sweep or args.splits:
        sweep(rng, tilings=args.sweep)
    rows = timings(rng)
    print(f"\n| {'what':<36} | {'GPU us':>8} | {'eager us':>8} | {'floor us':>8} | achieved |")
    print(f"|{'-' * 38}|{'-' * 10}|{'-' * 10}|{'-' * 10}|----------|")
    for label, gpu_us, eager_us, floor_us, rate in rows:
        print(f"| {label:<36} | {gpu_us:8.1f} | {eager_us:8.1f} | {floor_us:8.1f} | {rate} |")
    print("correctness:", "all passed" if ok else "FAILURES above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
