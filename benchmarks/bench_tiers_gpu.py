"""KV tiers on an NVIDIA GPU, Llama-3-8B shape with random bf16 weights, in one run.

    python benchmarks/bench_tiers_gpu.py [--disk-path /tmp/pagedrag-kv]

1. Pinned host-to-device copy bandwidth (one 160 MiB copy), against the host tier's own load of
   80 blocks (1,280 tokens: 160 MiB) into the pool, timed alone.
2. TTFT of a 1,312-token prompt whose first 1,280 tokens are: nowhere (cold), in the pool (a
   pool hit), in the host tier only (the pool forgot them: reset_prefix_cache), in the disk
   tier only (an engine with the disk tier alone).
3. The 32-request RAG workload of bench_gpu.py (128 new tokens each) with the pool cut to a
   quarter of the blocks it needs, without a tier and with the host tier. Each arm
   runs the workload once to warm up (kernels compiled; with the tier, its blocks written),
   forgets the pool, then is timed: the steady state of a workload that recurs. Then the
   same prompts with 16 new tokens each (a quarter of that workload's blocks): where the
   time is prefill, not decoding a few requests at a time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from bench_gpu import NEW_TOKENS, REQUESTS, llama3_config, rag_prompts, timed
from pagedrag import LLM, SamplingParams

ENGINE = {"load_format": "dummy", "max_model_len": 2048, "max_num_seqs": 64, "gpu_memory_utilization": 0.85}
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def pinned_bandwidth(num_bytes: int = 160 << 20) -> float:
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        device.copy_(host, non_blocking=True)
    seconds = min(timed(lambda: device.copy_(host, non_blocking=True)) for _ in range(10))
    return num_bytes / seconds


def host_load_bandwidth(llm: LLM, prompt: list[int]) -> float:
    """The host tier's load of the prompt's blocks into the pool, timed alone (bytes/s)."""
    engine = llm.llm_engine
    llm.generate({"prompt_token_ids": prompt}, ONE, use_tqdm=False)
    engine.flush_tiers()
    host, pool, size = engine.tiers.stores[0], engine.kv.pool, engine.args.block_size
    loads = []  # each block's own K/V back into its own pool block: the pool's contents stay as they are
    for index, block_hash in enumerate(_hashes(engine, prompt)[:80]):
        tokens = prompt[index * size:(index + 1) * size]
        loads.append((pool.lookup(block_hash, tokens).block_id, host.get(engine.tiers.key(block_hash)).kv))
    cache = engine.runner.cache
    cache.load_blocks(loads)
    seconds = min(timed(lambda: cache.load_blocks(loads)) for _ in range(5))
    return sum(kv.numel() * kv.element_size() for _, kv in loads) / seconds


def _hashes(engine, prompt: list[int]) -> list[bytes]:
    from pagedrag.core.request import Request

    return Request("probe", prompt, SamplingParams(), engine.args.block_size).block_hashes


def ttft(llm: LLM, prompt: list[int], forget_pool: bool) -> float:
    """Median of 5 TTFTs of ``prompt`` (its first 1,280 tokens cached as ``forget_pool`` leaves them)."""
    values = []
    for _ in range(5):
        if forget_pool:
            llm.reset_prefix_cache()
        values.append(llm.generate({"prompt_token_ids": prompt}, ONE, use_tqdm=False)[0].metrics.ttft)
    return statistics.median(values)


def workload(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    run = lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # noqa: E731
    run()
    llm.llm_engine.flush_tiers()
    llm.reset_prefix_cache()
    return REQUESTS * new_tokens / timed(run)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--disk-path", default=None, help="the disk tier's directory (default: a temporary one)")
    args = parser.parse_args()
    prompts = rag_prompts()
    probe = prompts[0][:1280] + prompts[2][-32:]
    rows, bandwidth = [], pinned_bandwidth()
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as disk:
        llama3_config("8b").save_pretrained(folder)
        llm = LLM(folder, kv_offloading_size=16, **ENGINE)
        log('llm = LLM(folder, kv_offloading_size=16, **ENGINE)')
        llm.generate({"prompt_token_ids": prompts[1]}, ONE, use_tqdm=False)  # warm up
        loads = host_load_bandwidth(llm, prompts[0])
        log('loads = host_load_bandwidth(llm, prompts[0])')
        llm.reset_prefix_cache()
        rows.append(("TTFT, cold", statistics.median(  # prompts never seen before
            llm.generate({"prompt_token_ids": rag_prompts(seed)[0]}, ONE, use_tqdm=False)[0].metrics.ttft
            for seed in (11, 12, 13))))
        llm.generate({"prompt_token_ids": prompts[0]}, ONE, use_tqdm=False)
        rows.append(("TTFT, 1,280 tokens in the pool", ttft(llm, probe, forget_pool=False)))
        log('rows.append(("TTFT, 1,280 tokens in the pool", ttf')
        rows.append(("TTFT, 1,280 tokens in the host tier", ttft(llm, probe, forget_pool=True)))
        log('rows.append(("TTFT, 1,280 tokens in the host tier"')
        needed = llm.stats()["num_cached_blocks"]
        llm.llm_engine.shutdown()
        del llm
        disk_llm = LLM(folder, kv_disk_path=args.disk_path or disk, **ENGINE)
        disk_llm.generate({"prompt_token_ids": prompts[0]}, ONE, use_tqdm=False)
        disk_llm.llm_engine.flush_tiers()
        rows.append(("TTFT, 1,280 tokens in the disk tier", ttft(disk_llm, probe, forget_pool=True)))
        log('rows.append(("TTFT, 1,280 tokens in the disk tier"')
        disk_stats = disk_llm.stats()["kv_tiers"]
        disk_llm.llm_engine.shutdown()
        del disk_llm
        arms = {}
        for new_tokens in (NEW_TOKENS, 16):
            quarter = workload_blocks(prompts, new_tokens) // 4
            for name, extra in (("no tier", {}), ("host tier", {"kv_offloading_size": 16})):
                llm = LLM(folder, **{**ENGINE, "num_gpu_blocks_override": quarter}, **extra)
                arms[new_tokens, quarter, name] = workload(llm, prompts, new_tokens)
                log(f'arms[{new_tokens}, {quarter}, {name}]')
                llm.llm_engine.shutdown()
                del llm
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; Llama-3-8B shape, random bf16 weights\n")
    print(f"pinned host-to-device copy: {bandwidth / 1e9:.1f} GB/s; host tier load of 80 blocks: "
          f"{loads / 1e9:.1f} GB/s ({loads / bandwidth:.0%} of it)")
    seconds = disk_stats["seconds"].get("disk_to_host", 0)
    if seconds:
        print(f"disk tier reads: {disk_stats['bytes']['disk_to_host'] / seconds / 1e9:.2f} GB/s "
              f"(cost model: {disk_stats['cost_model']})")
    print("\n| figure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value * 1e3:.1f} ms |")
    print(f"\n32-request RAG workload, the pool cut to a quarter of the blocks it needs ({needed} cached "
          "after one prompt):\n\n| new tokens a request | pool blocks | arm | output tok/s | vs no tier |\n|---|---|---|---|---|")
    for (new_tokens, quarter, name), tokens_per_s in arms.items():
        print(f"| {new_tokens} | {quarter} | {name} | {tokens_per_s:.0f} | "
              f"{tokens_per_s / arms[new_tokens, quarter, 'no tier']:.2f}x |")


def workload_blocks(prompts: list[list[int]], new_tokens: int, block_size: int = 16) -> int:
    """Distinct full prompt blocks of the workload plus each request's decode blocks."""
    distinct = {tuple(p[:end]) for p in prompts for end in range(block_size, len(p) + 1, block_size)}
    return len(distinct) + len(prompts) * -(-new_tokens // block_size)


if __name__ == "__main__":
    main()
