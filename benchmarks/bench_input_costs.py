"""What two input paths cost, beside their baselines in the same run.

    python benchmarks/bench_input_costs.py [--baseline-tree DIR]

1. Compiling a JSON schema with a length-bounded string (maxLength 100 to 5,000): pagedrag's
   grammar (xgrammar's EBNF with the bounded string's character narrowed,
   structured.compiler.json_grammar), against xgrammar compiling the schema itself (what
   pagedrag did before, admitting raw control characters), and against the same bound written
   as a "pattern" (a rewrite considered and dropped).
2. PromptCanonicalizer.build with 100 to 1,600 chunks on the embedded tokenizer; with
   ``--baseline-tree`` (a checkout of an older commit) the same in that tree's code, in a
   subprocess.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

BOUNDS = (100, 500, 1000, 2000, 5000)
CHUNK_COUNTS = (100, 400, 1600)


def compile_times() -> None:
    import xgrammar

    from pagedrag.models.loader import load_tokenizer
    from pagedrag.structured.compiler import json_grammar
    tokenizer = load_tokenizer(None)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    print("| maxLength | pagedrag (narrowed EBNF) | xgrammar's schema compile (before) | as a pattern |")
    print("|---|---|---|---|")
    for bound in BOUNDS:
        schema = json.dumps({"type": "object", "properties": {"a": {"type": "string", "maxLength": bound}},
                             "required": ["a"]})
        pattern = json.dumps({"type": "object", "properties": {"a": {
            "type": "string", "pattern": f'^[^\\x00-\\x1f"\\\\]{{0,{bound}}}$'}}, "required": ["a"]})
        arms = (lambda c: c.compile_grammar(json_grammar(schema, True)), lambda c: c.compile_json_schema(schema),
                lambda c: c.compile_json_schema(pattern))
        seconds = []
        for arm in arms:
            compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            started = time.perf_counter()
            arm(compiler)
            seconds.append(time.perf_counter() - started)
        print(f"| {bound} | " + " | ".join(f"{1e3 * s:.1f} ms" for s in seconds) + " |")


BUILD = """
import sys, time
sys.path.insert(0, {tree!r})
from pagedrag.models.loader import load_tokenizer
from pagedrag.rag.canonical import Chunk, PromptCanonicalizer
tokenizer = load_tokenizer(None)
canon = PromptCanonicalizer("You answer from the documents.", tokenizer=tokenizer)
for count in {counts!r}:
    chunks = [Chunk(f"Document {{i}} says that value {{i}} is {{i * 7}} units.", f"doc{{i}}") for i in range(count)]
    started = time.perf_counter()
    canon.build("Which value is largest?", chunks)
    print(count, time.perf_counter() - started)
"""


def build_times(tree: str) -> dict[int, float]:
    done = subprocess.run([sys.executable, "-c", BUILD.format(tree=tree, counts=CHUNK_COUNTS)],
                          capture_output=True, text=True, check=True)
    return {int(line.split()[0]): float(line.split()[1]) for line in done.stdout.splitlines()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", help="a checkout whose canonicalizer is the baseline")
    args = parser.parse_args()
    compile_times()
    from pathlib import Path
    ours = build_times(str(Path(__file__).resolve().parents[1]))
    base = build_times(args.baseline_tree) if args.baseline_tree else {}
    print("\n| chunks | this tree | baseline tree |\n|---|---|---|")
    for count in CHUNK_COUNTS:
        print(f"| {count} | {ours[count]:.2f} s | " + (f"{base[count]:.2f} s |" if base else "- |"))


if __name__ == "__main__":
    main()
