"""Whether loading a block from a tier beats computing its tokens, from figures the engine measures.

Computing a block costs ``block_size`` x the prefill time of a token (measured on the engine's
own prefill steps); loading one costs the tier's measured seconds per block (its reads, timed
by the reader threads). Each figure is an exponential moving average, so it follows the
machine's load. Until a tier has been measured it is assumed worth loading from: a first read
costs one block's time and measures it; until prefill has been measured, likewise.

Invariant: ``worth_loading`` compares only measured (or not yet measured, hence optimistic)
figures; nothing here is a constant tuned for one machine. On the H200 the local disk reads
slower than the 8B model computes, and this is what turns the disk tier away there.
"""

from __future__ import annotations

import threading

_SMOOTHING = 0.2  # weight of the newest measurement
_MIN_PREFILL_TOKENS = 16  # steps with fewer computed tokens time mostly fixed costs


class TierCostModel:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.prefill_seconds_per_token: float | None = None
        self.load_seconds_per_block: dict[str, float] = {}
        self._lock = threading.Lock()  # reader threads report loads

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that computed ``num_tokens`` prompt tokens took ``seconds``."""
        if num_tokens >= _MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_seconds_per_token = _average(self.prefill_seconds_per_token, seconds / num_tokens)

    def observe_load(self, tier: str, seconds: float) -> None:
        """One block read from ``tier`` took ``seconds``."""
        with self._lock:
            self.load_seconds_per_block[tier] = _average(self.load_seconds_per_block.get(tier), seconds)

    def worth_loading(self, tier: str) -> bool:
        load = self.load_seconds_per_block.get(tier)
        if load is None or self.prefill_seconds_per_token is None:
            return True
        return load < self.block_size * self.prefill_seconds_per_token

    def snapshot(self) -> dict[str, float | None]:
        return {"prefill_seconds_per_token": self.prefill_seconds_per_token,
                **{f"{tier}_load_seconds_per_block": value for tier, value in self.load_seconds_per_block.items()}}


def _average(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - _SMOOTHING) * previous + _SMOOTHING * value
