"""CPU thread settings, quiet and with one core busy: batch-1 decode, prefill and batched
decode of the embedded model, each setting in a fresh process, all in one run.

    python benchmarks/bench_threads.py [--tokens 64]

Settings: pagedrag's default (thread count per step size by measurement, short OpenMP spin),
the physical cores fixed (`cpu_threads`), one thread, the physical cores with passive
OpenMP waiting (the default before), and torch's threads spinning without end
(OMP_WAIT_POLICY=ACTIVE). Prints a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

from pagedrag.worker.cpu_threads import physical_cores_available

CORES = physical_cores_available()
SETTINGS = {
    "pagedrag default (tuned per step size, short spin)": {"env": {}, "cpu_threads": None},
    f"{CORES} threads fixed, short spin": {"env": {}, "cpu_threads": CORES},
    "one thread": {"env": {}, "cpu_threads": 1},
    f"{CORES} threads, passive wait (OMP_WAIT_POLICY=PASSIVE)": {"env": {"OMP_WAIT_POLICY": "PASSIVE"},
                                                              "cpu_threads": CORES},
    f"{CORES} threads spinning (OMP_WAIT_POLICY=ACTIVE)": {"env": {"OMP_WAIT_POLICY": "ACTIVE"},
                                                         "cpu_threads": CORES},
}
CONTEXT = ("Retrieved passage {i}: The tokenizer splits text into pieces that the model reads one "
           "by one; each piece gets an embedding, and attention mixes the pieces layer after layer. ")
QUESTION = "\nQuestion: what does attention mix? Answer:"
PREFILL_PROMPTS = 8  # each ~1,000 tokens, two to a step
WARMUP_PREFILLS = 24  # before them: the tuner's first probes of a step size fall here
BATCH = 8


def _workloads(cpu_threads: int | None, tokens: int) -> dict:
    """Runs in the child process: decode (median of 3), prefill and batched decode (median of
    3: on a busy machine one pass moves by +-15%), each after a warm-up."""
    from pagedrag import LLM, SamplingParams

    llm = LLM(cpu_threads=cpu_threads, max_model_len=2048)
    decode = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    one_token = SamplingParams(temperature=0, max_tokens=1)
    rag = "".join(CONTEXT.format(i=i) for i in range(7)) + QUESTION  # ~250 tokens

    def timed(prompts, params) -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    timed(rag, decode)
    result = {"decode_tok_s": statistics.median(tokens / timed(rag + " " * n, decode) for n in range(1, 4))}
    long_prompts = [f"Doc {n}. " + "".join(CONTEXT.format(i=i) for i in range(28))
                    for n in range(WARMUP_PREFILLS + PREFILL_PROMPTS)]
    timed(long_prompts[:WARMUP_PREFILLS], one_token)
    prefill_tokens = sum(len(llm.get_tokenizer().encode(p)) for p in long_prompts[WARMUP_PREFILLS:])
    result["prefill_tok_s"] = prefill_tokens / timed(long_prompts[WARMUP_PREFILLS:], one_token)
    batch = [f"{n}. " + rag for n in range(BATCH)]
    timed(batch, decode)
    result["batch_tok_s"] = statistics.median(BATCH * tokens / timed([p + " " * n for p in batch], decode)
                                              for n in range(1, 4))
    return result


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def run_setting(setting: dict, tokens: int, busy: bool) -> dict:
    env = {**os.environ, **setting["env"]}
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import bench_threads as b; "
            f"print(json.dumps(b._workloads({setting['cpu_threads']!r}, {tokens})))")
    burner = multiprocessing.Process(target=_burn, args=(900,), daemon=True) if busy else None
    if burner:
        burner.start()
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    finally:
        if burner:
            burner.terminate()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    rows = {name: {busy: run_setting(setting, args.tokens, busy) for busy in (False, True)}
            for name, setting in SETTINGS.items()}
    print(f"| setting | decode tok/s quiet / busy | prefill tok/s quiet / busy | {BATCH} concurrent tok/s quiet / busy |")
    print("|---|---|---|---|")
    for name, by_busy in rows.items():
        cells = [f"{by_busy[False][key]:.1f} / {by_busy[True][key]:.1f}"
                 for key in ("decode_tok_s", "prefill_tok_s", "batch_tok_s")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for key in ("decode_tok_s", "prefill_tok_s", "batch_tok_s"):
        for busy in (False, True):
            best = max(by_busy[busy][key] for by_busy in rows.values())
            default = next(iter(rows.values()))[busy][key]
            print(f"default / best, {key}, {'busy' if busy else 'quiet'}: {default / best:.2f}")


if __name__ == "__main__":
    main()
