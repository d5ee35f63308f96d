"""KV tiers on CPU: a second process on the disk tier the first one filled, and a pool cut to a
quarter of the stream's working set with the disk tier under it.

    python benchmarks/bench_tiers_cpu.py [--questions 176] [--arms restart chunks quarter aware]
                                         [--corpus pydoc|stdlib] [--seed 0]

The embedded SmolLM2-135M-Instruct (float32) takes the 176-question pydoc-topics stream
(MiniLM top-5 chunks, the canonicalizer's stable order, the chat template) one prompt at a
time, one output token each, in a process of its own per arm, so that nothing but the disk
tier carries over:

1. restart, prefix caching: process A starts on an empty kv_disk_path and runs the stream;
   process B starts afterwards on the same directory and runs it again;
2. restart, chunk reuse on (enable_chunk_reuse): the same, on a directory of its own;
3. a small pool: num_gpu_blocks_override a quarter of the blocks arm 1's process A cached,
   without a tier and with an empty disk tier, against arm 1's process A (a pool holding all);
4. restart, the canonicalizer's cache-aware order (each prompt built in the process, its chunks
   ordered by what the engine holds): process A takes the stream's first half, then process B
   its second half (new questions over the same documents) twice, once with the engine's cache
   probes as they are (they count the disk tier's blocks) and once probing the pool only (as
   before session 43: the baseline). A replay of A's own questions would not tell them apart:
   probing the pool only, B would make A's choices again, one by one.

Prints, per process: prompt tokens computed, prefix (+ chunk) hit rate, tokens from the disk
tier, median and p90 TTFT.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ARMS = ("restart", "chunks", "quarter", "aware")
ENGINE = {"max_model_len": 2048, "kv_cache_memory_bytes": 3 << 30}


def run_process(stream_file: str, engine: dict) -> dict:
    """One arm's process: the stream through an engine of ``engine`` arguments, figures as JSON."""
    command = [sys.executable, __file__, "--worker", stream_file, json.dumps(engine)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker(stream_file: str, engine: dict) -> None:
    from pagedrag import LLM, SamplingParams

    stream = json.loads(Path(stream_file).read_text())
    probes = engine.pop("probes", None)  # the cache-aware arm: "tiers" or "pool" (the baseline)
    llm = LLM(**{**ENGINE, **engine})
    params = SamplingParams(temperature=0, max_tokens=1)
    prompts = map(cache_aware_prompts(llm, probes), stream) if probes else stream
    ttfts, tier_tokens = [], 0
    for segments in prompts:
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


def cache_aware_prompts(llm, probes: str):
    """(question, chunks) -> the prompt's segments, in the cache-aware order of the engine's
    cache probes (``probes`` "pool": the pool's blocks only, the probes before session 43)."""
    from rag_stream import SYSTEM_PROMPT

    from pagedrag.rag.canonical import PromptCanonicalizer

    engine = llm.llm_engine
    if probes == "pool":
        engine.cached_prefix_len = lambda ids, cache_salt=None: engine.cached_prefix(ids, cache_salt)["pool"]
    canonicalizer = PromptCanonicalizer(SYSTEM_PROMPT, order="cache_aware", tokenizer=llm.get_tokenizer(),
                                        engine=engine)
    return lambda item: canonicalizer.build(item[0], [tuple(chunk) for chunk in item[1]]).segments


def save_stream(path: Path, questions: int, texts: Path, corpus: str = "pydoc", seed: int = 0) -> None:
    """The stream's prompts as segments (head, chunks, question) with the chat template; and at
    ``texts`` (.a.json, .b.json: its first and second half) its questions with their chunks'
    (source id, text), for the cache-aware arm."""
    from rag_stream import SYSTEM_PROMPT, rag_stream

    from pagedrag.models.loader import load_tokenizer
    from pagedrag.rag.canonical import REUSABLE_CHUNK_TEMPLATE, PromptCanonicalizer

    canonicalizer = PromptCanonicalizer(SYSTEM_PROMPT, tokenizer=load_tokenizer(None),
                                        chunk_template=REUSABLE_CHUNK_TEMPLATE)
    stream = [(question, [(c.source_id, c.text) for c in chunks])
              for question, chunks in rag_stream(seed, corpus=corpus)[:questions]]
    path.write_text(json.dumps([canonicalizer.build(question, chunks).segments for question, chunks in stream]))
    halves = texts.with_suffix(".a.json"), texts.with_suffix(".b.json")
    for half, part in zip(halves, (stream[:len(stream) // 2], stream[len(stream) // 2:])):
        half.write_text(json.dumps(part))


def _row(name: str, figures: dict) -> str:
    return (f"| {name} | {figures['computed']:.1%} | {figures['hit_rate']:.1%} | {figures['tier_share']:.1%} | "
            f"{figures['ttft_median'] * 1e3:.0f} ms | {figures['ttft_p90'] * 1e3:.0f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=176)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="which arms to run (default: all)")
    parser.add_argument("--corpus", choices=("pydoc", "stdlib"), default="pydoc",
                        help="the stream's documents (rag_stream.py; default: pydoc, the 176-question stream)")
    parser.add_argument("--seed", type=int, default=0, help="the stream's question order (default: 0)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], json.loads(args.worker[1]))
    work = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    stream_file, texts_file = work / "stream.json", work / "texts.json"
    save_stream(stream_file, args.questions, texts_file, args.corpus, args.seed)
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
    if "aware" in args.arms:
        rows += cache_aware_restart(texts_file, work)
    print(f"\n{args.questions} questions, {args.corpus} corpus, seed {args.seed}\n")
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


def cache_aware_restart(texts_file: Path, work: Path) -> list[tuple[str, dict]]:
    """Arm 4: process A in cache-aware order on an empty disk tier, then B on what it left, its
    cache probes counting the tier's blocks and (the baseline) the pool's only; its table rows."""
    left = work / "cache-aware"
    first = run_process(str(texts_file.with_suffix(".a.json")),
                        {"kv_disk_path": str(left), "kv_disk_size": 8, "probes": "tiers"})
    rows = [("cache-aware order: process A, first half, empty disk tier", first)]
    for probes, name in (("pool", "probing the pool only (before)"), ("tiers", "probing pool and tiers (now)")):
        disk = shutil.copytree(left, work / f"cache-aware-{probes}")  # each B finds what A left, only that
        second = run_process(str(texts_file.with_suffix(".b.json")),
                             {"kv_disk_path": str(disk), "kv_disk_size": 8, "probes": probes})
        rows.append((f"cache-aware order: process B, second half, {name}", second))
    return rows


if __name__ == "__main__":
    main()
