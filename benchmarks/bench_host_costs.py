"""Host-side costs of one request that land on every step of the batch, this tree beside another.

    python benchmarks/bench_host_costs.py --baseline-tree DIR [--rounds 2]

DIR is a checkout of another commit (``git worktree add DIR REV``). Each round runs one process
per tree, trees alternating; every process builds tiny random Llama models (tests/model_fixtures,
one thread, so that the engine's own work shows, not the model's) and times, in ms a step or a
token, medians over rounds:

1. 64 stop strings of 1,024 characters that never match (SamplingParams' limits), 1,000 tokens;
2. a logit_bias / allowed_token_ids of 131,072 entries (a 131,072-token vocabulary);
3. repetition_penalty over a 16,000-token prompt (decode after it, the prompt cached);
4. four requests decoding together at block_size 1 and 16 (their blocks interleave), 1,024 tokens.
Each beside the same run without the setting. Prints a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ONE_PROCESS = """
import json, sys, time
sys.path.insert(0, {tree!r})
sys.path.insert(0, {tests!r})
from model_fixtures import make_tiny_model
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from pagedrag import LLM, SamplingParams

folder = {folder!r}
figures = {{}}

def step_ms(llm, prompt, tokens, **params):
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, **params),
                       use_tqdm=False)[0]
    return 1e3 * (out.metrics.finished_time - out.metrics.first_token_time) / (tokens - 1)

long = LLM(str(make_tiny_model(folder, "llama", max_position_embeddings=20000)), max_model_len=20000,
           kv_cache_memory_bytes=1 << 30, cpu_threads=1)
short = {{"prompt_token_ids": [5, 6, 7, 8]}}
stops = ["".join(chr(0x4e00 + (i * 31 + j) % 2000) for j in range(1024)) for i in range(64)]
figures["plain, 1,000 tokens"] = step_ms(long, short, 1000)
figures["64 stop strings of 1,024 characters"] = step_ms(long, short, 1000, stop=stops)
prompt = {{"prompt_token_ids": [3 + (i * 7) % 250 for i in range(16000)]}}
long.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
figures["plain, 16k-token prompt"] = step_ms(long, prompt, 64)
figures["repetition_penalty, 16k-token prompt"] = step_ms(long, prompt, 64, repetition_penalty=1.1)
del long

base = make_tiny_model(folder, "llama")  # its tokenizer, over a model of a 131,072-token vocabulary
config = LlamaConfig.from_pretrained(base)
config.vocab_size = 131072
LlamaForCausalLM(config).save_pretrained(folder + "/bigvocab")
AutoTokenizer.from_pretrained(base).save_pretrained(folder + "/bigvocab")
big = LLM(folder + "/bigvocab", max_model_len=512, kv_cache_memory_bytes=1 << 30, cpu_threads=1)
figures["plain, 131k vocabulary"] = step_ms(big, short, 100)
figures["logit_bias of 131,072 entries"] = step_ms(big, short, 100, logit_bias={{i: -0.01 for i in range(131072)}})
figures["allowed_token_ids of 131,072"] = step_ms(big, short, 100, allowed_token_ids=list(range(131072)))
del big

path = str(make_tiny_model(folder, "llama", max_position_embeddings=4096))
for block_size in (16, 1):
    llm = LLM(path, max_model_len=2048, kv_cache_memory_bytes=1 << 30, block_size=block_size, cpu_threads=1)
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(None, {{"prompt_token_ids": [5 + i, 6, 7]}},
                           SamplingParams(temperature=0, max_tokens=1030, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    figures[f"4 requests together at 1,024 tokens, block_size {{block_size}}"] = 1e3 * sorted(steps[1004:1024])[10]
print(json.dumps(figures))
"""


def figures_of(tree: Path, folder: str) -> dict[str, float]:
    """One process of ``tree``'s code: ms a token (or a step) by setting."""
    code = ONE_PROCESS.format(tree=str(tree), tests=str(ROOT / "tests"), folder=folder)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the run of {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    trees = {"baseline": args.baseline_tree.resolve(), "this tree": ROOT}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(figures_of(tree, folder))
    print("| setting | baseline ms | this tree ms |")
    print("|---|---|---|")
    for setting in runs["this tree"][0]:
        base, new = (statistics.median(run[setting] for run in runs[name]) for name in trees)
        print(f"| {setting} | {base:.2f} | {new:.2f} |")


if __name__ == "__main__":
    main()
