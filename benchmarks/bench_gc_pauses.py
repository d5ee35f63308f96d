"""Python's full garbage collections in an engine process, before and after the startup objects
are frozen (what `pagedrag serve` and the Ray replicas do: pagedrag.server.cli.freeze_startup_objects).

    python benchmarks/bench_gc_pauses.py [--requests 40]

The embedded model with a host KV tier (whose loads allocate a little per block) answers the
same 1,312-token prompt ``--requests`` times with the pool's prefix cache reset in between (so
every answer loads 81 blocks from host memory), first as the engine comes up, then after
freezing. Each full collection (generation 2) during the requests is timed through
``gc.callbacks``, and one forced ``gc.collect()`` is timed at the end of each phase. The step
loop stands still while a collection runs.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import time

from pagedrag import LLM, SamplingParams
from pagedrag.server.cli import freeze_startup_objects


class FullCollections:
    """The seconds of every generation-2 collection while ``recording``."""

    def __init__(self):
        self.seconds: list[float] = []
        self.recording = False
        self._start = 0.0
        gc.callbacks.append(self._observe)

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.recording and info["generation"] == 2:
            self.seconds.append(time.perf_counter() - self._start)


def phase(llm: LLM, prompt: list[int], requests: int, collections: FullCollections) -> tuple[list[float], float, float]:
    """(full collections' seconds, the slowest request's seconds, a forced collection's seconds)."""
    one = SamplingParams(max_tokens=1, temperature=0)
    collections.seconds, collections.recording, slowest = [], True, 0.0
    for _ in range(requests):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, one, use_tqdm=False)
        slowest = max(slowest, time.perf_counter() - start)
    collections.recording = False
    start = time.perf_counter()
    gc.collect()
    return collections.seconds, slowest, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    collections = FullCollections()
    llm = LLM(kv_offloading_size=1, max_model_len=2048)
    prompt = [random.Random(0).randrange(1000, 40000) for _ in range(1312)]
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    llm.llm_engine.flush_tiers()
    print(f"{platform.processor() or platform.machine()}, {args.requests} requests a phase\n")
    print("| phase | objects the collector tracks | full collections during the requests | their ms | slowest request | a forced full collection |")
    print("|---|---|---|---|---|---|")
    for name in ("as started", "after freeze_startup_objects()"):
        if name != "as started":
            freeze_startup_objects()
        tracked = len(gc.get_objects())
        pauses, slowest, forced = phase(llm, prompt, args.requests, collections)
        print(f"| {name} | {tracked:,} | {len(pauses)} | {', '.join(f'{s * 1000:.0f}' for s in pauses) or '-'} "
              f"| {slowest * 1000:.0f} ms | {forced * 1000:.1f} ms |")
    gc.unfreeze()


if __name__ == "__main__":
    main()
