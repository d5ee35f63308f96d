"""Serving several engine replicas behind one OpenAI endpoint, routed by prefix-cache affinity:
the policy (affinity), the block hashes of a request body (prompt_blocks), summed metrics
(metrics_sum), N local replica processes (data_parallel), /v1/warm sent to every one of them
(warm_fanout) and the Ray Serve application (ray_app)."""
