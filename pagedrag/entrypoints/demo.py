"""`pagedrag demo`: a small RAG loop on the embedded model that shows the prefix cache at work.

Every query sends the same system prompt and three retrieved chunks in stable order
(by source id), then the question; the readouts show how many prompt tokens each
query took from the cache, the running hit rate and the time to first token.
"""

from __future__ import annotations

import argparse

SYSTEM_PROMPT = ("You are a concise assistant. Answer the question using only the context "
                 "documents below. If the answer is not in them, say you do not know.")

DOCUMENTS = {
    "kv-cache": "An inference engine keeps the keys and values of every attention layer for "
                "the tokens it has already processed. This key-value cache lets each new token "
                "attend to the whole context without recomputing it.",
    "paging": "Paged attention stores the key-value cache in fixed-size blocks, sixteen tokens "
              "each by default, like pages of virtual memory. A block table maps each sequence "
              "to its blocks, so memory is claimed as tokens arrive and freed when a request ends.",
    "prefix": "Prefix caching hashes every full block together with the blocks before it. When "
              "a new request starts with the same tokens, for example the same system prompt "
              "and the same retrieved documents, its blocks are found by hash and reused.",
    "rag": "Retrieval-augmented generation puts documents found by a retriever into the prompt. "
           "Pipelines that send the same documents in the same order keep hitting the prefix "
           "cache; shuffled documents or a timestamp early in the prompt break the match.",
    "batching": "Continuous batching lets new requests join the running batch at every step "
                "instead of waiting for the whole batch to finish, which keeps the hardware busy.",
    "preemption": "When the block pool runs out, the scheduler preempts the newest request. By "
                  "default its blocks are freed and recomputed later; they keep their hashes, so "
                  "the resumed request often finds them still cached.",
}

QUERIES = [
    ("What does paged attention store in blocks?", ["paging", "kv-cache", "prefix"]),
    ("How does prefix caching find reusable blocks?", ["prefix", "paging", "kv-cache"]),
    ("Why do shuffled documents hurt the cache?", ["rag", "prefix", "paging"]),
    ("What is continuous batching?", ["batching", "paging", "kv-cache"]),
    ("What happens when the block pool runs out?", ["preemption", "paging", "prefix"]),
    ("How big is a block by default?", ["paging", "prefix", "kv-cache"]),
]


def retrieved(sources: list[str]) -> list[dict]:
    """What a retriever hands over: chunks in relevance order, with their source ids."""
    return [{"text": DOCUMENTS[source], "source_id": source} for source in sources]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedrag.server.cli import positive_int

    parser.add_argument("--model", default=None, help="model folder or name (default: embedded SmolLM2)")
    parser.add_argument("--max-model-len", type=positive_int, default=2048,
                        help="the longest sequence (default 2048, or the model's limit where shorter)")
    parser.add_argument("--max-tokens", type=positive_int, default=48)
    parser.add_argument("--no-prefix-caching", action="store_true")


def run(args: argparse.Namespace) -> int:
    from pagedrag import LLM, SamplingParams
    from pagedrag.models.loader import capped_max_model_len
    from pagedrag.rag.canonical import PromptCanonicalizer
    from pagedrag.rag.explain import explain

    llm = LLM(args.model, max_model_len=capped_max_model_len(args.model, args.max_model_len),
              enable_prefix_caching=not args.no_prefix_caching)
    canonical = PromptCanonicalizer(SYSTEM_PROMPT, tokenizer=llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(f"{'#':>2} {'cached/prompt':>13} {'hit rate':>8} {'TTFT ms':>8}  question -> answer")
    for number, (question, sources) in enumerate(QUERIES, 1):
        prompt = canonical.build(question, retrieved(sources), volatile={"user": f"user-{number}"})
        out = llm.generate({"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}, params,
                           use_tqdm=False)[0]
        answer = " ".join(out.outputs[0].text.split())
        print(f"{number:>2} {out.num_cached_tokens:>6}/{len(out.prompt_token_ids):<6} "
              f"{llm.stats()['prefix_cache_hit_rate']:>8.1%} {out.metrics.ttft * 1000:>8.1f}  "
              f"{question} -> {answer[:90]}")
    stats = llm.stats()
    print(f"\nprefix cache: {stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} prompt tokens "
          f"served from cache ({stats['prefix_cache_hit_rate']:.1%}); "
          f"{stats['num_gpu_blocks']} blocks of {stats['block_size']} tokens in the pool")
    question, sources = QUERIES[0]
    stamped = PromptCanonicalizer(f"Today is 2026-11-29 10:41:07. {SYSTEM_PROMPT}", tokenizer=llm.get_tokenizer())
    print("\nwhy a prompt with a timestamp in its system prompt misses the cache:")
    print(explain(stamped.build(question, retrieved(sources)).text,
                  canonical.build(question, retrieved(sources)).text, llm.get_tokenizer()))
    return 0
