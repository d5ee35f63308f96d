"""pagedrag on Ray Serve (pagedrag.router.ray_app), on a local Ray instance: two replicas of
the embedded model behind the ingress, requests sharing a prefix meet it on one replica,
streams pass through, /metrics sums the replicas, a killed replica loses no request.

Ray is not among the test dependencies (its wheels are large and its cluster takes
minutes to start on 2 cores): ``pip install "ray[serve]"`` to run this file."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

serve = pytest.importorskip("ray.serve")
import ray  # noqa: E402

from pagedrag.router.ray_app import build_app  # noqa: E402

PORT = 8127
URL = f"http://127.0.0.1:{PORT}"
SYSTEM = "You answer questions about the Python standard library from the documents given. " * 4


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="max-model-lenx"):
        build_app({"max_model_lenx": "1"})
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        build_app({"gpu_memory_utilization": "7"})


@pytest.fixture(scope="module")
def application():
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    serve.start(http_options={"port": PORT})
    serve.run(build_app({"num_replicas": 2, "max_model_len": 1024, "num_cpus": 1}), route_prefix="/")
    yield
    serve.shutdown()
    ray.shutdown()


def _ask(question: str, stream: bool = False) -> httpx.Response:
    body = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    return httpx.post(URL + "/v1/chat/completions", json=body, timeout=300)


def _prompt_tokens_by_replica() -> dict[str, float]:
    time.sleep(6)  # the replicas publish their metrics every 5 s
    lines = [line for line in httpx.get(URL + "/metrics", timeout=30).text.splitlines()
             if line.startswith("pagedrag:prompt_tokens_total{")]
    return {line.split('replica="')[1].split('"')[0] if 'replica="' in line else "": float(line.split()[-1])
            for line in lines}


def test_requests_sharing_a_prefix_meet_it_on_one_replica(application):
    replies = [_ask(f"Question {i}: what does module {i} do?") for i in range(4)]
    assert [r.status_code for r in replies] == [200] * 4
    assert all(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in replies[1:])
    tokens = _prompt_tokens_by_replica()
    assert sorted(v > 0 for k, v in tokens.items() if k) == [False, True]
    assert tokens[""] == sum(v for k, v in tokens.items() if k)
    assert "data: [DONE]" in _ask("Stream this", stream=True).text


def test_a_killed_replica_loses_no_request(application):
    replica = next(actor for actor in ray.util.list_named_actors(all_namespaces=True)
                   if "EngineReplica" in actor["name"])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_ask, f"Other question {i}?") for i in range(4)]
        time.sleep(1)
        ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=False)
        assert [future.result().status_code for future in futures] == [200] * 4
