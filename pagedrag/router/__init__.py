"""Serving several engine replicas behind one OpenAI endpoint, routed by prefix-cache affinity:
the policy (affinity), the block hashes of a request body (prompt_blocks), summed metrics
(metrics_sum), the headers passed on (proxy_headers), /v1/warm sent to every replica and
answered as one (warm_fanout), N local replica processes (data_parallel) and the Ray Serve
application (ray_app)."""
