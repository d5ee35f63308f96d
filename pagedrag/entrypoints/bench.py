"""The RAG-shaped workload and `pagedrag bench`, which runs it through the engine.

A workload request is a fixed system prompt, 3 to 5 chunks drawn from a pool of
documents (the standard library's docstrings, see pagedrag.rag.corpus) and a question.
Chunk sets repeat across requests, as they do when many users ask about the same
documents, so a warm prefix cache has something to hit.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from dataclasses import dataclass

from pagedrag.rag.corpus import DocChunk, stdlib_chunks

SYSTEM_PROMPT = ("You are a helpful assistant for Python programmers. Answer the question using "
                 "only the documentation excerpts given below, quoting names exactly. If the "
                 "excerpts do not contain the answer, say that you do not know.")
MAX_DRAWS = 2000  # chunk sets tried for prompts of the wanted length before giving up
QUESTIONS = ("What does {name} do?", "When should I use {name}?", "Which arguments does {name} take?",
             "What does {name} return?", "Give an example of calling {name}.",
             "What errors can {name} raise?")


@dataclass(frozen=True)
class RagRequest:
    chunks: tuple[DocChunk, ...]
    question: str

    def messages(self, system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
        """The stable layout: system prompt, chunks by source id, then the question."""
        ordered = sorted(self.chunks, key=lambda c: c.source_id)
        context = "".join(f"[{c.source_id}]\n{c.text}\n\n" for c in ordered)
        return [{"role": "system", "content": system_prompt},
                {"role": "user", "content": f"Documentation:\n\n{context}Question: {self.question}"}]


def chunk_pool(size: int = 16, seed: int = 0) -> list[DocChunk]:
    """``size`` mid-length chunks (about 120-170 tokens each), chosen reproducibly."""
    candidates = [c for c in stdlib_chunks() if 500 <= len(c.text) <= 700]
    return random.Random(seed).sample(candidates, size)


def rag_requests(num_requests: int, num_chunk_sets: int = 8, seed: int = 0, pool_size: int = 16,
                 tokenizer=None, prompt_tokens: tuple[int, int] = (600, 800)) -> list[RagRequest]:
    """num_requests requests over num_chunk_sets distinct sets of 3-5 chunks, round robin.

    With a tokenizer, only chunk sets whose chat prompts fall within prompt_tokens are kept.
    """
    rng = random.Random(seed)
    pool = chunk_pool(pool_size, seed)
    sets: list[tuple[DocChunk, ...]] = []
    for draws in itertools.count():
        if len(sets) == num_chunk_sets:
            break
        if draws == MAX_DRAWS:
            raise ValueError(f"only {len(sets)} of {MAX_DRAWS} chunk sets made prompts of {prompt_tokens[0]}-"
                             f"{prompt_tokens[1]} tokens with this tokenizer; {num_chunk_sets} are needed")
        chunks = tuple(rng.sample(pool, rng.randint(3, 5)))
        if tokenizer is None or _prompt_length(tokenizer, chunks) in range(*prompt_tokens):
            sets.append(chunks)
    requests = []
    for index in range(num_requests):
        chunks = sets[index % num_chunk_sets]
        name = rng.choice(chunks).source_id
        requests.append(RagRequest(chunks, rng.choice(QUESTIONS).format(name=name)))
    return requests


def _prompt_length(tokenizer, chunks: tuple[DocChunk, ...]) -> int:
    probe = RagRequest(chunks, QUESTIONS[0].format(name=chunks[0].source_id))
    text = tokenizer.apply_chat_template(probe.messages(), tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedrag.server.cli import positive_int

    parser.add_argument("--model", default=None, help="model folder or name (default: embedded SmolLM2)")
    parser.add_argument("--max-model-len", type=positive_int, default=2048,
                        help="the longest sequence (default 2048, or the model's limit where shorter)")
    parser.add_argument("--num-requests", type=positive_int, default=16)
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--max-num-seqs", type=positive_int, default=8)
    parser.add_argument("--no-prefix-caching", action="store_true")


def run(args: argparse.Namespace) -> int:
    from pagedrag import LLM, SamplingParams
    from pagedrag.models.loader import capped_max_model_len

    llm = LLM(args.model, max_model_len=capped_max_model_len(args.model, args.max_model_len),
              max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=not args.no_prefix_caching)
    prompts = [llm.apply_chat_template(r.messages()) for r in rag_requests(args.num_requests, tokenizer=llm.get_tokenizer())]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    ttfts = [o.metrics.ttft for o in outputs]
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.stats()
    print(f"requests {len(outputs)}, prompt tokens {sum(len(o.prompt_token_ids) for o in outputs)}, "
          f"output tokens {generated} in {elapsed:.2f} s: {generated / elapsed:.1f} tok/s")
    print(f"TTFT p50 {statistics.median(ttfts) * 1000:.0f} ms, p99 {percentile(ttfts, 0.99) * 1000:.0f} ms; "
          f"prefix hit rate {stats['prefix_cache_hit_rate']:.1%}; preemptions {stats['num_preemptions']}")
    return 0
