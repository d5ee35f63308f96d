"""CPU thread settings under contention: batch-1 decode of the embedded model with a
second process keeping one core busy, for each setting, each in a fresh process.

    python benchmarks/bench_threads.py [--tokens 48]

Settings: pagedrag's default (physical cores, passive OpenMP waiting), torch's own
default (a thread per logical CPU, threads spinning while they wait: OMP_WAIT_POLICY=
ACTIVE), and one thread. Prints a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time

SETTINGS = {
    "pagedrag default (physical cores, passive wait)": {"env": {}, "cpu_threads": None},
    "torch default (threads spin: OMP_WAIT_POLICY=ACTIVE)": {"env": {"OMP_WAIT_POLICY": "ACTIVE"},
                                                           "cpu_threads": os.cpu_count()},
    "one thread": {"env": {}, "cpu_threads": 1},
}
PROMPT = "Explain in one paragraph why the sky is blue."


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _decode_tokens_per_second(cpu_threads: int | None, tokens: int) -> dict:
    """Runs in the child process: the README's generate, timed after a warm-up."""
    from pagedrag import LLM, SamplingParams

    llm = LLM(cpu_threads=cpu_threads, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(PROMPT, params, use_tqdm=False)
    import torch
    return {"tok_s": tokens / (time.perf_counter() - start), "threads": torch.get_num_threads()}


def run_setting(setting: dict, tokens: int, busy: bool) -> dict:
    env = {**os.environ, **setting["env"]}
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import bench_threads as b; "
            f"print(json.dumps(b._decode_tokens_per_second({setting['cpu_threads']!r}, {tokens})))")
    burner = multiprocessing.Process(target=_burn, args=(600,), daemon=True) if busy else None
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
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    print("| setting | threads | tok/s, idle machine | tok/s, one core busy |")
    print("|---|---|---|---|")
    for name, setting in SETTINGS.items():
        idle = run_setting(setting, args.tokens, busy=False)
        busy = run_setting(setting, args.tokens, busy=True)
        print(f"| {name} | {idle['threads']} | {idle['tok_s']:.1f} | {busy['tok_s']:.1f} |")


if __name__ == "__main__":
    main()
