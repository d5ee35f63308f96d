"""Chunk reuse against prefix-only caching on CPU, on the 176-question pydoc-topics stream.

    python benchmarks/bench_chunk_cpu.py [--questions 176] [--cache-aware]

The embedded SmolLM2-135M-Instruct (float32). Engines with a cache large enough for the whole
stream take its prompts (MiniLM top-5 chunks, through the canonicalizer with the chat
template) one at a time, interleaved prompt by prompt so that other load on the machine
falls on all of them alike:

- prefix caching only, chunks in the canonicalizer's stable order (its default) and, with
  ``--cache-aware``, in cache-aware order (the chunks already cached first);
- chunk reuse (default recompute fraction and strategy), stable order.

Prints the share of prompt tokens each computed and its median time to first token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from rag_stream import SYSTEM_PROMPT, rag_stream  # noqa: E402

from pagedrag import LLM, SamplingParams  # noqa: E402
from pagedrag.rag.canonical import REUSABLE_CHUNK_TEMPLATE, PromptCanonicalizer  # noqa: E402

ENGINE = {"max_model_len": 2048, "kv_cache_memory_bytes": 2 << 30}
PREFIX_ARMS = (("prefix caching, stable order", "stable", {}),
               ("prefix caching, cache-aware order", "cache_aware", {}))
REUSE_ARM = ("chunk reuse, stable order", "stable", {"enable_chunk_reuse": True})


class Arm:
    def __init__(self, name: str, order: str, engine: dict):
        self.name = name
        self.llm = LLM(**ENGINE, **engine)
        self.canonicalizer = PromptCanonicalizer(SYSTEM_PROMPT, order, tokenizer=self.llm.get_tokenizer(),
                                                 engine=self.llm.llm_engine, chunk_template=REUSABLE_CHUNK_TEMPLATE)
        self.ttfts: list[float] = []

    def ask(self, question: str, chunks: list) -> None:
        prompt = self.canonicalizer.build(question, [(c.source_id, c.text) for c in chunks])
        out = self.llm.generate({"prompt_segments": prompt.segments}, SamplingParams(temperature=0, max_tokens=1),
                                use_tqdm=False)[0]
        self.ttfts.append(out.metrics.ttft)

    def computed_share(self) -> float:
        stats = self.llm.stats()
        return stats["prompt_tokens_computed"] / stats["prompt_tokens_total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=176)
    parser.add_argument("--cache-aware", action="store_true", help="add the cache-aware prefix-only arm")
    args = parser.parse_args()
    stream = rag_stream()[:args.questions]
    prefix_arms = [Arm(*arm) for arm in PREFIX_ARMS[:1 + args.cache_aware]]
    reuse = Arm(*REUSE_ARM)
    arms = prefix_arms + [reuse]
    for question, chunks in stream:
        for arm in arms:
            arm.ask(question, chunks)
    best_prefix = min(prefix_arms, key=lambda arm: statistics.median(arm.ttfts))
    print(f"{len(stream)} questions over the pydoc topics (MiniLM top-5), one at a time\n")
    print("| arm | prompt tokens computed | median TTFT | TTFT vs best prefix-only |")
    print("|---|---|---|---|")
    for arm in arms:
        ratio = statistics.median(best_prefix.ttfts) / statistics.median(arm.ttfts)
        print(f"| {arm.name} | {arm.computed_share():.1%} | {statistics.median(arm.ttfts) * 1e3:.0f} ms | "
              f"{ratio:.2f}x lower |")
    args_ = reuse.llm.llm_engine.args
    print(f"\nchunk reuse: recompute {args_.chunk_recompute_fraction:.0%} ({args_.chunk_recompute_strategy})")


if __name__ == "__main__":
    main()
