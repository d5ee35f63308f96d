"""Whether loading a block from a tier beats computing its tokens, from figures the engine measures.

Computing a block costs ``block_size`` x the prefill time of a token (measured on the engine's
own prefill steps); loading one costs the tier's measured seconds per block (its reads, timed
by the reader threads, forgotten after a minute so that a tier found slow is tried again).
Each figure is the median of its last measurements, so it follows the machine's load and
shrugs off outliers (a first step that compiles kernels or captures graphs).

Invariant: ``slower_tiers`` is the one rule, applied alike by a lookup (which blocks to load)
and by a queued read (whether to still read): a tier is turned away only once at least
``_MIN_LOADS`` fresh loads measure it slower than computing. Until then (and until prefill has
been measured) the model has no estimate of its own, no configured bandwidth, and trusts the
tier: its first reads cost a few blocks' time and measure it. Nothing here is a constant tuned
for one machine; on the H200 the local disk reads slower than the 8B model computes, and this
is what turns the disk tier away there.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque

_WINDOW = 32  # measurements each median is taken over
_MIN_PREFILL_TOKENS = 16  # steps with fewer computed tokens time mostly fixed costs
_FRESH_S = 60.0  # a load measured longer ago is forgotten: a tier found slow is tried again
_MIN_LOADS = 4  # fresh loads it takes to call a tier slower than computing


class TierCostModel:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._prefill: deque[float] = deque(maxlen=_WINDOW)  # seconds per prompt token
        self._loads: dict[str, deque[tuple[float, float]]] = {}  # (when, seconds per block), by tier
        self._lock = threading.Lock()  # the step loop reports prefill, reader threads loads and ask

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that computed ``num_tokens`` prompt tokens took ``seconds``."""
        if num_tokens >= _MIN_PREFILL_TOKENS and seconds > 0:
            with self._lock:
                self._prefill.append(seconds / num_tokens)

    def observe_load(self, tier: str, seconds: float) -> None:
        """One block read from ``tier`` took ``seconds``."""
        with self._lock:
            self._loads.setdefault(tier, deque(maxlen=_WINDOW)).append((time.monotonic(), seconds))

    def slower_tiers(self) -> frozenset[str]:
        """The tiers to turn away now: those whose fresh loads, ``_MIN_LOADS`` of them at least,
        take a median longer than computing the block's tokens. A caller takes it once per
        decision (a lookup, a read) and asks it about every block of that decision."""
        prefill, loads = self._figures()
        if prefill is None:
            return frozenset()
        compute = self.block_size * prefill
        return frozenset(tier for tier, fresh in loads.items()
                         if len(fresh) >= _MIN_LOADS and statistics.median(fresh) >= compute)

    def snapshot(self) -> dict[str, float | None]:
        prefill, loads = self._figures()
        return {"prefill_seconds_per_token": prefill,
                **{f"{tier}_load_seconds_per_block": statistics.median(fresh) if fresh else None
                   for tier, fresh in loads.items()}}

    def _figures(self) -> tuple[float | None, dict[str, list[float]]]:
        """One consistent reading: the median prefill seconds per token (None: not measured) and
        each tier's fresh loads (seconds per block, the last ``_FRESH_S`` seconds' only)."""
        oldest = time.monotonic() - _FRESH_S
        with self._lock:
            prefill = list(self._prefill)
            loads = {tier: [seconds for when, seconds in samples if when >= oldest]
                     for tier, samples in self._loads.items()}
        return (statistics.median(prefill) if prefill else None), loads
