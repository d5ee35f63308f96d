"""Engine metrics: Prometheus series with vLLM's names on a registry of the engine's own.

The prefix is ``pagedrag:`` or, for dashboards built for vLLM (its Grafana dashboard
queries these names), ``vllm:`` (EngineArgs.metrics_prefix). Every series carries a
model_name label, as vLLM's do.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedrag.core.request import RequestStatus
from pagedrag.outputs import RequestMetrics, SpecDecodeCounts

METRICS_PREFIXES = ("pagedrag", "vllm")
FINISHED_REASONS = tuple(status.value for status in RequestStatus if status.finished)  # stop, length, abort
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Prompt tokens, counted on each request's first scheduling:
# prefix_cache_queries = prefix_cache_hits + chunk_cache_hits + prompt_tokens_computed.
CACHE_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens served from the prefix cache.",
    "chunk_cache_hits": "Prompt tokens whose KV came from the chunk cache (chunk reuse) and was kept.",
    "chunk_tokens_recomputed": "Tokens of reused chunks computed again with the full context.",
    "prompt_tokens_computed": "Prompt tokens the model computed: fresh plus recomputed.",
}


class EngineMetrics:
    """Every series the engine exports; the engine updates them as it steps."""

    def __init__(self, model_name: str, prefix: str = "pagedrag"):
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
        self.registry = CollectorRegistry()
        self._prefix = prefix
        self._model = model_name
        self.kv_cache_usage = self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.gpu_cache_usage = self._gauge("gpu_cache_usage_perc", "Fraction of KV blocks in use (0-1); seed name.")
        self.running = self._gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = self._gauge("num_requests_swapped", "Requests swapped out to CPU memory.")
        self.preemptions = self._counter("num_preemptions", "Preemptions of running requests.")
        self._cache_counters = {name: self._counter(name, doc) for name, doc in CACHE_COUNTERS.items()}
        self._reported = dict.fromkeys(CACHE_COUNTERS, 0)
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of requests admitted.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between two output tokens.", _LATENCY_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds", "Mean time per output token after the "
                                    "first, per request.", _LATENCY_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds", "Arrival to first scheduling.",
                                          _REQUEST_BUCKETS)
        self.prefill_time = self._histogram("request_prefill_time_seconds", "First scheduling to first token.",
                                            _REQUEST_BUCKETS)
        self.decode_time = self._histogram("request_decode_time_seconds", "First token to finish.",
                                           _REQUEST_BUCKETS)
        self.num_prompt_tokens = self.num_generation_tokens = 0  # totals, for stats()
        self._tiers = TierMetrics(self.registry, prefix, model_name)
        self._spec = SpecDecodeMetrics(self.registry, prefix, model_name)
        self._success = Counter(f"{prefix}:request_success", "Requests finished, by finished_reason "
                                "(stop, length, or abort: a client gone, a cancel, a failed request).",
                                ["model_name", "finished_reason"], registry=self.registry)
        for reason in FINISHED_REASONS:  # each series from the start, at 0 (as vLLM's)
            self._success.labels(model_name=model_name, finished_reason=reason)

    def observe_queues(self, kv_usage: float, running: int, waiting: int, swapped: int) -> None:
        """Gauges of the pool and the queues (after every step and every abort)."""
        self.kv_cache_usage.set(kv_usage)
        self.gpu_cache_usage.set(kv_usage)
        self.running.set(running)
        self.waiting.set(waiting)
        self.swapped.set(swapped)

    def observe_cache(self, totals: dict[str, int]) -> None:
        """Advance the cache counters (CACHE_COUNTERS) to the engine's running totals."""
        for name, total in totals.items():
            self._cache_counters[name].inc(total - self._reported[name])
            self._reported[name] = total

    def observe_tiers(self, snapshot: dict) -> None:
        """The KV tiers' figures (kv_tiers.KVTiers.snapshot), after every step."""
        self._tiers.observe(snapshot)

    def observe_spec_decode(self, counts: SpecDecodeCounts) -> None:
        """Speculative decoding's running totals (spec_decode.drafter), after every step."""
        self._spec.observe(counts)

    def observe_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)
        self.num_prompt_tokens += num_tokens

    def observe_token(self, ttft: float | None, since_previous: float | None) -> None:
        """One generated token: its TTFT if it is a sequence's first, else the gap to the previous."""
        if ttft is not None:
            self.ttft.observe(ttft)
        if since_previous is not None:
            self.itl.observe(since_previous)
        self.generation_tokens.inc()
        self.num_generation_tokens += 1

    def request_finished(self, reason: str, times: RequestMetrics, num_output_tokens: int) -> None:
        """Count a finished sequence and observe its latencies (times that are unknown, as for
        a request aborted before it ran, are skipped)."""
        self._success.labels(model_name=self._model, finished_reason=reason).inc()
        spans = [(self.e2e, times.arrival_time, times.finished_time),
                 (self.queue_time, times.arrival_time, times.first_scheduled_time),
                 (self.prefill_time, times.first_scheduled_time, times.first_token_time),
                 (self.decode_time, times.first_token_time, times.finished_time)]
        for histogram, start, end in spans:
            if start is not None and end is not None:
                histogram.observe(end - start)
        if num_output_tokens > 1 and times.first_token_time is not None and times.finished_time is not None:
            self.tpot.observe((times.finished_time - times.first_token_time) / (num_output_tokens - 1))

    def _gauge(self, name: str, doc: str):
        return Gauge(f"{self._prefix}:{name}", doc, ["model_name"], registry=self.registry).labels(self._model)

    def _counter(self, name: str, doc: str):
        return Counter(f"{self._prefix}:{name}", doc, ["model_name"], registry=self.registry).labels(self._model)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]):
        return Histogram(f"{self._prefix}:{name}", doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self._model)


class SpecDecodeMetrics:
    """Speculative decoding's counters, with vLLM's names: spec_decode_num_drafts,
    _num_draft_tokens, _num_accepted_tokens, and _num_accepted_tokens_per_pos by position."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str):
        def counter(name, doc, labels=()):
            return Counter(f"{prefix}:spec_decode_{name}", doc, ["model_name", *labels], registry=registry)

        self._model = model_name
        self._totals = {"num_drafts": counter("num_drafts", "Verification steps that carried a draft."),
                        "num_draft_tokens": counter("num_draft_tokens", "Tokens drafted."),
                        "num_accepted_tokens": counter("num_accepted_tokens", "Drafted tokens accepted.")}
        self._per_pos = counter("num_accepted_tokens_per_pos", "Drafted tokens accepted, by position in the draft.",
                                ["position"])
        self._reported = SpecDecodeCounts()

    def observe(self, counts: SpecDecodeCounts) -> None:
        for name, series in self._totals.items():
            series.labels(model_name=self._model).inc(getattr(counts, name) - getattr(self._reported, name))
        reported = self._reported.num_accepted_tokens_per_pos
        for position, total in enumerate(counts.num_accepted_tokens_per_pos):
            before = reported[position] if position < len(reported) else 0
            self._per_pos.labels(model_name=self._model, position=str(position)).inc(total - before)
        self._reported = SpecDecodeCounts(counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens,
                                          list(counts.num_accepted_tokens_per_pos))


class TierMetrics:
    """The KV tiers' series, with vLLM's names where it has them: kv_offload_total_bytes and
    kv_offload_total_time by transfer_type, external_prefix_cache_queries / _hits (tokens
    looked up below the pool, and found there); then pagedrag's: tokens served by each tier,
    each tier's use and capacity in bytes, and the files it dropped as corrupt."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str):
        def series(kind, name, doc, labels=()):
            return kind(f"{prefix}:{name}", doc, ["model_name", *labels], registry=registry)

        self._model = model_name
        self._bytes = series(Counter, "kv_offload_total_bytes", "Bytes moved by the KV tiers.", ["transfer_type"])
        self._time = series(Counter, "kv_offload_total_time", "Seconds spent moving KV tier bytes (host side).",
                            ["transfer_type"])
        self._queries = series(Counter, "external_prefix_cache_queries", "Prompt tokens looked up below the pool.")
        self._hits = series(Counter, "external_prefix_cache_hits", "Prompt tokens found below the pool.")
        self._served = series(Counter, "kv_tier_hit_tokens", "Prompt tokens served by each KV tier.", ["tier"])
        self._dropped = series(Counter, "kv_tier_dropped_files", "Stored blocks dropped as corrupt or foreign.",
                               ["tier"])
        self._used = series(Gauge, "kv_tier_usage_bytes", "Bytes each KV tier holds.", ["tier"])
        self._capacity = series(Gauge, "kv_tier_capacity_bytes", "Bytes each KV tier may hold.", ["tier"])
        self._reported: dict[tuple, float] = {}

    def observe(self, snapshot: dict) -> None:
        for transfer, value in snapshot["bytes"].items():
            self._advance(self._bytes, value, transfer_type=transfer)
        for transfer, value in snapshot["seconds"].items():
            self._advance(self._time, value, transfer_type=transfer)
        self._advance(self._queries, snapshot["external_prefix_cache_queries"])
        self._advance(self._hits, snapshot["external_prefix_cache_hits"])
        for tier, value in snapshot["hit_tokens"].items():
            self._advance(self._served, value, tier=tier)
        for tier, figures in snapshot["tiers"].items():
            self._advance(self._dropped, figures["dropped_files"], tier=tier)
            self._used.labels(model_name=self._model, tier=tier).set(figures["used_bytes"])
            self._capacity.labels(model_name=self._model, tier=tier).set(figures["capacity_bytes"])

    def _advance(self, counter: Counter, total: float, **labels) -> None:
        """Move a counter to a running total (the tiers keep totals; counters only go up)."""
        key = (id(counter), *sorted(labels.items()))
        counter.labels(model_name=self._model, **labels).inc(max(total - self._reported.get(key, 0), 0))
        self._reported[key] = max(total, self._reported.get(key, 0))
