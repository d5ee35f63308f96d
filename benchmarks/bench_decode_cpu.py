"""Batch-1 decode speed of the embedded model on CPU by prompt length, this tree beside another.

    python benchmarks/bench_decode_cpu.py --baseline-tree DIR [--lengths 250 800 1600 2200]
                                          [--max-tokens 64] [--rounds 2] [--quantization none gguf]
                                          [--prefix-hit]

DIR is a checkout of another commit (``git worktree add DIR REV``). Each round runs one process
per tree and weight format, trees alternating, so drift hits both alike; every process answers
one prompt of each length greedily (``ignore_eos``), after a warm-up, with the default threads.
Decode speed is a request's output tokens after the first over the time from its first token to
its end. Prints a markdown table of the medians over rounds, for benchmarks/RESULTS.md.

With ``--prefix-hit`` each prompt first goes in once with another last word (one token answered),
so that the measured one hits the prefix cache, as a RAG request does on its shared system prompt
and chunks: its context is then two runs of blocks (the hit's, then its own), which the CPU
attention gathers where one run is read in place.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ONE_PROCESS = """
import json, sys
sys.path.insert(0, {tree!r})
from pagedrag import LLM, SamplingParams
text = open({text!r}).read().split()
llm = LLM(quantization={quantization!r}, max_model_len=4096)
tokenizer = llm.get_tokenizer()
params = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)
llm.generate("Warm up: " + " ".join(text[:200]), params, use_tqdm=False)
speeds = {{}}
for length in {lengths!r}:
    words = text[:length]
    while len(tokenizer.encode(" ".join(words))) > length:
        words = words[:-10]
    if {prefix_hit!r}:
        llm.generate(f"{{length}}: " + " ".join(words[:-1] + ["Other."]), SamplingParams(max_tokens=1), use_tqdm=False)
    metrics = llm.generate(f"{{length}}: " + " ".join(words), params, use_tqdm=False)[0].metrics
    speeds[length] = ({max_tokens} - 1) / (metrics.finished_time - metrics.first_token_time)
print(json.dumps(speeds))
"""


def decode_speeds(tree: Path, quantization: str | None, lengths: list[int], max_tokens: int,
                  prefix_hit: bool) -> dict[int, float]:
    """One process of ``tree``'s code: decode tokens/s by prompt length (in tokens)."""
    code = ONE_PROCESS.format(tree=str(tree), text=str(ROOT / "README.md"), quantization=quantization,
                              lengths=lengths, max_tokens=max_tokens, prefix_hit=prefix_hit)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {int(length): speed for length, speed in json.loads(done.stdout.splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[250, 800, 1600, 2200])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quantization", nargs="+", default=["none", "gguf"])
    parser.add_argument("--prefix-hit", action="store_true", help="the measured prompts hit the prefix cache")
    args = parser.parse_args()
    trees = {"baseline": args.baseline_tree.resolve(), "this tree": ROOT}
    runs = {(name, q): [] for name in trees for q in args.quantization}
    for _ in range(args.rounds):
        for quantization in args.quantization:
            for name, tree in trees.items():
                runs[name, quantization].append(decode_speeds(tree, quantization, args.lengths, args.max_tokens,
                                                             args.prefix_hit))
    print("| weights | prompt tokens | baseline decode tok/s | this tree | ratio |")
    print("|---|---|---|---|---|")
    for quantization in args.quantization:
        for length in args.lengths:
            base, new = (statistics.median(run[length] for run in runs[name, quantization]) for name in trees)
            print(f"| {quantization} | {length} | {base:.1f} | {new:.1f} | {new / base:.2f}x |")


if __name__ == "__main__":
    main()
