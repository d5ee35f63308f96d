"""Chunk reuse against prefix-only caching on one NVIDIA GPU, side by side in one run.

    python benchmarks/bench_chunk_gpu.py [--recompute-fraction F]

Llama-3-8B shape with random bf16 weights (bench_gpu.llama3_8b_config); prompts of token
ids: a 256-token system prompt, chunks of 256 tokens, a 32-token question, given as
prompt_segments. Two engines share the card: prefix caching only, and chunk reuse (the default
strategy, the default recompute fraction unless given). Prints a markdown table:

- TTFT of a 1,568-token prompt (system prompt + 5 chunks + question) whose chunks were all
  seen before in other combinations (its system prompt and first chunk lead one of them);
- the 32-request RAG workload of bench_gpu (4 of 16 chunks, 128 new tokens each) with the
  chunks of each request in random order, and the share of prompt tokens computed; then the
  same prompts again with all of them cached, the bound any caching can reach;
- chunk reuse's first tokens and their logprobs with CUDA graphs against an eager engine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu import CHUNK, NEW_TOKENS, PER_REQUEST, POOL, QUESTION, REQUESTS, SYSTEM, llama3_8b_config  # noqa: E402

from pagedrag import LLM, SamplingParams  # noqa: E402

TARGET_CHUNKS = 5


class Tokens:
    """Random token-id strings, reproducible."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def __call__(self, count: int) -> list[int]:
        return [self.rng.randrange(3, 128000) for _ in range(count)]


def segments(system: list[int], chunks: list[list[int]], question: list[int]) -> dict:
    return {"prompt_segments": [system, *chunks, {"token_ids": question, "reusable": False}]}


def first_token_seconds(llm: LLM, prompt: dict) -> float:
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return out.metrics.ttft


def ttft_after_other_combinations(llm: LLM, seed: int) -> float:
    """TTFT of a 1,568-token prompt whose chunks were all seen before, elsewhere."""
    tokens = Tokens(seed)
    system, targets, others = tokens(SYSTEM), [tokens(CHUNK) for _ in range(TARGET_CHUNKS)], \
        [tokens(CHUNK) for _ in range(TARGET_CHUNKS)]
    # Each target chunk once, at another position and next to other chunks; the first leads.
    seen = [[targets[0], others[0]], [others[1], targets[2], targets[1]], [others[2], targets[4]],
            [others[3], others[4], targets[3]]]
    for chunks in seen:
        first_token_seconds(llm, segments(system, chunks, tokens(QUESTION)))
    return first_token_seconds(llm, segments(system, targets, tokens(QUESTION)))


def rag_workload(llm: LLM, seed: int) -> tuple[float, float]:
    """(tokens/s, share of prompt tokens computed) of 32 requests, chunks in random order."""
    tokens = Tokens(seed)
    system, pool = tokens(SYSTEM), [tokens(CHUNK) for _ in range(POOL)]
    prompts = [segments(system, [pool[i] for i in tokens.rng.sample(range(POOL), PER_REQUEST)], tokens(QUESTION))
               for _ in range(REQUESTS)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    before = llm.stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    after = llm.stats()
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    return REQUESTS * NEW_TOKENS / seconds, computed / (after["prompt_tokens_total"] - before["prompt_tokens_total"])


def first_tokens(llm: LLM) -> list[tuple[int, float]]:
    """(greedy first token, its logprob) of the TTFT scenario's prompts from an empty cache,
    one at a time: from the second on, every chunk is imported and the step is a prefill of
    6 runs (5 recomputed stretches and the question) that a CUDA graph serves."""
    llm.reset_prefix_cache()
    tokens = Tokens(5)
    system, chunks = tokens(SYSTEM), [tokens(CHUNK) for _ in range(TARGET_CHUNKS)]
    prompts = [segments(system, chunks[i:] + chunks[:i], tokens(QUESTION)) for i in range(TARGET_CHUNKS)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    firsts = []
    for prompt in prompts:
        sample = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        firsts.append((sample.token_ids[0], sample.logprobs[0][sample.token_ids[0]].logprob))
    return firsts


def graphs_against_eager(engine: dict) -> str:
    """Chunk reuse with CUDA graphs against the eager engine, in float32 on a 4-layer cut of
    the model (bf16 would hide a difference: the graphs' wider block tables split the keys
    differently, and the rounding then differs): same first tokens, and how far apart their
    logprobs are."""
    config = llama3_8b_config()
    config.num_hidden_layers = 4
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        for eager in (False, True):
            llm = LLM(folder, **engine, dtype="float32", enable_chunk_reuse=True, enforce_eager=eager)
            runs.append(first_tokens(llm))
            del llm
            torch.cuda.empty_cache()
    same = sum(a[0] == b[0] for a, b in zip(*runs))
    gap = max(abs(a[1] - b[1]) for a, b in zip(*runs))
    return f"{same}/{len(runs[0])} first tokens equal, logprobs at most {gap:.1e} apart"


def measure(llm: LLM) -> dict:
    """Each figure's second run of the same shapes (the first compiles kernel variants): the
    median TTFT over three fresh sets of chunks, the RAG workload's throughput."""
    ttfts = []
    for seed in (1, 1, 2, 3):
        llm.reset_prefix_cache()
        ttfts.append(ttft_after_other_combinations(llm, seed))
    for _ in range(2):
        llm.reset_prefix_cache()
        throughput, computed = rag_workload(llm, seed=4)
    cached, _ = rag_workload(llm, seed=4)  # the same prompts again: all but their last blocks cached
    return {"ttft": statistics.median(ttfts[1:]), "rag": throughput, "computed": computed, "cached": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recompute-fraction", type=float, default=None, help="default: the engine's")
    options = parser.parse_args()
    fraction = {} if options.recompute_fraction is None else {"chunk_recompute_fraction": options.recompute_fraction}
    with tempfile.TemporaryDirectory() as folder:
        llama3_8b_config().save_pretrained(folder)
        engine = dict(load_format="dummy", max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.4)
        prefix_only = measure(LLM(folder, **engine))
        torch.cuda.empty_cache()
        reuse_llm = LLM(folder, **engine, enable_chunk_reuse=True, **fraction)
        reuse = measure(reuse_llm)
        args = reuse_llm.llm_engine.args
        del reuse_llm
        torch.cuda.empty_cache()
        check = graphs_against_eager(engine)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; chunk reuse with recompute "
          f"{args.chunk_recompute_fraction:.0%} ({args.chunk_recompute_strategy})\n")
    print("| figure | prefix caching only | chunk reuse | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| TTFT, 1,568-token prompt, 5 chunks seen in other combinations | {prefix_only['ttft'] * 1e3:.1f} ms | "
          f"{reuse['ttft'] * 1e3:.1f} ms | {reuse['ttft'] / prefix_only['ttft']:.2f}x | <= 0.5x |")
    print(f"| RAG workload, 32 x (1,312 + 128), chunks in random order | {prefix_only['rag']:,.0f} tok/s "
          f"({prefix_only['computed']:.1%} of prompt tokens computed) | {reuse['rag']:,.0f} tok/s "
          f"({reuse['computed']:.1%} computed) | {reuse['rag'] / prefix_only['rag']:.2f}x | >= 1.5x |")
    print(f"| the same workload again, all prompts cached (the bound of any caching) | "
          f"{prefix_only['cached']:,.0f} tok/s | | {prefix_only['cached'] / prefix_only['rag']:.2f}x | |")
    print(f"\nChunk reuse with CUDA graphs against eager (float32, 4 layers): {check}")


if __name__ == "__main__":
    main()
