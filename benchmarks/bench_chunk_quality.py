"""Chunk reuse's quality against full prefill, on real RAG prompts (the pydoc-topics stream).

    python benchmarks/bench_chunk_quality.py [--prompts 64] [--warmup 40] [--fractions 0.15 0.3]
                                             [--strategies deviation first] [--order stable]

The embedded SmolLM2-135M-Instruct (float32, CPU). Each arm is a fresh engine that first
runs ``--warmup`` stream prompts (so their chunks are cached), then the ``--prompts``
measured ones, one at a time, chunks in the retriever's order (their positions vary; with
``--order stable``, the canonicalizer's stable order, as in bench_chunk_cpu's stream):

- full prefill: exact prefix caching only (the reference);
- chunk reuse without recompute (the cached KV kept as is), and at each recompute fraction
  with each way of picking the recomputed tokens (pagedrag.worker.recompute_selection).

Per arm: the share of prompt tokens computed; over the measured prompts that reused a chunk,
first-token agreement with the reference, exact match of the first 32 greedy tokens, and the
mean KL divergence KL(reference || arm) of the next-token distribution over the first 16
answer positions, both fed the reference's answer (teacher forcing). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rag_stream import SYSTEM_PROMPT, rag_stream  # noqa: E402

from pagedrag import LLM, SamplingParams  # noqa: E402
from pagedrag.rag.canonical import REUSABLE_CHUNK_TEMPLATE, PromptCanonicalizer  # noqa: E402

ANSWER_TOKENS = 32
KL_POSITIONS = 16
ENGINE = {"max_model_len": 2048, "kv_cache_memory_bytes": 1 << 30}


class HiddenStates:
    """Keeps the hidden states of the model's latest forward pass (the engine runs one
    request at a time here, so they are that request's rows, run after run)."""

    def __init__(self, llm: LLM):
        self.model = llm.llm_engine.runner.model
        self.ops = llm.llm_engine.runner.ops
        self.last: torch.Tensor | None = None
        forward = self.model.forward

        def keep(*args, **kwargs):
            self.last = forward(*args, **kwargs)
            return self.last
        self.model.forward = keep

    def log_probs(self, rows: slice) -> torch.Tensor:
        return torch.log_softmax(self.model.compute_logits(self.last[rows], self.ops), dim=-1)


class Arm:
    """One engine over the stream. ``forced`` feeds a prompt and the first answer tokens
    (teacher forcing) and returns the next-token log-probs at the first KL_POSITIONS answer
    positions: the prompt is new to the engine, so its question and the answer are computed
    in the step's last run, whose rows end the hidden states."""

    def __init__(self, **engine):
        self.llm = LLM(**ENGINE, **engine)
        self.states = HiddenStates(self.llm)
        self.computed = self.total = 0  # prompt tokens of the forced passes, answers left out

    def warm(self, prompts: list[list[dict]]) -> None:
        for segments in prompts:
            self.llm.generate({"prompt_segments": segments}, SamplingParams(max_tokens=1), use_tqdm=False)

    def forced(self, segments: list[dict], answer: list[int]) -> tuple[torch.Tensor, int]:
        """(log-probs [KL_POSITIONS, vocab], the prompt's chunk-hit tokens)."""
        fed = segments + [{"token_ids": answer[:KL_POSITIONS], "reusable": False}]
        before = self.llm.stats()
        out = self.llm.generate({"prompt_segments": fed}, SamplingParams(temperature=0, max_tokens=1),
                                use_tqdm=False)[0]
        after = self.llm.stats()
        self.computed += after["prompt_tokens_computed"] - before["prompt_tokens_computed"] - KL_POSITIONS
        self.total += after["prompt_tokens_total"] - before["prompt_tokens_total"] - KL_POSITIONS
        return self.states.log_probs(slice(-KL_POSITIONS - 1, -1)), out.num_chunk_hit_tokens

    def greedy(self, segments: list[dict]) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
        return self.llm.generate({"prompt_segments": segments}, params, use_tqdm=False)[0].outputs[0].token_ids


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference || other), both log-probs [positions, vocab]."""
    return float((reference.exp() * (reference - other)).sum(-1).mean())


def reference_run(prompts: list[list[dict]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Full prefill: the greedy answers, then (on a fresh engine, so that the answers are not
    cached) the log-probs along them."""
    generator = Arm()
    answers = [generator.greedy(segments) for segments in prompts]
    del generator
    forced = Arm()
    return answers, [forced.forced(segments, answer)[0] for segments, answer in zip(prompts, answers)]


def reuse_run(prompts, warmup, reference, reference_probs, fraction: float, strategy: str) -> tuple:
    arm = Arm(enable_chunk_reuse=True, chunk_recompute_fraction=fraction, chunk_recompute_strategy=strategy)
    arm.warm(warmup)
    first, exact, divergence, reused = [], [], [], 0
    for segments, answer, reference_log_probs in zip(prompts, reference, reference_probs):
        log_probs, chunk_hits = arm.forced(segments, answer)
        if not chunk_hits:
            continue
        reused += 1
        tokens = arm.greedy(segments)
        first.append(tokens[0] == answer[0])
        exact.append(tokens == answer)
        divergence.append(kl(reference_log_probs, log_probs))
    return arm.computed / arm.total, reused, statistics.mean(first), statistics.mean(exact), statistics.mean(divergence)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.15, 0.3])
    parser.add_argument("--strategies", nargs="+", default=["deviation", "first"])
    parser.add_argument("--order", default="relevance", choices=["relevance", "stable"],
                        help="the canonicalizer's chunk order (stable: as bench_chunk_cpu's stream)")
    parser.add_argument("--isolated", action="store_true",
                        help="warm up with every chunk of the measured prompts alone after the head")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    stream = rag_stream()
    probe = LLM(**ENGINE)
    canonicalizer = PromptCanonicalizer(SYSTEM_PROMPT, order=args.order, tokenizer=probe.get_tokenizer(),
                                        chunk_template=REUSABLE_CHUNK_TEMPLATE)
    del probe
    built = [canonicalizer.build(question, [(c.source_id, c.text) for c in chunks]).segments
             for question, chunks in stream[:args.warmup + args.prompts]]
    warmup, measured = built[:args.warmup], built[args.warmup:]
    if args.isolated:
        chunks = {tuple(s["token_ids"]) for segments in measured for s in segments if s["reusable"]}
        head = measured[0][0]
        warmup = [[head, {"token_ids": list(chunk)}, {"token_ids": [198], "reusable": False}] for chunk in chunks]

    reference, reference_probs = reference_run(measured)
    rows = [("full prefill (prefix caching)", "", len(measured), 1.0, 1.0, 0.0)]
    arms = [(0.0, "first")] + [(fraction, strategy) for fraction in args.fractions for strategy in args.strategies]
    for fraction, strategy in arms:
        share, reused, first, exact, divergence = reuse_run(measured, warmup, reference, reference_probs,
                                                            fraction, strategy)
        name = f"chunk reuse, recompute {fraction:.0%} ({strategy})" if fraction else "chunk reuse, no recompute"
        rows.append((name, f"{share:.1%}", reused, first, exact, divergence))
    print(f"{len(measured)} measured prompts after {len(warmup)} warm-up prompts (pydoc topics, MiniLM top-5, "
          f"chunks in {'retrieval' if args.order == 'relevance' else 'stable'} order)\n")
    print("| arm | prompt tokens computed | prompts reusing a chunk | first-token agreement | "
          f"exact {ANSWER_TOKENS} tokens | mean KL, first {KL_POSITIONS} positions |")
    print("|---|---|---|---|---|---|")
    for name, computed, count, first, exact, kl in rows:
        print(f"| {name} | {computed} | {count} | {first:.1%} | {exact:.1%} | {kl:.4f} |")


if __name__ == "__main__":
    main()
