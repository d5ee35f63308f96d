"""Whether loading a block from a tier beats computing its tokens, from figures the engine measures.

Computing a block costs ``block_size`` x the prefill time of a token (measured on the engine's
own prefill steps); loading one costs the tier's measured seconds per block (its reads, timed
by the reader threads, forgotten after a minute so that a tier found slow is tried again).
Each figure is the median of its last measurements, so it follows the
machine's load and shrugs off outliers (a first step that compiles kernels or captures graphs). Until a tier has been measured it is assumed worth loading from: a first read
costs one block's time and measures it; until prefill has been measured, likewise.

Invariant: ``worth_loading`` compares only measured (or not yet measured, hence optimistic)
figures; nothing here is a constant tuned for one machine. On the H200 the local disk reads
slower than the 8B model computes, and this is what turns the disk tier away there.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque

_WINDOW = 32  # measurements each median is taken over
_MIN_PREFILL_TOKENS = 16  # steps with fewer computed tokens time mostly fixed costs
_FRESH_S = 60.0  # a load measured longer ago is forgotten: a tier found slow is tried again
_MIN_LOADS = 4  # fresh loads it takes to call a tier slower than computing while reads are queued


class TierCostModel:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._prefill: deque[float] = deque(maxlen=_WINDOW)  # seconds per prompt token
        self._loads: dict[str, deque[tuple[float, float]]] = {}  # (when, seconds per block), by tier
        self._lock = threading.Lock()  # reader threads report loads

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that computed ``num_tokens`` prompt tokens took ``seconds``."""
        if num_tokens >= _MIN_PREFILL_TOKENS and seconds > 0:
            self._prefill.append(seconds / num_tokens)

    def observe_load(self, tier: str, seconds: float) -> None:
        """One block read from ``tier`` took ``seconds``."""
        with self._lock:
            self._loads.setdefault(tier, deque(maxlen=_WINDOW)).append((time.monotonic(), seconds))

    @property
    def prefill_seconds_per_token(self) -> float | None:
        return statistics.median(self._prefill) if self._prefill else None

    def load_seconds_per_block(self, tier: str) -> float | None:
        samples = self._fresh_loads(tier)
        return statistics.median(samples) if samples else None

    def _fresh_loads(self, tier: str) -> list[float]:
        oldest = time.monotonic() - _FRESH_S
        with self._lock:
            return [seconds for when, seconds in self._loads.get(tier, ()) if when >= oldest]

    def worth_loading(self, tier: str) -> bool:
        """Whether a lookup should load from ``tier``: yes until fresh figures say it is slower
        than computing (so a slow tier is tried again once its figures are a minute old)."""
        load, prefill = self.load_seconds_per_block(tier), self.prefill_seconds_per_token
        if load is None or prefill is None:
            return True
        return load < self.block_size * prefill

    def measured_slower(self, tier: str) -> bool:
        """Whether at least ``_MIN_LOADS`` fresh loads say ``tier`` is slower than computing: what a
        read queued behind them checks, so one or two outliers do not turn the rest away."""
        return len(self._fresh_loads(tier)) >= _MIN_LOADS and not self.worth_loading(tier)

    def snapshot(self) -> dict[str, float | None]:
        return {"prefill_seconds_per_token": self.prefill_seconds_per_token,
                **{f"{tier}_load_seconds_per_block": self.load_seconds_per_block(tier) for tier in list(self._loads)}}
