"""The periodic one-line stats log, as vLLM prints it (EngineArgs.disable_log_stats turns it off)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("pagedrag")
LOG_INTERVAL_S = 5.0


class StatsLog:
    """Logs throughput since the last line, the queues, KV usage and the prefix hit rate,
    at most every ``interval_s`` while the engine steps (an idle engine logs nothing)."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last_prompt = self._last_generated = 0

    def maybe_log(self, stats: dict) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return
        prompt, generated = stats["prompt_tokens"], stats["generation_tokens"]
        logger.info("prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d reqs, "
                    "waiting: %d reqs, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
                    (prompt - self._last_prompt) / elapsed, (generated - self._last_generated) / elapsed,
                    stats["num_requests_running"], stats["num_requests_waiting"],
                    100 * stats["kv_cache_usage_perc"], 100 * stats["prefix_cache_hit_rate"])
        if "spec_decode_num_drafts" in stats:
            logger.info("speculative decoding since start: mean acceptance length %.2f, accepted %d of %d "
                        "drafted tokens",
                        stats["spec_decode_mean_acceptance_length"], stats["spec_decode_num_accepted_tokens"],
                        stats["spec_decode_num_draft_tokens"])
        if "kv_tiers" in stats:
            logger.info("KV tiers: %s", _tiers_line(stats["kv_tiers"]))
        self._last_time, self._last_prompt, self._last_generated = now, prompt, generated


def _tiers_line(tiers: dict) -> str:
    """Each tier's use and the tokens it served, then the external hit rate."""
    parts = [f"{name} {_used_of(t['used_bytes'], t['capacity_bytes'])} "
             f"({tiers['hit_tokens'].get(name, 0)} tokens served{'' if t['enabled'] else ', off'})"
             for name, t in tiers["tiers"].items()]
    queries = tiers["external_prefix_cache_queries"]
    rate = tiers["external_prefix_cache_hits"] / queries if queries else 0.0
    return ", ".join(parts) + f", hit rate below the pool: {100 * rate:.1f}%"


def _used_of(used: int, capacity: int) -> str:
    """"0.52/4.00 GiB", in MiB where the capacity is under a GiB (a small tier read 0.00/0.00)."""
    unit, name = (1 << 30, "GiB") if capacity >= 1 << 30 else (1 << 20, "MiB")
    return f"{used / unit:.2f}/{capacity / unit:.2f} {name}"
