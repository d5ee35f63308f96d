"""The low-bit path's greedy answers against the float32 path's, on real RAG prompts.

    python benchmarks/bench_lowbit_quality.py [--prompts 32] [--tokens 64]

The embedded SmolLM2-135M-Instruct on CPU twice: quantization="gguf" (the GGUF's own 4-bit
blocks through torch's int4 kernel, bfloat16 activations: the CPU default) and
quantization="none" (the same weights dequantized to float32: the HF-equality path).
Prompts: the first ``--prompts`` questions of the pydoc-topics RAG stream
(benchmarks/rag_stream.py), laid out by the canonicalizer as the integrations do (system
prompt, the retrieved chunks, the question; chat template). Per prompt: whether the first
greedy token agrees, and how many leading tokens of the ``--tokens`` greedy answer match
exactly. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from rag_stream import SYSTEM_PROMPT, rag_stream

from pagedrag import LLM, SamplingParams
from pagedrag.rag.canonical import PromptCanonicalizer

ENGINE = {"max_model_len": 2048, "max_num_seqs": 8}


def common_prefix(first: list[int], second: list[int]) -> int:
    for index, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return index
    return min(len(first), len(second))


def greedy_answers(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    lowbit = LLM(**ENGINE, quantization="gguf")
    canonicalizer = PromptCanonicalizer(SYSTEM_PROMPT, order="relevance", tokenizer=lowbit.get_tokenizer())
    prompts = [canonicalizer.build(question, [(c.source_id, c.text) for c in chunks]).token_ids
               for question, chunks in rag_stream()[:args.prompts]]
    ours = greedy_answers(lowbit, prompts, args.tokens)
    del lowbit
    reference = greedy_answers(LLM(**ENGINE, quantization="none"), prompts, args.tokens)
    matches = [common_prefix(a, b) for a, b in zip(ours, reference, strict=True)]
    first = sum(m > 0 for m in matches)
    lengths = [len(p) for p in prompts]
    print(f"\n{len(prompts)} pydoc-topics RAG prompts ({min(lengths)}-{max(lengths)} tokens), "
          f"{args.tokens} greedy tokens each\n")
    print("| figure | low-bit (gguf) vs float32 | target |")
    print("|---|---|---|")
    print(f"| first-token agreement | {first}/{len(prompts)} ({first / len(prompts):.0%}) | >= 95% |")
    print(f"| exact-match length, median (mean) | {statistics.median(matches):.0f} ({statistics.mean(matches):.1f}) "
          f"of {args.tokens} tokens | report |")
    print(f"| answers identical over all {args.tokens} tokens | {sum(m == args.tokens for m in matches)}"
          f"/{len(prompts)} | report |")
    print(f"| exact-match lengths | {sorted(matches)} | |")


if __name__ == "__main__":
    main()
