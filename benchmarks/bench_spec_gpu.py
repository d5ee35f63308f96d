"""Speculative decoding on an NVIDIA GPU, Llama-3-8B shape, random bf16 weights, with and
without drafting in one run.

    python benchmarks/bench_spec_gpu.py [--tokens 128]

Random weights copy nothing, so no real proposer drafts anything they accept. This benchmark
installs a benchmark-only proposer (ReplayProposer) that drafts the greedy continuation
recorded without speculation in the same run, cut to an acceptance profile: each drafted
position is right with probability p (the first wrong one ends the draft), p chosen so that
the expected tokens a step match what the embedded model measured on CPU (issue 27: 3.02
drafting from prompt and output, 1.30 from the prompt alone). Random weights also leave
near-ties everywhere, which bf16 rounding resolves differently in a 9-row verification than
in a 1-row decode, so a recorded continuation stops matching after a few tokens. The timed
arms therefore force the verifier to accept exactly the tokens the proposer marked right (it
still runs, so its cost is paid); the engine's own greedy verification is run once, unforced,
to report bf16 agreement with decoding without speculation.

Figures:
- the cost of a step checking 1 + k tokens at batch 1 over the 1,312-token cached RAG
  prompt, every draft accepted, against a decode step (k = 0);
- batch-1 ms per output token with drafting at each profile against without;
- the 32-request RAG workload of bench_gpu.py with drafting at each profile (gate raised so
  all 32 draft, and at the default gate) against without, alternating for ROUNDS rounds,
  verified synchronously and pipelined;
- unforced greedy verification: tokens equal to decoding without speculation, and accepted.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile

import torch

from bench_gpu import llama3_config, rag_prompts, timed
from pagedrag import LLM, SamplingParams
from pagedrag.engine import pipelined_drafting
from pagedrag.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE
from pagedrag.worker import model_runner
from pagedrag.worker.pipelined_verification import DeviceDraftRows
from pagedrag.worker.sampler import Sample

PROFILES = {"prompt and output (3.02 tokens a step)": 0.68, "prompt only (1.30 tokens a step)": 0.23}
STEP_KS = (1, 2, 4, 8)
ROUNDS = 5  # of the 32-request workload, drafting and not alternating


def expected_tokens_per_step(p: float, k: int = 8) -> float:
    """1 + E[accepted] when each of k positions is right with probability p, in order."""
    return 1 + sum(p ** i for i in range(1, k + 1))


class ReplayProposer:
    """Benchmark only: drafts the recorded greedy continuation of each prompt, each position
    right with probability ``p`` (seeded) and the first wrong one ending the draft, or exactly
    ``fixed_k`` right tokens; ``planned`` holds how many of each request's draft are right."""

    def __init__(self, continuations: dict[tuple, list[int]], seed: int = 0):
        self.continuations = continuations
        self.rng = random.Random(seed)
        self.p: float = 1.0
        self.fixed_k: int | None = None
        self.planned: dict[str, int] = {}

    def propose(self, request, max_tokens: int) -> list[int]:
        truth = self.continuations.get(tuple(request.prompt_token_ids), [])
        produced = request.num_output_tokens
        truth = truth[produced:produced + max_tokens]
        if self.fixed_k is not None:
            right = min(self.fixed_k, len(truth))
            draft = truth[:right]
        else:
            right = 0
            while right < len(truth) and self.rng.random() < self.p:
                right += 1
            draft = truth[:right] + ([(truth[right] + 1) % 128000] if right < len(truth) else [])
        self.planned[request.request_id] = right
        return draft

    def finish(self, request) -> None:
        self.planned.pop(request.request_id, None)


class ReplayRows(DeviceDraftRows):
    """Benchmark only: pipelined drafting's device rows (worker.pipelined_verification) with
    ReplayProposer's drafts and forced acceptance, all on the device. A row drafts its recorded
    continuation, each position right with probability ``p`` (the first wrong one ends what is
    accepted) or exactly ``fixed_k`` right; its target tokens are the recorded ones, so the
    verification accepts exactly the right ones (the forward pass still runs: its cost is paid)."""

    recorded: dict[tuple, list[int]] = {}
    p: float = 1.0
    fixed_k: int | None = None

    def __init__(self, runner, token_ids: list[list[int]], capacity: int, *args, **kwargs):
        full = [self._recorded_sequence(tokens) for tokens in token_ids]
        self.full = torch.tensor([seq + [0] * (capacity - len(seq)) for seq in full], device=runner.device)
        super().__init__(runner, token_ids, capacity, *args, **kwargs)

    def _recorded_sequence(self, tokens: list[int]) -> list[int]:
        prompt = max((key for key in self.recorded if tuple(tokens[:len(key)]) == key), key=len)
        return list(prompt) + self.recorded[prompt]

    def _truth(self, span: int) -> torch.Tensor:
        columns = self.lengths.unsqueeze(1) + torch.arange(span, device=self.device).unsqueeze(0)
        return self.full.gather(1, columns.clamp(max=self.full.shape[1] - 1))

    def _draft(self, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        truth = self._truth(self.max_draft)
        rows = truth.shape[0]
        if self.fixed_k is not None:
            return truth, torch.full((rows,), self.fixed_k, device=self.device)
        right = (torch.rand(rows, self.max_draft, device=self.device) < self.p).long().cumprod(dim=1).sum(dim=1)
        wrong = torch.arange(self.max_draft, device=self.device).unsqueeze(0) == right.unsqueeze(1)
        return torch.where(wrong, (truth + 1) % 128000, truth), torch.full((rows,), self.max_draft, device=self.device)

    def _targets(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        span = logits.shape[0] // self.lengths.shape[0]
        return self._truth(span).flatten(), logits.new_zeros(logits.shape[0])


class PinnedLimits(dict):
    """Benchmark only: every request's draft limit reads ``k`` (the pipelined steps' width)."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def get(self, key, default=None):
        return self.k


def force_acceptance(proposer: ReplayProposer):
    """Benchmark only: after the engine's verification has run, each row emits the drafted
    tokens its proposer marked right and one token more; returns the function that undoes it."""
    real = model_runner.verify

    def verify(logits, rows, *args):
        results = real(logits, rows, *args)
        for result, row in zip(results, rows):
            right = proposer.planned.get(row.request.request_id, 0)
            after = row.draft[right] if right < len(row.draft) else result.samples[-1].token_id
            result.samples = [Sample(token, 0.0, 0, {}) for token in row.draft[:right] + [after]]
        return results

    model_runner.verify = verify
    return lambda: setattr(model_runner, "verify", real)


def profile_arm(engine, run) -> tuple[float, float]:
    """(ms a token, tokens a drafting step) of ``run()``, a batch-1 generation at a profile."""
    before = engine.drafter.stats.num_drafts, engine.drafter.stats.num_accepted_tokens
    ms, _, _ = run()
    drafts = engine.drafter.stats.num_drafts - before[0]
    accepted = engine.drafter.stats.num_accepted_tokens - before[1]
    return ms, 1 + accepted / max(drafts, 1)


def agreement(tokens: list[int], reference: list[int]) -> int:
    """How many tokens ``tokens`` shares with ``reference`` before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = rag_prompts()
    with tempfile.TemporaryDirectory() as folder:
        llama3_config("8b").save_pretrained(folder)
        llm = LLM(folder, load_format="dummy", max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.85,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 8, "disable_by_batch_size": 64})
        report(llm, prompts, args.tokens)


def report(llm: LLM, prompts: list[list[int]], tokens: int) -> None:
    engine = llm.llm_engine
    off = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, speculative_decoding=False)
    on = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    def generate(batch, params):
        return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)

    generate(prompts, off)  # warm up
    cached = prompts[0]
    recorded = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, generate(prompts, off))}
    in_the_batch = recorded[tuple(cached)]
    recorded[tuple(cached)] = generate([cached], off)[0].outputs[0].token_ids  # batch 1 rounds otherwise
    proposer = ReplayProposer(recorded)
    engine.drafter.proposer = proposer
    pipeline, engine.pipeline = engine.pipeline, None  # until pipelined_report: verified synchronously, drafted on the host

    def batch1(params, repeats=3) -> tuple[float, int, list[int]]:
        """Median ms per output token after the first, the steps after the first token (each
        emits one token plus its accepted drafts), and the tokens."""
        runs = []
        for _ in range(repeats):
            accepted_before = engine.drafter.stats.num_accepted_tokens
            out = generate([cached], params)[0]
            seconds = out.metrics.finished_time - out.metrics.first_token_time
            steps = tokens - 1 - (engine.drafter.stats.num_accepted_tokens - accepted_before)
            runs.append((seconds * 1000 / (tokens - 1), steps, out.outputs[0].token_ids))
        runs.sort(key=lambda run: run[0])
        return runs[len(runs) // 2]

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; Llama-3-8B shape, random bf16 weights; "
          f"batch 1 over a 1,312-token cached prompt, {tokens} tokens\n")
    base_ms, _, base_tokens = batch1(off)
    proposer.p = PROFILES["prompt and output (3.02 tokens a step)"]
    before = engine.drafter.stats.num_drafts, engine.drafter.stats.num_accepted_tokens
    unforced = generate([cached], on)[0].outputs[0].token_ids
    drafts = engine.drafter.stats.num_drafts - before[0]
    print(f"Unforced greedy verification (bf16): {agreement(unforced, base_tokens)} of {len(base_tokens)} tokens "
          f"equal to decoding without speculation before the first difference; "
          f"{engine.drafter.stats.num_accepted_tokens - before[1]} drafted tokens accepted in {drafts} drafting "
          f"steps. For scale, without speculation the same prompt decoded alone and in the batch of "
          f"{len(prompts)}: {agreement(in_the_batch, base_tokens)} tokens equal.\n")

    undo = force_acceptance(proposer)
    print("| drafted tokens k (all accepted) | ms a step | vs a decode step |\n|---|---|---|")
    print(f"| 0 (decode) | {base_ms:.2f} | 1.00x |")
    for k in STEP_KS:
        proposer.fixed_k = k
        ms, steps, _ = batch1(on)
        step_ms = ms * (tokens - 1) / steps
        print(f"| {k} | {step_ms:.2f} | {step_ms / base_ms:.2f}x |")
    proposer.fixed_k = None

    print("\n| profile (replayed, acceptance forced) | tokens a step, expected / measured | ms a token | vs without |"
          "\n|---|---|---|---|")
    print(f"| without drafting | 1 / 1 | {base_ms:.2f} | 1.00x |")
    for name, p in PROFILES.items():
        proposer.p = p
        ms, per_step = profile_arm(engine, lambda: batch1(on))
        print(f"| {name} | {expected_tokens_per_step(p):.2f} / {per_step:.2f} | {ms:.2f} | {base_ms / ms:.2f}x |")

    print(f"\n| 32-request RAG workload (acceptance forced) | output tok/s | vs without, median (range of "
          f"{ROUNDS} rounds) |\n|---|---|---|")
    workload = statistics.median(len(prompts) * tokens / timed(lambda: generate(prompts, off)) for _ in range(2))
    print(f"| without drafting | {workload:.0f} | 1.00x |")
    for name, p in PROFILES.items():
        proposer.p = p
        for gate in (64, DEFAULT_DISABLE_BY_BATCH_SIZE):
            engine.drafter.config = dataclasses.replace(engine.drafter.config, disable_by_batch_size=gate)
            print(f"| {name}, disable_by_batch_size={gate} | {interleaved(generate, prompts, on, off, tokens)} |")
    undo()
    engine.drafter.config = dataclasses.replace(engine.drafter.config, disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE)
    engine.pipeline = pipeline
    pipelined_report(llm, prompts, tokens, recorded, base_ms, base_tokens, generate, batch1)


def pipelined_report(llm, prompts, tokens, recorded, base_ms, base_tokens, generate, batch1) -> None:
    """The same figures with pipelined drafting (engine.pipelined_drafting): drafts and
    verification on the device, each step launched before the previous one is read."""
    engine = llm.llm_engine
    on = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    unforced = generate([prompts[0]], on)[0].outputs[0].token_ids
    print(f"\nPipelined drafting (device n-gram lookup on the random model's own output, unforced): "
          f"{agreement(unforced, base_tokens)} of {len(base_tokens)} tokens equal to decoding without speculation.\n")
    ReplayRows.recorded = recorded
    real_rows, pipelined_drafting.DeviceDraftRows = pipelined_drafting.DeviceDraftRows, ReplayRows
    real_limits = engine.drafter.limits
    print("| pipelined, drafted tokens k (all accepted) | ms a step | vs an asynchronous decode step |\n|---|---|---|")
    for k in STEP_KS:
        ReplayRows.fixed_k, engine.drafter.limits = k, PinnedLimits(k)
        ms, steps, _ = batch1(on)
        step_ms = ms * (tokens - 1) / steps
        print(f"| {k} | {step_ms:.2f} | {step_ms / base_ms:.2f}x |")
    ReplayRows.fixed_k, engine.drafter.limits = None, real_limits
    print("\n| pipelined, profile (replayed on the device, acceptance forced) | tokens a step | ms a token | "
          "vs without |\n|---|---|---|---|")
    for name, p in PROFILES.items():
        ReplayRows.p = p
        ms, per_step = profile_arm(engine, lambda: batch1(on))
        print(f"| {name} | {per_step:.2f} | {ms:.2f} | {base_ms / ms:.2f}x |")
    off = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, speculative_decoding=False)
    print(f"\n| pipelined, 32-request RAG workload (replayed, acceptance forced) | output tok/s | vs without, median "
          f"(range of {ROUNDS} rounds) |\n|---|---|---|")
    for name, p in PROFILES.items():
        ReplayRows.p = p
        for gate in (64, DEFAULT_DISABLE_BY_BATCH_SIZE):
            engine.drafter.config = dataclasses.replace(engine.drafter.config, disable_by_batch_size=gate)
            print(f"| {name}, disable_by_batch_size={gate} | {interleaved(generate, prompts, on, off, tokens)} |")
    engine.drafter.config = dataclasses.replace(engine.drafter.config, disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE)
    pipelined_drafting.DeviceDraftRows = real_rows


def interleaved(generate, prompts, on, off, tokens: int) -> str:
    """The workload with drafting (``on``) and without (``off``), alternating for ROUNDS rounds:
    "rate | median ratio (lowest-highest)", each round's ratio against the run just before it, so
    that drift (clocks, other tenants) hits both arms alike."""
    rates, ratios = [], []
    for _ in range(ROUNDS):
        without = len(prompts) * tokens / timed(lambda: generate(prompts, off))
        rates.append(len(prompts) * tokens / timed(lambda: generate(prompts, on)))
        ratios.append(rates[-1] / without)
    return (f"{statistics.median(rates):.0f} | {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
