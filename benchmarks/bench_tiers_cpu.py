"""KV tiers on CPU: a second process on the disk tier the first one filled, and a pool cut to a
quarter of the stream's working set with the disk tier under it.

    python benchmarks/bench_tiers_cpu.py [--questions 176] [--arms restart chunks quarter]

The embedded SmolLM2-135M-Instruct (float32) takes the 176-question pydoc-topics stream
(MiniLM top-5 chunks, the canonicalizer's stable order, the chat template) one prompt at a
time, one output token each, in a process of its own per arm, so that nothing but the disk
tier carries over:

1. restart, prefix caching: process A starts on an empty kv_disk_path and runs the stream;
   process B starts afterwards on the same directory and runs it again;
2. restart, chunk reuse on (enable_chunk_reuse): the same, on a directory of its own;
3. a small pool: num_gpu_blocks_override a quarter of the blocks arm 1's process A cached,
   without a tier and with an empty disk tier, against arm 1's process A (a pool holding all).

Prints, per process: prompt tokens computed, prefix (+ chunk) hit rate, tokens from the disk
tier, median and p90 TTFT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ARMS = ("restart", "chunks", "quarter")
ENGINE = {"max_model_len": 2048, "kv_cache_memory_bytes": 3 << 30}


def run_process(stream_file: str, engine: dict) -> dict:
    """One arm's process: the stream through an engine of ``engine`` arguments, figures as JSON."""
    command = [sys.executable, __file__, "--worker", stream_file, json.dumps(engine)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker(stream_file: str, engine: dict) -> None:
    from pagedrag import LLM, SamplingParams

    stream = json.loads(Path(stream_file).read_text())
    llm = LLM(**{**ENGINE, **engine})
    params = SamplingParams(temperature=0, max_tokens=1)
    ttfts, tier_tokens = [], 0
    for segments in stream:
        prompt = {"prompt_segments": segments} if engine.get("enable_chunk_reuse") else \
            {"prompt_token_ids": [token for segment in segments for token in segment["token_ids"]]}
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        ttfts.append(out.metrics.ttft)
        tier_tokens += sum(out.num_tier_hit_tokens.values())
    llm.llm_engine.flush_tiers()
    stats = llm.stats()
    total = stats["prompt_tokens_total"]
    print(json.dumps({"computed": stats["prompt_tokens_computed"] / total,
                      "hit_rate": (stats["prefix_cache_hits"] + stats["chunk_cache_hits"]) / total,
                      "tier_share": tier_tokens / total, "ttft_median": statistics.median(ttfts),
                      "ttft_p90": statistics.quantiles(ttfts, n=10)[-1], "cached_blocks": stats["num_cached_blocks"],
                      "evicted_blocks": stats["num_evicted_blocks"], "num_blocks": stats["num_gpu_blocks"]}))


def save_stream(path: Path, questions: int) -> None:
    """The stream's prompts as segments (head, chunks, question) with the chat template."""
    from rag_stream import SYSTEM_PROMPT, rag_stream

    from pagedrag.models.loader import load_tokenizer
    from pagedrag.rag.canonical import REUSABLE_CHUNK_TEMPLATE, PromptCanonicalizer

    canonicalizer = PromptCanonicalizer(SYSTEM_PROMPT, tokenizer=load_tokenizer(None),
                                        chunk_template=REUSABLE_CHUNK_TEMPLATE)
    prompts = [canonicalizer.build(question, [(c.source_id, c.text) for c in chunks]).segments
               for question, chunks in rag_stream()[:questions]]
    path.write_text(json.dumps(prompts))


def _row(name: str, figures: dict) -> str:
    return (f"| {name} | {figures['computed']:.1%} | {figures['hit_rate']:.1%} | {figures['tier_share']:.1%} | "
            f"{figures['ttft_median'] * 1e3:.0f} ms | {figures['ttft_p90'] * 1e3:.0f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=176)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="which arms to run (default: all)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], json.loads(args.worker[1]))
    work = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    stream_file = work / "stream.json"
    save_stream(stream_file, args.questions)
    rows = []
    restarts = [("prefix caching", {})] * ("restart" in args.arms or "quarter" in args.arms) \
        + [("chunk reuse", {"enable_chunk_reuse": True})] * ("chunks" in args.arms)
    for name, extra in restarts:
        disk = {"kv_disk_path": str(work / name.replace(" ", "-")), "kv_disk_size": 8}
        first = run_process(str(stream_file), {**disk, **extra})
        second = run_process(str(stream_file), {**disk, **extra})
        rows += [(f"{name}: process A, empty disk tier", first), (f"{name}: process B, after a restart", second)]
        print(f"{name}: median TTFT {first['ttft_median'] / second['ttft_median']:.1f}x lower after the restart",
              flush=True)
        if not extra:
            unbounded = first
    if "quarter" in args.arms:
        rows += quarter_pool(stream_file, work, unbounded)
    print(f"\n{args.questions} questions\n")
    print("| process | prompt tokens computed | hit rate | from the disk tier | median TTFT | p90 TTFT |")
    print("|---|---|---|---|---|---|")
    for name, figures in rows:
        print(_row(name, figures))


def quarter_pool(stream_file: Path, work: Path, unbounded: dict) -> list[tuple[str, dict]]:
    """Arm 3: a pool of a quarter of the blocks ``unbounded`` (arm 1's process A) cached, without
    a tier and with an empty disk tier; its table rows."""
    quarter = {"num_gpu_blocks_override": max(unbounded["cached_blocks"] // 4, 128), "kv_cache_memory_bytes": None}
    small = run_process(str(stream_file), quarter)
    small_disk = run_process(str(stream_file), {**quarter, "kv_disk_path": str(work / "quarter"), "kv_disk_size": 8})
    print(f"unbounded pool: {unbounded['cached_blocks']} blocks cached, {unbounded['evicted_blocks']} evicted; "
          f"small pool + disk tier: hit rate {small_disk['hit_rate'] / unbounded['hit_rate']:.0%} of the "
          f"unbounded pool's (no tier: {small['hit_rate'] / unbounded['hit_rate']:.0%})")
    return [(f"pool of {quarter['num_gpu_blocks_override']} blocks, no tier", small),
            (f"pool of {quarter['num_gpu_blocks_override']} blocks + disk tier", small_disk)]


if __name__ == "__main__":
    main()
