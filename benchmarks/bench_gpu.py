"""pagedrag vs HF transformers generate on NVIDIA GPUs, side by side in one run.

    python benchmarks/bench_gpu.py [--skip-hf] [--shape 8b|70b] [--tensor-parallel-size 1 2]

Llama-3-8B shape (32 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV heads,
head_dim 128, vocab 128256), or Llama-3-70B's (80 layers, hidden 8192, intermediate 28672,
64 heads, 8 KV heads), with random bf16 weights; fixed output lengths (EOS ignored), greedy
on both sides. With several tensor-parallel sizes the engine runs once per size (HF once,
on one GPU; not for the 70B shape, which does not fit one). Prints a markdown table with
each figure's floor: bytes / (copy bandwidth x GPUs) measured here, or FLOPs / PEAK_TFLOPS.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedrag import LLM, SamplingParams

PEAK_TFLOPS = 780.0  # bf16 dense, measured on this card (DESIGN.md)
NEW_TOKENS = 128
SYSTEM, CHUNK, QUESTION, POOL, PER_REQUEST, REQUESTS = 256, 256, 32, 16, 4, 32


SHAPES = {  # name -> (layers, hidden, intermediate, heads, parameters)
    "8b": (32, 4096, 14336, 32, 8.03e9),
    "70b": (80, 8192, 28672, 64, 70.6e9),
}


def llama3_config(shape: str = "8b") -> LlamaConfig:
    layers, hidden, intermediate, heads, _ = SHAPES[shape]
    return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)


def llama3_8b_config() -> LlamaConfig:
    return llama3_config("8b")


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of 4 GiB)."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * repeats / (time.perf_counter() - start)


def rag_prompts(seed: int = 0) -> list[list[int]]:
    """32 requests: a 256-token system prompt, 4 of 16 chunks of 256 tokens in stable
    (pool index) order, a 32-token question: 1,312 tokens each."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, 128000) for _ in range(n)]  # noqa: E731
    system, pool = tokens(SYSTEM), [tokens(CHUNK) for _ in range(POOL)]
    prompts = []
    for _ in range(REQUESTS):
        chosen = sorted(rng.sample(range(POOL), PER_REQUEST))
        prompts.append(system + sum((pool[i] for i in chosen), []) + tokens(QUESTION))
    return prompts


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def hf_figures(config: LlamaConfig, prompts: list[list[int]]) -> dict:
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()

    def generate(batch: list[list[int]], new: int):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)

    generate([prompts[0]], 2)  # warm up
    ttft = min(timed(lambda: generate([prompts[0]], 1)) for _ in range(3))
    decode = (timed(lambda: generate([prompts[0]], NEW_TOKENS + 1)) - ttft) / NEW_TOKENS
    rag = REQUESTS * NEW_TOKENS / timed(lambda: generate(prompts, NEW_TOKENS))
    del model
    torch.cuda.empty_cache()
    return {"ttft": ttft, "decode": decode, "rag": rag}


def engine_figures(folder: str, prompts: list[list[int]], tensor_parallel_size: int = 1) -> dict:
    llm = LLM(folder, load_format="dummy", max_model_len=4096, max_num_seqs=64,
              gpu_memory_utilization=0.85, tensor_parallel_size=tensor_parallel_size)
    one = lambda p, n: llm.generate({"prompt_token_ids": p},  # noqa: E731
                                    SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                    use_tqdm=False)[0]
    one(prompts[1], 4)  # warm up (kernels compiled, graphs already captured)
    llm.llm_engine.reset_prefix_cache()
    cold = min(_fresh_ttft(llm, one, prompts[0]) for _ in range(3))
    one(prompts[0], 1)
    cached_prompt = prompts[0][:1280] + prompts[2][-32:]
    cached = one(cached_prompt, 1)
    out = one(prompts[3], NEW_TOKENS)
    decode = (out.metrics.finished_time - out.metrics.first_token_time) / (NEW_TOKENS - 1)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # Steady state: a first run of the same prompts on an empty cache (then forgotten) compiles
    # every kernel variant their steps need; which requests share prefixes decides those steps.
    llm.llm_engine.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.reset_prefix_cache()
    queries_before, hits_before = llm.stats()["prefix_cache_queries"], llm.stats()["prefix_cache_hits"]
    seconds = timed(lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    stats = llm.stats()
    hit_rate = (stats["prefix_cache_hits"] - hits_before) / (stats["prefix_cache_queries"] - queries_before)
    llm.llm_engine.shutdown()
    return {"ttft_cold": cold, "ttft_cached": cached.metrics.ttft, "cached_tokens": cached.num_cached_tokens,
            "decode": decode, "rag": REQUESTS * NEW_TOKENS / seconds, "rag_seconds": seconds,
            "hit_rate": hit_rate, "blocks": stats["num_gpu_blocks"]}


def _fresh_ttft(llm, one, prompt) -> float:
    llm.llm_engine.reset_prefix_cache()
    return one(prompt, 1).metrics.ttft


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    config = llama3_config(args.shape)
    prompts = rag_prompts()
    bandwidth = copy_bandwidth()
    hf = None if args.skip_hf or args.shape != "8b" else hf_figures(config, prompts)
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        for size in args.tensor_parallel_size:
            if size > torch.cuda.device_count():
                print(f"tensor_parallel_size={size}: skipped, {torch.cuda.device_count()} GPU(s) here")
                continue
            runs[size] = engine_figures(folder, prompts, size)
    print(f"\n{torch.cuda.get_device_name()} x {torch.cuda.device_count()}, torch {torch.__version__}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s a GPU; Llama-3-{args.shape} shape\n")
    print("| figure | " + " | ".join(f"pagedrag TP={size}" for size in runs) + " | HF generate (1 GPU) | "
          "floor (TP=" + ", ".join(map(str, runs)) + ") |")
    print("|---|" + "---|" * (len(runs) + 2))
    for row in figure_rows(config, args.shape, runs, hf, bandwidth):
        print("| " + " | ".join(row) + " |")


def figure_rows(config: LlamaConfig, shape: str, runs: dict[int, dict], hf: dict | None,
                bandwidth: float) -> list[list[str]]:
    """The table's rows: each figure for every tensor-parallel size, HF's, and the floors."""
    params = SHAPES[shape][4]
    weight_bytes = 2 * params
    kv_per_token = 2 * config.num_hidden_layers * 8 * 128 * 2
    flops_per_token = 2 * params
    hf_col = (lambda key, fmt: fmt.format(hf[key])) if hf else (lambda key, fmt: "skipped")

    def floors(fn) -> str:
        return ", ".join(fn(size) for size in runs)

    def floor_rag(size: int, hit_rate: float) -> float:
        uncached = sum(len(p) for p in rag_prompts()) * (1 - hit_rate)
        return (uncached * flops_per_token / (PEAK_TFLOPS * 1e12 * size)
                + NEW_TOKENS * (weight_bytes + REQUESTS * 1376 * kv_per_token) / (bandwidth * size))

    return [
        ["batch-1 decode, 1.3k context", *(f"{r['decode'] * 1e3:.2f} ms/token" for r in runs.values()),
         hf_col("decode", "{:.4f} s/token"),
         floors(lambda n: f"{(weight_bytes + 1376 * kv_per_token) / (bandwidth * n) * 1e3:.2f} ms")],
        ["RAG workload, 32 x (1,312 prompt + 128 new), stable order",
         *(f"{r['rag']:.0f} tok/s ({r['rag_seconds']:.2f} s, prefix hit {r['hit_rate']:.1%})" for r in runs.values()),
         hf_col("rag", "{:.0f} tok/s"),
         floors(lambda n: f"{REQUESTS * NEW_TOKENS / floor_rag(n, runs[n]['hit_rate']):.0f} tok/s")],
        ["TTFT, 1,312-token prompt, cold", *(f"{r['ttft_cold'] * 1e3:.1f} ms" for r in runs.values()),
         hf_col("ttft", "{:.3f} s"),
         floors(lambda n: f"{1312 * flops_per_token / (PEAK_TFLOPS * 1e12 * n) * 1e3:.1f} ms")],
        ["TTFT, 1,312-token prompt, 1,280 tokens cached",
         *(f"{r['ttft_cached'] * 1e3:.1f} ms" for r in runs.values()), "",
         floors(lambda n: f"{weight_bytes / (bandwidth * n) * 1e3:.1f} ms")],
        ["KV pool (blocks of 16 tokens)", *(str(r["blocks"]) for r in runs.values()), "", ""],
    ]


if __name__ == "__main__":
    main()
