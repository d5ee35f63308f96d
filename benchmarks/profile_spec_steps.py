"""Where a batch-1 step's host time goes on a GPU: an asynchronous decode step against a
synchronous verification step checking 1 + 8 drafted tokens, Llama-3-8B shape, random bf16
weights, in one run.

    python benchmarks/profile_spec_steps.py

The proposer is bench_spec_gpu's ReplayProposer with every draft accepted (random weights copy
nothing). Each engine phase is wrapped in a wall-clock timer; the medians over a 128-token
answer (the third of three) are printed. A phase that waits for the device (reading a step's
tokens) shows the device's time; the rest is host work, hidden behind the device in an
asynchronous step and not in a synchronous one.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import defaultdict

from bench_gpu import llama3_config, rag_prompts
from bench_spec_gpu import ReplayProposer, force_acceptance
from pagedrag import LLM, SamplingParams
from pagedrag.worker import model_runner

PHASES = {"scheduler": ("schedule", "_draft", "update_after_step"),
          "runner": ("execute", "sample"),
          "engine": ("_complete", "_complete_verified", "_output", "_observe", "_offer_to_tiers")}


def timed_phases(llm: LLM, times: defaultdict) -> None:
    """Wrap every phase of PHASES (and the verifier) so that each call adds its seconds to ``times``."""
    engine = llm.llm_engine
    owners = {"scheduler": engine.scheduler, "runner": engine.runner, "engine": engine}
    for owner, names in PHASES.items():
        for name in names:
            _wrap(owners[owner], name, name, times)
    _wrap(model_runner, "verify", "verify (waits for the device)", times)


def _wrap(owner, name: str, label: str, times: defaultdict) -> None:
    real = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            times[label].append(time.perf_counter() - start)

    setattr(owner, name, timed)


def main() -> None:
    prompt = rag_prompts()[0]
    with tempfile.TemporaryDirectory() as folder:
        llama3_config("8b").save_pretrained(folder)
        llm = LLM(folder, load_format="dummy", max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.85,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 8, "disable_by_batch_size": 64})
        engine = llm.llm_engine
        off = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, speculative_decoding=False)
        on = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        generate = lambda params: llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]  # noqa: E731
        generate(off)
        proposer = ReplayProposer({tuple(prompt): generate(off).outputs[0].token_ids})
        proposer.fixed_k = 8
        engine.drafter.proposer = proposer
        force_acceptance(proposer)
        generate(on)
        times: defaultdict = defaultdict(list)
        timed_phases(llm, times)
        spans = []
        real_step = engine.step

        def step():
            start = time.perf_counter()
            try:
                return real_step()
            finally:
                spans.append(time.perf_counter() - start)

        engine.step = step
        for name, params in (("asynchronous decode", off), ("synchronous verification, 1 + 8 tokens", on)):
            for _ in range(3):
                times.clear()
                spans.clear()
                generate(params)
            print(f"\n{name}: {len(spans)} steps, median {1000 * statistics.median(spans[2:]):.3f} ms a step")
            print("| phase | calls | median ms |\n|---|---|---|")
            for label, values in sorted(times.items()):
                print(f"| {label} | {len(values)} | {1000 * statistics.median(values):.3f} |")


if __name__ == "__main__":
    main()
