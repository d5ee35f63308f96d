"""Engine metrics: plain counters for stats() and Prometheus series (vLLM's names,
prefix ``pagedrag:``) on a registry of the engine's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    """Every series the engine exports; the engine updates them as it steps."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._label = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(f"pagedrag:{name}", doc, labels, registry=self.registry).labels(**self._label)

        def counter(name, doc):
            return Counter(f"pagedrag:{name}", doc, labels, registry=self.registry).labels(**self._label)

        def histogram(name, doc):
            return Histogram(f"pagedrag:{name}", doc, labels, buckets=_LATENCY_BUCKETS,
                             registry=self.registry).labels(**self._label)

        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.gpu_cache_usage = gauge("gpu_cache_usage_perc", "Fraction of KV blocks in use (0-1); seed name.")
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to CPU memory.")
        self.preemptions = counter("num_preemptions", "Preemptions of running requests.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Requests finished (any reason but abort).")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens.")
