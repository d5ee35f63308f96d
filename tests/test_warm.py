"""Warm-ups at the server and the clients, on a tiny random Llama (CPU): POST /v1/warm counts
what it computed, checks its input as completions do (400 with OpenAI's error body, 404, 503 over
--max-queue), fills a disk tier that a new engine then hits, and the in-process and remote
clients' warm() do the same through EngineClient."""

from __future__ import annotations

import httpx
import pytest

from model_fixtures import make_tiny_model
from pagedrag import EngineArgs, SamplingParams
from pagedrag.client import InProcessClient, RemoteClient, SharedEngine, WarmSummary
from pagedrag.entrypoints.async_engine import AsyncLLMEngine
from pagedrag.server.app import build_app
from pagedrag.server.background import BackgroundServer
from pagedrag.server.serving import ServerConfig

MODEL = "tiny"
ENGINE = {"max_model_len": 256, "num_gpu_blocks_override": 96, "block_size": 16}
CONTEXT = ("The pool holds blocks of sixteen tokens each; a warm-up computes them before the first "
           "question arrives, so that the question finds them cached.")
CONVERSATION = [{"role": "system", "content": "Answer from the context."}, {"role": "user", "content": CONTEXT}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("warm"), "llama"))


def _serve(model_path: str, **engine):
    """A server of a fresh engine (stopped, with its engine, when the ``with`` ends)."""
    return _Served(AsyncLLMEngine.from_engine_args(EngineArgs(model=model_path, **ENGINE, **engine)))


class _Served(BackgroundServer):
    def __init__(self, engine: AsyncLLMEngine, **config):
        self.engine = engine
        super().__init__(build_app(engine, ServerConfig(served_model_names=[MODEL], **config)))

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.engine.shutdown()


@pytest.fixture(scope="module")
def server(model_path):
    with _serve(model_path) as server:
        yield server


def _warm(server, **body) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/warm", json=body, timeout=60)


def test_warm_counts_prompt_tokens_and_a_second_warm_is_cached(server):
    prompts = [CONTEXT + " First.", CONTEXT + " Second, a little longer."]
    first = _warm(server, model=MODEL, prompt=prompts)
    assert first.status_code == 200, first.text
    answer = first.json()
    assert answer["object"] == "warm" and answer["prompts"] == 2
    assert answer["prompt_tokens"] == sum(len(p.encode()) for p in prompts)  # one token a byte
    again = _warm(server, prompt=prompts).json()
    assert again["prompt_tokens"] == answer["prompt_tokens"] and again["cached_tokens"] > answer["cached_tokens"]


def test_a_warmed_conversation_is_a_cache_hit_for_the_chat(server):
    assert _warm(server, conversations=[CONVERSATION], cache_salt="tenant").status_code == 200
    chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                      json={"messages": CONVERSATION, "max_tokens": 2, "cache_salt": "tenant"}).json()
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * ((len(CONTEXT) - 1) // 16)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "conversations": [CONVERSATION]}, None),
    ({}, None),
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": [1, 2, 10**6]}, "prompt"),
    ({"prompt": [1, 2, 3], "prompt_chunks": ["x"]}, "prompt"),
    ({"prompt": "x", "prompt_segments": ["a"]}, "prompt_segments"),
    ({"prompt": ["x"] * 1025}, "prompt"),
    ({"prompt": "x" * 300}, "prompt"),
    ({"conversations": [[{"role": "", "content": "hi"}]]}, None),  # a role of the template may be any but empty
    ({"conversations": []}, "conversations"),
    ({"conversations": [[]]}, "conversations"),
    ({"prompt": "x", "cache_salt": 7}, "cache_salt"),
])
def test_bad_input_is_a_400_with_openais_error_body(server, body, param):
    response = _warm(server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)


def test_an_unknown_model_is_a_404(server):
    assert _warm(server, model="nope", prompt="x").status_code == 404


def test_warm_counts_against_the_queue(model_path):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model_path, **ENGINE))
    with _Served(engine, max_queue=1) as limited:
        never_fits = _warm(limited, conversations=[CONVERSATION, CONVERSATION])  # a retry could never succeed
        assert never_fits.status_code == 400 and "--max-queue" in never_fits.json()["error"]["message"]
        assert _warm(limited, prompt="one prompt fits").status_code == 200


def test_the_route_is_in_the_openapi_schema(server):
    schema = httpx.get(server.base_url + "/openapi.json").json()
    operation = schema["paths"]["/v1/warm"]["post"]
    assert "pagedrag's extension" in operation["description"]
    assert {"WarmRequest", "WarmResponse"} <= set(schema["components"]["schemas"])


def test_a_new_engine_on_the_disk_tier_hits_what_a_warm_stored(model_path, tmp_path):
    with _serve(model_path, kv_disk_path=str(tmp_path)) as warming:
        assert _warm(warming, prompt=CONTEXT).json()["cached_tokens"] == 0
    with _serve(model_path, kv_disk_path=str(tmp_path)) as restarted:
        completion = httpx.post(restarted.base_url + "/v1/completions", timeout=60,
                                json={"prompt": CONTEXT, "max_tokens": 2}).json()
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * ((len(CONTEXT) - 1) // 16)


def test_the_remote_client_warms_texts_and_conversations(server):
    client = RemoteClient(server.base_url, MODEL)
    texts = [CONTEXT + " Remote."]
    summary = client.warm([*texts, CONVERSATION], cache_salt="remote")
    assert summary.prompts == 2 and summary.prompt_tokens > 2 * len(CONTEXT)
    assert client.warm(texts, cache_salt="remote").cached_tokens > 0
    assert client.warm([]) == WarmSummary()
    with pytest.raises(ValueError, match="max_model_len|context length"):
        client.warm([[{"role": "user", "content": "x" * 300}]])


def test_the_in_process_client_warms_and_a_chat_then_hits(model_path):
    client = InProcessClient(SharedEngine(EngineArgs(model=model_path, **ENGINE, enable_chunk_reuse=True,
                                                     chunk_recompute_window=0)))  # the context stays a hit
    try:
        summary = client.warm([CONVERSATION, CONTEXT], chunks=[CONTEXT])
        assert summary.prompts == 2 and summary.cached_tokens == 0
        reply = client.generate(CONVERSATION, SamplingParams(temperature=0, max_tokens=2))
        assert reply.cached_tokens + reply.chunk_cache_hits >= 16 * ((len(CONTEXT) - 1) // 16)
        with pytest.raises(TypeError, match="chunks"):
            client.warm(CONTEXT, chunks=CONTEXT)
    finally:
        client.shared.engine.shutdown()
