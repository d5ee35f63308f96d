"""What clients written for `vllm serve` call beside the OpenAI routes: /tokenize,
/detokenize, /version, /ping, the legacy /generate (LlamaIndex's VllmServer), and
vLLM's sampling extras on the OpenAI routes."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedrag import EngineArgs, __version__
from pagedrag.entrypoints.async_engine import AsyncLLMEngine
from pagedrag.server.app import build_app
from pagedrag.server.background import BackgroundServer
from pagedrag.server.serving import ServerConfig


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=256, num_gpu_blocks_override=64,
                                                        max_num_seqs=8))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(build_app(engine, ServerConfig(served_model_names=["smol"]))) as running:
        yield running


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def test_tokenize_and_detokenize_round_trip(server):
    tokens = _post(server, "/tokenize", {"prompt": "The capital of France", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] == 256
    assert _post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == "The capital of France"
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3
    assert _post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert _post(server, "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}).status_code == 400


def test_tokenize_renders_a_chat_with_the_operators_template(server, engine):
    """/tokenize counts a chat as the chat route renders it: through --chat-template when given."""
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with BackgroundServer(build_app(engine, ServerConfig(served_model_names=["smol"], chat_template=template))) as own:
        counted = _post(own, "/tokenize", {"messages": messages}).json()["count"]
        used = _post(own, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()["usage"]
    assert counted == used["prompt_tokens"] < _post(server, "/tokenize", {"messages": messages}).json()["count"]


def test_version_and_ping(server):
    assert httpx.get(server.base_url + "/version").json() == {"version": __version__}
    assert httpx.get(server.base_url + "/ping").status_code == 200
    assert httpx.post(server.base_url + "/ping").status_code == 200


def test_legacy_generate_whole_and_streamed(server):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "n": 1}
    whole = _post(server, "/generate", body).json()["text"]
    assert len(whole) == 1 and whole[0].startswith("Once upon a time") and len(whole[0]) > len("Once upon a time")
    with httpx.stream("POST", server.base_url + "/generate", json={**body, "stream": True}, timeout=120) as response:
        raw = b"".join(response.iter_bytes())
    updates = [json.loads(part) for part in raw.decode().split("\0") if part]
    assert updates and updates[-1]["text"] == whole
    assert _post(server, "/generate", {**body, "use_beam_search": True}).status_code == 400


def test_vllm_sampling_extras_are_honoured(server):
    allowed = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 5, "temperature": 0,
                                                "allowed_token_ids": [28, 29], "ignore_eos": True}).json()
    pieces = {_post(server, "/detokenize", {"tokens": [token]}).json()["prompt"] for token in (28, 29)}
    assert allowed["choices"][0]["text"] and set(allowed["choices"][0]["text"]) <= set("".join(pieces))
    truncated = _post(server, "/v1/completions", {"prompt": "one two three four five six", "max_tokens": 1,
                                                  "truncate_prompt_tokens": 2}).json()
    assert truncated["usage"]["prompt_tokens"] == 2
    biased = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                               "logit_bias": {"28": 100}, "ignore_eos": True}).json()
    assert biased["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("field, value", [("guided_decoding_backend", "outlines"), ("logit_bias", {"x": 1})])
def test_fields_not_honoured_yet_are_400_not_ignored(server, field, value):
    response = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, field: value})
    assert response.status_code == 400 and field in response.text or "logit_bias" in response.text


def test_prompt_plus_max_tokens_beyond_max_model_len_is_400(server):
    response = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 300})
    assert response.status_code == 400 and "maximum context length" in response.json()["error"]["message"]


def test_prompt_logprobs_in_the_response(server):
    body = _post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 1,
                                             "prompt_logprobs": 1}).json()
    entries = body["prompt_logprobs"]
    assert entries[0] is None and len(entries) == body["usage"]["prompt_tokens"]
    assert all({"logprob", "rank", "decoded_token"} <= set(lp) for entry in entries[1:] for lp in entry.values())
