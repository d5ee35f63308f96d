"""pagedrag vs HF transformers generate on CPU, side by side in one run.

    python benchmarks/bench_cpu.py [--threads 2] [--repeats 3]

SmolLM2-135M-Instruct (the embedded default, float32), the RAG workload of
pagedrag.entrypoints.bench (a fixed system prompt, 3-5 chunks from a pool of 16, a question;
600-800 prompt tokens). Prints a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from pagedrag import LLM, SamplingParams
from pagedrag.entrypoints.bench import rag_requests
from pagedrag.models.loader import resolve_checkpoint

MAX_MODEL_LEN = 2048


def hf_generate_seconds(model, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def engine_ttft(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)[0]
    return out.metrics.ttft


def bench_ttft(llm, hf, warmup, measured) -> dict:
    for prompt in warmup:  # first visit of each chunk set: fills the prefix cache
        engine_ttft(llm, prompt)
    hits_before = llm.stats()["prefix_cache_hits"]
    ours = [engine_ttft(llm, p) for p in measured]
    hit_tokens = llm.stats()["prefix_cache_hits"] - hits_before
    theirs = [hf_generate_seconds(hf, p, 1) for p in measured]
    return {"ours": statistics.median(ours), "hf": statistics.median(theirs),
            "hit": hit_tokens / sum(len(p) for p in measured)}


def bench_throughput(llm, hf, prompts, warmup, new_tokens, repeats) -> dict:
    """8 requests at once, with a warm prefix cache (it holds just the ``warmup`` prompts,
    which share their chunk sets) and with an empty one (cold), against HF generating
    them one at a time; the three alternate ``repeats`` times (this shared machine's
    speed drifts by tens of percent over minutes), and each figure is the median."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    tokens = len(prompts) * new_tokens
    seconds = {"warm": [], "cold": [], "hf": []}
    for _ in range(repeats):
        for name in ("warm", "cold"):
            llm.llm_engine.reset_prefix_cache()
            if name == "warm":
                for prompt in warmup:
                    engine_ttft(llm, prompt)
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
        seconds["hf"].append(sum(hf_generate_seconds(hf, p, new_tokens) for p in prompts))
    return {name: tokens / statistics.median(values) for name, values in seconds.items()}


def bench_decode(llm, hf, prompt, new_tokens, repeats) -> dict:
    """Tokens a second after the first token, one request alone; ours and HF's alternate
    ``repeats`` times, each figure is the median."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ours, theirs = [], []
    for _ in range(repeats):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        ours.append((new_tokens - 1) / (out.metrics.finished_time - out.metrics.first_token_time))
        hf_decode = hf_generate_seconds(hf, prompt, new_tokens) - hf_generate_seconds(hf, prompt, 1)
        theirs.append((new_tokens - 1) / hf_decode)
    return {"ours": statistics.median(ours), "hf": statistics.median(theirs)}


def bench_memory(path, prompts, new_tokens) -> dict:
    """Real tokens in the KV pool / pool memory held, sampled every step (caching off,
    so each block belongs to one request), next to a contiguous max_model_len reservation."""
    llm = LLM(path, max_model_len=MAX_MODEL_LEN, max_num_seqs=len(prompts), enable_prefix_caching=False)
    engine = llm.llm_engine
    for p in prompts:
        engine.add_request(None, {"prompt_token_ids": p}, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    paged, contiguous = [], []
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        if not running:
            continue
        tokens = sum(r.num_computed_tokens for r in running)
        paged.append(tokens / (engine.kv.pool.num_used * engine.args.block_size))
        contiguous.append(tokens / (len(running) * MAX_MODEL_LEN))
    return {"paged": statistics.mean(paged), "contiguous": statistics.mean(contiguous)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs behind each median")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_checkpoint(None))
    llm = LLM(path, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    requests = rag_requests(24, num_chunk_sets=8, tokenizer=tokenizer)
    prompts = [llm.apply_chat_template(r.messages())["prompt_token_ids"] for r in requests]
    lengths = [len(p) for p in prompts]
    engine_ttft(llm, prompts[0]), hf_generate_seconds(hf, prompts[0], 1)  # warm both up
    llm.llm_engine.reset_prefix_cache()

    ttft = bench_ttft(llm, hf, prompts[:8], prompts[8:16])
    throughput = bench_throughput(llm, hf, prompts[16:24], prompts[:8], args.new_tokens, args.repeats)
    decode = bench_decode(llm, hf, prompts[0], 128, args.repeats)
    memory = bench_memory(path, prompts[16:24], args.new_tokens)

    print(f"\nSmolLM2-135M-Instruct fp32, {args.threads} threads, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}; prompts {min(lengths)}-{max(lengths)} tokens\n")
    print("| figure | pagedrag | HF generate | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| median TTFT, warm prefix cache (hit {ttft['hit']:.0%} of prompt tokens) | "
          f"{ttft['ours'] * 1000:.0f} ms | {ttft['hf'] * 1000:.0f} ms | {ttft['hf'] / ttft['ours']:.1f}x lower | >= 5x |")
    for name in ("warm", "cold"):
        print(f"| throughput, 8 concurrent requests x {args.new_tokens} tokens ({name} prefix cache) vs HF one at a time | "
              f"{throughput[name]:.1f} tok/s | {throughput['hf']:.1f} tok/s | {throughput[name] / throughput['hf']:.1f}x | >= 4x |")
    print(f"| batch-1 decode, 128 tokens | {decode['ours']:.1f} tok/s | {decode['hf']:.1f} tok/s | "
          f"{decode['ours'] / decode['hf']:.2f}x | >= 1.0x |")
    print(f"| KV memory holding real tokens / reserved | {memory['paged']:.1%} (paged, block 16) | "
          f"{memory['contiguous']:.1%} (contiguous max_model_len={MAX_MODEL_LEN}) | | >= 96% |")


if __name__ == "__main__":
    main()
