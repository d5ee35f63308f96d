"""Chunk reuse's quality against full prefill, on real RAG prompts (the pydoc-topics stream).

    python benchmarks/bench_chunk_quality.py [--prompts 64] [--warmup 40] [--fractions 0.15 0.3]
                                             [--strategies deviation first] [--order stable]

The embedded SmolLM2-135M-Instruct (float32, CPU). Each arm is a fresh engine that first
runs ``--warmup`` stream prompts (so their chunks are cached), then the ``--prompts``
measured ones, one at a time, chunks in the retriever's order (their positions vary; with
``--order stable``, the canonicalizer's stable order, as in bench_chunk_cpu's stream):

- full prefill: exact prefix caching only (the reference);
- chunk reuse without recompute (the cached KV kept as is), and at each recompute fraction
  with each way of picking the recomputed tokens (pagedrag.worker.recompute_selection), or
  ``oracle``: the ideal of CacheBlend's selection, a bound for any way of picking tokens
  (measurement only: it costs a full prefill). It picks the tokens whose K/V, summed over
  every layer (each layer's squared change relative to its mean squared norm), differ most
  from full prefill's; the probe's exact K/V is then put back to the imported copy, so only
  the picked tokens are recomputed.

Per arm: the share of prompt tokens computed; over the measured prompts that reused a chunk,
first-token agreement with the reference, exact match of the first 32 greedy tokens (not with
``--kl-only``: first-token agreement then reads the teacher-forced pass's argmax), and the
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
from pagedrag.worker import model_runner, recompute_selection  # noqa: E402

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


def ideal_deviation(model, layers, input_ids, positions, meta, slots: torch.Tensor) -> list[float]:
    """The ``oracle`` arm's stand-in for recompute_selection.probe_deviation: every layer's K/V
    of the span computed exactly, each slot's change from the imported copy summed over the
    layers (relative to the layer's mean squared norm), the imported copy put back."""
    total = torch.zeros(slots.shape[0])
    imported = [[cache.view(-1, *cache.shape[2:])[slots].clone() for cache in layer] for layer in layers]
    model.forward_layers(input_ids, positions, layers, meta, len(layers))
    for layer, copies in zip(layers, imported):
        for cache, copy in zip(layer, copies):
            flat = cache.view(-1, *cache.shape[2:])
            total += (flat[slots] - copy).float().square().sum(dim=(1, 2)) / copy.float().square().sum(dim=(1, 2)).mean()
            flat[slots] = copy
    return total.tolist()


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


def reuse_run(prompts, warmup, reference, reference_probs, fraction: float, strategy: str,
              kl_only: bool) -> tuple:
    """(share computed, prompts reusing a chunk, first-token agreement, exact match or None, mean KL)."""
    oracle = strategy == "oracle"
    model_runner.probe_deviation = ideal_deviation if oracle else recompute_selection.probe_deviation
    arm = Arm(enable_chunk_reuse=True, chunk_recompute_fraction=fraction,
              chunk_recompute_strategy="deviation" if oracle else strategy)
    arm.warm(warmup)
    first, exact, divergence, reused = [], [], [], 0
    for segments, answer, reference_log_probs in zip(prompts, reference, reference_probs):
        log_probs, chunk_hits = arm.forced(segments, answer)
        if not chunk_hits:
            continue
        reused += 1
        if kl_only:
            first.append(int(log_probs[0].argmax()) == answer[0])
        else:
            tokens = arm.greedy(segments)
            first.append(tokens[0] == answer[0])
            exact.append(tokens == answer)
        divergence.append(kl(reference_log_probs, log_probs))
    return (arm.computed / arm.total, reused, statistics.mean(first),
            statistics.mean(exact) if exact else None, statistics.mean(divergence))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.15, 0.3])
    parser.add_argument("--strategies", nargs="+", default=["deviation", "first"],
                        choices=["deviation", "first", "oracle"])
    parser.add_argument("--kl-only", action="store_true",
                        help="skip the 32-token greedy answers (exact match); first-token agreement from the KL pass")
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
    print(f"{len(measured)} measured prompts after {len(warmup)} warm-up prompts (pydoc topics, MiniLM top-5, "
          f"chunks in {'retrieval' if args.order == 'relevance' else 'stable'} order)\n")
    print("| arm | prompt tokens computed | prompts reusing a chunk | first-token agreement | "
          f"exact {ANSWER_TOKENS} tokens | mean KL, first {KL_POSITIONS} positions | KL vs no recompute |")
    print("|---|---|---|---|---|---|---|")
    print(f"| full prefill (prefix caching) | | {len(measured)} | 100% | 100% | 0 | |", flush=True)
    arms = [(0.0, "first")] + [(fraction, strategy) for fraction in args.fractions for strategy in args.strategies]
    no_recompute_kl = None
    for fraction, strategy in arms:
        share, reused, first, exact, divergence = reuse_run(measured, warmup, reference, reference_probs,
                                                            fraction, strategy, args.kl_only)
        no_recompute_kl = no_recompute_kl or divergence
        name = f"chunk reuse, recompute {fraction:.0%} ({strategy})" if fraction else "chunk reuse, no recompute"
        exact_cell = "" if exact is None else f"{exact:.1%}"
        print(f"| {name} | {share:.1%} | {reused} | {first:.1%} | {exact_cell} | {divergence:.4f} | "
              f"{divergence / no_recompute_kl:.0%} |", flush=True)


if __name__ == "__main__":
    main()
