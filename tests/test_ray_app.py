"""pagedrag on Ray Serve (pagedrag.router.ray_app), on a local Ray instance: two replicas of
the embedded model behind the ingress, requests sharing a prefix meet it on one replica,
streams pass through, /metrics sums the replicas, a warm-up reaches every replica, a killed
replica loses no request; and the ingress's warm-up fan-out over in-process replicas.

Ray is not among the test dependencies (its wheels are large and its cluster takes
minutes to start on 2 cores): ``pip install "ray[serve]"`` to run this file."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

serve = pytest.importorskip("ray.serve")
import ray  # noqa: E402

from pagedrag.router.ray_app import EngineReplica, build_app, warm_by_broadcast  # noqa: E402

PORT = 8127
URL = f"http://127.0.0.1:{PORT}"
SYSTEM = "You answer questions about the Python standard library from the documents given. " * 4


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="max-model-lenx"):
        build_app({"max_model_lenx": "1"})
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        build_app({"gpu_memory_utilization": "7"})


class _Handle:
    """A deployment handle over in-process replicas (or the errors a dead one raises):
    ``broadcast`` calls EngineReplica's method on every replica at once."""

    def __init__(self, replicas: list):
        self.replicas = replicas

    def broadcast(self, method: str, *args) -> SimpleNamespace:
        async def call(replica):
            if isinstance(replica, Exception):
                raise replica
            return await getattr(EngineReplica.func_or_class, method)(replica, *args)

        return SimpleNamespace(results_async=lambda return_exceptions: asyncio.gather(
            *map(call, self.replicas), return_exceptions=return_exceptions))


def _replica(name: str, status: int, body: dict) -> SimpleNamespace:
    """An EngineReplica whose app answers /v1/warm with ``status`` and ``body`` to the caller's API key only."""
    app = FastAPI()

    @app.post("/v1/warm")
    async def warm(request: Request) -> JSONResponse:
        assert request.headers["authorization"] == "Bearer k"
        return JSONResponse(body, status_code=status)

    return SimpleNamespace(name=name, app=app)


def test_the_ingress_sends_a_warm_up_to_every_replica_and_answers_as_one():
    counts = {"object": "warm", "prompts": 1, "prompt_tokens": 40, "cached_tokens": 16}
    refused = {"error": {"message": "give prompt", "type": "invalid_request_error"}}

    def warm(*replicas) -> tuple[int, dict]:
        response = asyncio.run(warm_by_broadcast(_Handle(list(replicas)), {"authorization": "Bearer k"}, b"{}"))
        return response.status_code, json.loads(response.body)

    status, body = warm(_replica("b", 200, counts), _replica("a", 200, counts), ray.exceptions.ActorDiedError())
    assert status == 200 and (body["prompts"], body["prompt_tokens"], body["cached_tokens"]) == (2, 80, 32)
    assert [(entry["replica"], entry["status"]) for entry in body["replicas"]] == \
        [("a", 200), ("b", 200), ("unknown", 503)]
    assert warm(_replica("a", 200, counts), _replica("b", 400, refused)) == (400, refused)


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


def test_a_warm_up_reaches_every_replica(application):
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which module zips?"}]
    warmed = httpx.post(URL + "/v1/warm", json={"conversations": [conversation]}, timeout=300)
    assert warmed.status_code == 200, warmed.text
    assert [(entry["status"], entry["prompts"]) for entry in warmed.json()["replicas"]] == [(200, 1), (200, 1)]


def test_a_killed_replica_loses_no_request(application):
    replica = next(actor for actor in ray.util.list_named_actors(all_namespaces=True)
                   if "EngineReplica" in actor["name"])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_ask, f"Other question {i}?") for i in range(4)]
        time.sleep(1)
        ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=False)
        assert [future.result().status_code for future in futures] == [200] * 4
