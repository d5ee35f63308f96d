"""How many CPU threads each size of step runs with, chosen by timing the steps themselves.

No one thread count is right everywhere. On a quiet 2-core machine a batch-1 decode step
runs ~1.3x faster on two threads than on one; with one core busy with other work, two
threads wait on each other at every operator and run 1.5-10x slower than one thread
(RESULTS.md, "CPU threads"). Which of those machines this is can change while the engine
runs, so the choice is measured, per step size, and measured again from time to time.

Invariants:
- Steps are grouped into buckets by their token count: one bucket per count below
  ``LARGE_STEP_TOKENS`` (a decode step's time hardly depends on its rows, so its time per
  token does), powers of two from there (prefill time grows with its tokens). Each bucket holds
  a current thread count; a step runs with it unless it is a probe. A bucket starts at one
  thread below ``LARGE_STEP_TOKENS`` tokens (where threads that share a core with other work
  hurt most: 5-6x slower steps) and at all threads from there.
- A probe runs up to ``PROBE_STEPS`` steps of the bucket at a neighbouring thread count. The
  neighbour becomes current when their median time per token beats the current count's recent
  median by ``SWITCH_MARGIN``; if it does not, the next probe waits twice as long. A probe step
  no faster than the current count ends the probe at once (one losing step, not three: a
  long step, such as a prefill, makes each one dear), and the next waits twice as long; one
  ``CLEAR_LOSS`` times slower waits ``LOSING_GROWTH`` times as long, or as many times longer as
  that step was slower (at most ``MAX_PROBE_INTERVAL`` steps): probes that keep losing cost
  about 1% of the steps once the engine has run a few hundred. A step at the current count ``SLOWDOWN`` times slower than its
  recent ones (another process took a core) brings the next probe close again.
- Only the step's model work is timed (forward pass, chunk exports, logits); CPU compute is
  synchronous, so that time is the step's work, including any wait for a core held by
  another process. The rest of the engine
  step (sampling) runs at the count its forward pass took; ``caller_threads_kept`` gives the
  calling thread its own count back once the engine step is over.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

FIRST_PROBE_AFTER = 2  # steps of a bucket before its first probe: a busy or quiet machine shows at once
LARGE_STEP_TOKENS = 64
LOSING_GROWTH = 4  # after a lost probe the next waits 4x longer: 2, 8, 32, ... steps
MAX_PROBE_INTERVAL = 1024
PROBE_STEPS = 3
SWITCH_MARGIN = 0.95  # a neighbour must be 5% faster to take over: noise must not flip the choice
CLEAR_LOSS = 1.25  # a probe step this much slower than the current count ends the probe at once
SLOWDOWN = 1.5  # a step this much slower than the recent ones: the machine changed, probe soon
RECENT_STEPS = 3


def thread_candidates(max_threads: int) -> list[int]:
    """1, the powers of two below ``max_threads``, and ``max_threads``."""
    candidates = {max_threads}
    power = 1
    while power < max_threads:
        candidates.add(power)
        power *= 2
    return sorted(candidates)


@dataclass
class _Bucket:
    current: int  # index into the candidates
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))  # s/token at current
    probe_interval: int = FIRST_PROBE_AFTER
    steps_until_probe: int = FIRST_PROBE_AFTER
    probing: int | None = None  # the candidate index under probe
    probe_times: list = field(default_factory=list)
    next_direction: int = -1  # which neighbour the next probe tries first


class ThreadTuner:
    """Per step size, the CPU thread count that measured fastest recently (see the module)."""

    def __init__(self, max_threads: int, clock=time.perf_counter):
        self.candidates = thread_candidates(max_threads)
        self._clock = clock
        self._buckets: dict[int, _Bucket] = {}

    def choice(self, num_tokens: int) -> int:
        """The thread count steps of ``num_tokens`` tokens run with now (outside probes)."""
        bucket = self._buckets.get(_bucket_of(num_tokens))
        return self.candidates[self._initial(num_tokens) if bucket is None else bucket.current]

    def _initial(self, num_tokens: int) -> int:
        return len(self.candidates) - 1 if num_tokens >= LARGE_STEP_TOKENS else 0

    @contextmanager
    def step(self, num_tokens: int):
        """Run the body (one step's model work) at this bucket's thread count or a probe's,
        and time it."""
        bucket = self._buckets.get(_bucket_of(num_tokens))
        if bucket is None:
            bucket = self._buckets[_bucket_of(num_tokens)] = _Bucket(self._initial(num_tokens))
        index = self._index_for_step(bucket)
        threads = self.candidates[index]
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        start = self._clock()
        yield threads
        self._record(bucket, index, (self._clock() - start) / max(num_tokens, 1))

    @staticmethod
    @contextmanager
    def caller_threads_kept():
        """Around an engine step: the calling thread's torch thread count is as it was after it."""
        threads = torch.get_num_threads()
        try:
            yield
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def _index_for_step(self, bucket: _Bucket) -> int:
        if bucket.probing is None and len(self.candidates) > 1:
            bucket.steps_until_probe -= 1
            if bucket.steps_until_probe <= 0 and bucket.recent:
                bucket.probing = self._neighbour(bucket)
                bucket.probe_times = []
        return bucket.current if bucket.probing is None else bucket.probing

    def _neighbour(self, bucket: _Bucket) -> int:
        for direction in (bucket.next_direction, -bucket.next_direction):
            index = bucket.current + direction
            if 0 <= index < len(self.candidates):
                bucket.next_direction = -direction  # alternate between the neighbours
                return index
        raise AssertionError("a tuner with several candidates always has a neighbour")

    def _record(self, bucket: _Bucket, index: int, seconds_per_token: float) -> None:
        if bucket.probing is None:
            if len(bucket.recent) == RECENT_STEPS and seconds_per_token > SLOWDOWN * statistics.median(bucket.recent):
                bucket.probe_interval = FIRST_PROBE_AFTER
                bucket.steps_until_probe = min(bucket.steps_until_probe, FIRST_PROBE_AFTER)
            bucket.recent.append(seconds_per_token)
            return
        current = max(statistics.median(bucket.recent), 1e-12)
        if seconds_per_token >= CLEAR_LOSS * current:  # clearly losing: stop now, wait longer next time
            growth = max(LOSING_GROWTH, round(seconds_per_token / current))
            bucket.probe_interval = min(growth * bucket.probe_interval, MAX_PROBE_INTERVAL)
        elif seconds_per_token >= current:  # no faster: stop now, wait twice as long
            bucket.probe_interval = min(2 * bucket.probe_interval, MAX_PROBE_INTERVAL)
        else:
            bucket.probe_times.append(seconds_per_token)
            if len(bucket.probe_times) < PROBE_STEPS:
                return
            if statistics.median(bucket.probe_times) < SWITCH_MARGIN * current:
                bucket.current, bucket.probe_interval = index, FIRST_PROBE_AFTER
                bucket.recent.clear()
                bucket.recent.extend(bucket.probe_times)
            else:
                bucket.probe_interval = min(2 * bucket.probe_interval, MAX_PROBE_INTERVAL)
        bucket.steps_until_probe, bucket.probing = bucket.probe_interval, None


def _bucket_of(num_tokens: int) -> int:
    num_tokens = max(num_tokens, 1)
    return num_tokens if num_tokens < LARGE_STEP_TOKENS else LARGE_STEP_TOKENS + num_tokens.bit_length()
