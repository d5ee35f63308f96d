"""The OpenAI-compatible server end to end: the official openai client against a server
on loopback (uvicorn in a thread), sharing one engine for the whole module."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedrag import EngineArgs
from pagedrag.entrypoints.async_engine import AsyncLLMEngine
from pagedrag.server.app import build_app
from pagedrag.server import cli
from pagedrag.server.background import BackgroundServer, free_port
from pagedrag.server.serving import ServerConfig

MODEL = "smol"
KEYS = ["key-one", "key-two"]
# ~90 tokens shared by the cache tests: five full 16-token blocks
LONG_PREFIX = ("You answer questions about the solar system using only the context below. "
               "Context: The Sun holds 99.8 percent of the mass of the solar system. Mercury is the "
               "closest planet to the Sun and has no moons. Venus rotates backwards and has the "
               "hottest surface. Earth is the only planet known to have liquid water on its surface. "
               "Mars has two small moons named Phobos and Deimos. Jupiter is the largest planet. ")

@pytest.fixture(scope="module")
def engine():
    """With asynchronous scheduling, as on CUDA (outputs a step late, aborts with a token in
    flight); the CPU default (synchronous) serves the integration and load tests."""
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(max_model_len=512, num_gpu_blocks_override=128, max_num_seqs=16, seed=0, async_scheduling=True))
    yield engine
    engine.shutdown()


def _serve(engine, **config):
    return BackgroundServer(build_app(engine, ServerConfig(served_model_names=[MODEL], **config)))


@pytest.fixture(scope="module")
def server(engine):
    """The main server: API keys required, a salt per key."""
    with _serve(engine, api_keys=KEYS, salt_by_api_key=True) as server:
        yield server


@pytest.fixture(scope="module")
def open_server(engine):
    """No keys, at most one request in flight."""
    with _serve(engine, max_queue=1) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEYS[0], max_retries=0, timeout=600)


def _stats(engine) -> dict:
    return asyncio.run(asyncio.wait_for(engine.stats(), 60))


def _wait_idle(engine, timeout: float = 60.0) -> dict:
    """Wait until no request is in flight; returns the engine stats then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = _stats(engine)
        if engine.num_in_flight == 0 and stats["num_free_blocks"] == stats["num_gpu_blocks"]:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the engine did not become idle: {_stats(engine)}, in flight {engine.num_in_flight}")


def _metrics(base_url: str) -> dict[str, float]:
    """Every sample of /metrics by name, summed over labels."""
    text = httpx.get(base_url + "/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def _greedy(**extra) -> dict:
    return {"model": MODEL, "temperature": 0, **extra}


# ---- the happy paths --------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base_url + "/health").status_code == 200  # open without a key


def test_completion(client):
    result = client.completions.create(prompt="The capital of France is", max_tokens=5, **_greedy())
    choice = result.choices[0]
    assert result.object == "text_completion" and choice.text and choice.finish_reason == "length"
    assert result.usage.completion_tokens == 5
    assert result.usage.total_tokens == result.usage.prompt_tokens + 5


def test_chat(client):
    result = client.chat.completions.create(
        messages=[{"role": "user", "content": "Say hello."}], max_completion_tokens=6, **_greedy())
    message = result.choices[0].message
    assert message.role == "assistant" and message.content
    assert result.usage.completion_tokens <= 6


def test_streaming_completion_matches_whole(client):
    whole = client.completions.create(prompt="Once upon a time", max_tokens=8, **_greedy())
    chunks = list(client.completions.create(prompt="Once upon a time", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **_greedy()))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_streaming_chat_matches_whole(client):
    messages = [{"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(messages=messages, max_tokens=8, **_greedy())
    chunks = list(client.chat.completions.create(messages=messages, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}, **_greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_sse_framing(server):
    """Exactly OpenAI's framing: `data: {json}` events split by blank lines, usage in the
    last chunk (no choices, usage null before it), then `data: [DONE]`."""
    body = {"prompt": "Hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEYS[0]}"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert all(event.startswith("data: {") for event in events[:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(chunk["usage"] is None and len(chunk["choices"]) == 1 for chunk in chunks[:-1])


def test_n_completions(client):
    result = client.completions.create(prompt="My favourite fruit is", max_tokens=6, n=3, temperature=1.0,
                                       seed=7, model=MODEL, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 18
    streamed = list(client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, stream=True, model=MODEL))
    finished = {c.choices[0].index for c in streamed if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_stop_string(client):
    free = client.completions.create(prompt="1, 2, 3, 4,", max_tokens=12, **_greedy()).choices[0].text
    stop = free.strip().split()[1]  # a word the model writes after the first
    for stream in (False, True):
        result = client.completions.create(prompt="1, 2, 3, 4,", max_tokens=12, stop=[stop],
                                           stream=stream, **_greedy())
        choices = [c.choices[0] for c in result] if stream else result.choices
        text = "".join(c.text for c in choices)
        assert text == free[:free.index(stop)]
        assert choices[-1].finish_reason == "stop"


def test_logprobs(client):
    result = client.completions.create(prompt="Hello", max_tokens=3, logprobs=2, **_greedy())
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 3
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, **_greedy())
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_cached_tokens_and_metrics(server, client, engine):
    """A second request with the same long prefix hits the cache; /metrics adds up."""
    _wait_idle(engine)
    before = _metrics(server.base_url)
    results = [client.completions.create(prompt=LONG_PREFIX + question, max_tokens=4, **_greedy())
               for question in ("Question: which planet is largest?", "Question: which has no moons?")]
    first, second = (r.usage for r in results)
    assert first.prompt_tokens > 80
    assert second.prompt_tokens_details.cached_tokens >= 80
    after = _metrics(server.base_url)

    def grew(name):
        return after[name] - before.get(name, 0.0)

    assert grew("pagedrag:prompt_tokens_total") == first.prompt_tokens + second.prompt_tokens
    assert grew("pagedrag:generation_tokens_total") == first.completion_tokens + second.completion_tokens
    assert grew("pagedrag:prefix_cache_queries_total") == first.prompt_tokens + second.prompt_tokens
    assert grew("pagedrag:prefix_cache_hits_total") == (first.prompt_tokens_details.cached_tokens
                                                        + second.prompt_tokens_details.cached_tokens)
    assert grew("pagedrag:time_to_first_token_seconds_count") == 2
    assert "pagedrag:gpu_cache_usage_perc" in after


def test_stats_endpoint(server, engine):
    """GET /v1/stats: the engine's counters as JSON, behind the API key."""
    _assert_error(httpx.get(server.base_url + "/v1/stats"), 401)
    response = httpx.get(server.base_url + "/v1/stats", headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert response.status_code == 200
    stats = response.json()
    assert stats.keys() == _stats(engine).keys()
    assert stats["max_model_len"] == engine.model_info.max_model_len == 512
    assert stats["block_size"] == engine.model_info.block_size


def test_engine_surface_cached_prefix_and_reset(open_server, engine):
    """The read surface the server and the clients use instead of the engine itself."""
    prompt = LONG_PREFIX + "Question: what does the surface report?"
    token_ids = engine.get_input_processor().process(prompt).token_ids
    assert _post(open_server.base_url, "/v1/completions", {"prompt": prompt, "max_tokens": 1},
                 key=None).status_code == 200
    cached = asyncio.run(engine.cached_prefix_len(token_ids))
    assert cached >= 80
    assert asyncio.run(engine.cached_prefix_len(token_ids, cache_salt="another tenant")) == 0
    _wait_idle(engine)
    asyncio.run(engine.reset_prefix_cache())
    assert asyncio.run(engine.cached_prefix_len(token_ids)) == 0
    assert engine.get_tokenizer() is not engine.get_tokenizer()  # a copy per caller
    labels = {"model_name": engine.model_info.name}
    assert engine.metrics_registry.get_sample_value("pagedrag:prefix_cache_queries_total", labels) > 0


def test_tenants_do_not_share_cache(server, client):
    """With --salt-by-api-key the other key's identical prompt starts cold."""
    prompt = LONG_PREFIX + "Question: tenant isolation?"
    client.completions.create(prompt=prompt, max_tokens=2, **_greedy())
    warm = client.completions.create(prompt=prompt, max_tokens=2, **_greedy())
    other = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEYS[1], max_retries=0)
    cold = other.completions.create(prompt=prompt, max_tokens=2, **_greedy())
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert cold.usage.prompt_tokens_details.cached_tokens == 0


# ---- errors --------------------------------------------------------------------------
def _post(base_url: str, path: str, body, key: str | None = KEYS[0]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, bytes):
        return httpx.post(base_url + path, content=body, headers={**headers, "Content-Type": "application/json"})
    return httpx.post(base_url + path, json=body, headers=headers, timeout=60)


def _assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("body, param", [
    ({"prompt": "word " * 600}, "prompt"),  # over max_model_len
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": "many"}, "n"),  # a pydantic validation error (FastAPI's 422)
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "stop_token_ids": [10 ** 9]}, "stop_token_ids"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream, as OpenAI
    ({"prompt": "x", "cache_salt": "s" * 5000}, "cache_salt"),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt"),  # as vLLM: an empty salt is not "no salt"
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),  # as vLLM: an empty list allows nothing
    ({"prompt": "x", "priority": 5}, "priority"),  # first come, first served
    ({"prompt": "x", "length_penalty": 2.0}, "length_penalty"),  # beam search's
    ({"prompt": []}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),  # a token id outside the vocabulary
])
def test_bad_completion_is_400(server, body, param):
    error = _assert_error(_post(server.base_url, "/v1/completions", body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
    {"messages": [{"role": "user", "content": "hi"}], "echo": True},
    {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
    {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"grammar": "root ::= root"}},
])
def test_bad_chat_is_400(server, body):
    _assert_error(_post(server.base_url, "/v1/chat/completions", body), 400)


@pytest.mark.parametrize("fields, param", [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 5000}, "max_completion_tokens"),  # past max_model_len
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"temperature": -0.5}, "temperature"),
    ({"cache_salt": "s" * 5000}, "cache_salt"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),  # not among the tools
    ({"tool_choice": "required"}, "tool_choice"),  # and no tools
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_regex": "(?=a)b"}, "guided_regex"),  # refused when compiled
])
def test_a_chat_error_names_the_field_the_client_sent(server, fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    error = _assert_error(_post(server.base_url, "/v1/chat/completions", body), 400)
    assert error["param"] == param and param in error["message"]


def test_vllms_request_fields_are_honoured(server, engine):
    """request_id names the response, return_tokens_as_token_ids the logprobs' tokens,
    add_special_tokens and continue_final_message shape the prompt, documents reach the
    template, and a role of the model's template (not OpenAI's) is taken, as vLLM takes them."""
    tokenizer = engine.get_tokenizer()
    completion = _post(server.base_url, "/v1/completions", _greedy(
        prompt="The Sun is", max_tokens=2, logprobs=1, request_id="mine-1", return_tokens_as_token_ids=True,
        add_special_tokens=False)).json()
    assert completion["id"] == "cmpl-mine-1"
    assert all(token.startswith("token_id:") for token in completion["choices"][0]["logprobs"]["tokens"])
    assert completion["usage"]["prompt_tokens"] == len(tokenizer.encode("The Sun is", add_special_tokens=False))
    messages = [{"role": "user", "content": "Greet me."}, {"role": "assistant", "content": "Hello"}]
    continued = _post(server.base_url, "/v1/chat/completions", _greedy(
        messages=messages, max_tokens=2, add_generation_prompt=False, continue_final_message=True,
        documents=[{"title": "a", "text": "b"}])).json()
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True)
    assert expected.endswith("Hello")
    assert continued["usage"]["prompt_tokens"] == len(tokenizer.encode(expected, add_special_tokens=False))
    custom_role = _post(server.base_url, "/v1/chat/completions", _greedy(
        messages=[{"role": "chatbot", "content": "Hi."}, {"role": "user", "content": "Hello?"}], max_tokens=1))
    assert custom_role.status_code == 200, custom_role.text


def test_malformed_json_is_400(server):
    error = _assert_error(_post(server.base_url, "/v1/completions", b'{"prompt": "x",'), 400)
    assert "JSON" in error["message"]


def test_unknown_model_is_404(server):
    error = _assert_error(_post(server.base_url, "/v1/completions", {"prompt": "x", "model": "gpt-9"}), 404)
    assert error["code"] == "model_not_found"


def test_bad_input_never_stalls_the_engine(server, client):
    for _ in range(3):
        _post(server.base_url, "/v1/completions", {"prompt": "word " * 600, "stream": True})
    assert client.completions.create(prompt="Still alive?", max_tokens=2, **_greedy()).choices[0].text


def test_api_key_required(server):
    body = {"prompt": "x", "max_tokens": 1}
    assert _assert_error(_post(server.base_url, "/v1/completions", body, key=None), 401)["code"] == "invalid_api_key"
    _assert_error(_post(server.base_url, "/v1/completions", body, key="wrong"), 401)
    _assert_error(httpx.get(server.base_url + "/v1/models"), 401)
    assert _post(server.base_url, "/v1/completions", body, key=KEYS[1]).status_code == 200
    _assert_error(_post(server.base_url, "/generate", {"prompt": "x", "max_tokens": 1}, key=None), 401)  # generates too
    assert _post(server.base_url, "/generate", {"prompt": "x", "max_tokens": 1}, key=KEYS[0]).status_code == 200


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    """Wait for ``condition()`` (polled); fail with a message naming ``what`` if it never holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} was not seen within {timeout:.0f} s")
        time.sleep(0.01)


def test_queue_full_is_503(open_server, engine):
    """max_queue=1: while one request holds the seat, the next is turned away; afterwards it is
    served. The engine's steps are held back until the knock, so the first request is in flight
    for as long as the test needs, however fast or loaded the machine is."""
    _wait_idle(engine)
    gate = threading.Event()
    runner = engine.engine.runner
    real_execute = runner.execute

    def held_execute(step, *args):
        gate.wait(timeout=600)
        return real_execute(step, *args)

    body = {"prompt": "Count:", "max_tokens": 4, "ignore_eos": True}
    runner.execute = held_execute
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            holder = pool.submit(_post, open_server.base_url, "/v1/completions", body, None)
            _wait_for(lambda: engine.num_in_flight == 1, "the first request in flight")
            error = _assert_error(_post(open_server.base_url, "/v1/completions", {"prompt": "x"}, key=None), 503)
            assert error["code"] == "queue_full"
            gate.set()
            assert holder.result(timeout=600).status_code == 200
    finally:
        gate.set()
        runner.execute = real_execute
    _wait_idle(engine)
    assert _post(open_server.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key=None).status_code == 200


def test_disconnect_mid_stream_frees_blocks(open_server, engine):
    _wait_idle(engine)
    body = {"prompt": "Tell me a long story:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", open_server.base_url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        events = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert json.loads(events[0][6:])["choices"][0]["text"] is not None
        stats = _stats(engine)
        assert stats["num_free_blocks"] < stats["num_gpu_blocks"] and engine.num_in_flight == 1
    stats = _wait_idle(engine)
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def test_disconnect_before_response_aborts(open_server, engine):
    """A non-streamed request whose client gives up is aborted too."""
    _wait_idle(engine)
    body = {"prompt": "Another long story:", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(open_server.base_url + "/v1/completions", json=body, timeout=1.5)
    _wait_idle(engine, timeout=30)


def test_step_failure_fails_only_its_request(server, client, engine):
    """A step that raises because of one request (here: its salt) gives that request a 500;
    a stream running beside it completes unchanged, and the engine goes on."""
    runner = engine.engine.runner
    real_execute = runner.execute

    def execute(step, *args):
        if any(item.request.cache_salt is not None and "poison" in item.request.cache_salt
               for item in step.scheduled):
            raise RuntimeError("simulated kernel failure")
        return real_execute(step, *args)

    expected = client.completions.create(prompt="Once upon a time", max_tokens=24, **_greedy()).choices[0].text
    runner.execute = execute
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            canary = pool.submit(client.completions.create, prompt="Once upon a time", max_tokens=24, **_greedy())
            time.sleep(0.2)
            error = _assert_error(_post(server.base_url, "/v1/completions",
                                        {"prompt": "x", "max_tokens": 2, "cache_salt": "poison"}), 500)
            assert error["code"] == "request_failed" and "simulated kernel failure" in error["message"]
            assert canary.result(timeout=600).choices[0].text == expected
    finally:
        runner.execute = real_execute
    _wait_idle(engine)
    assert engine.dead_reason is None


def test_engine_whose_device_fails_is_dead():
    """A device failure kills the engine: the request in flight and every later one get 503
    engine_dead, and /health says so (nothing hangs)."""
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=256, num_gpu_blocks_override=32))

    def broken(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.engine.runner.execute = broken
    try:
        with _serve(engine) as server:
            error = _assert_error(_post(server.base_url, "/v1/completions", {"prompt": "x"}, key=None), 503)
            assert "illegal memory access" in error["message"] and error["code"] == "engine_dead"
            assert _assert_error(httpx.get(server.base_url + "/health"), 503)["code"] == "engine_dead"
            _assert_error(_post(server.base_url, "/v1/completions", {"prompt": "x"}, key=None), 503)
    finally:
        engine.shutdown()


# ---- the command line -------------------------------------------------------------
def test_every_engine_arg_is_a_flag():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["my-model", "--gpu-memory-utilization", "0.8", "--max-num-seqs", "64",
                              "--no-enable-prefix-caching", "--block-size", "32", "--api-key", "a",
                              "--api-key", "b", "--max-queue", "9"])
    engine_args = cli.engine_args_from(args)
    assert (engine_args.model, engine_args.gpu_memory_utilization, engine_args.max_num_seqs) == ("my-model", 0.8, 64)
    assert not engine_args.enable_prefix_caching and engine_args.block_size == 32
    assert args.api_keys == ["a", "b"] and args.max_queue == 9 and args.host == "127.0.0.1"
    defaults = cli.engine_args_from(parser.parse_args([]))
    assert defaults == EngineArgs()
    assert {f.name for f in dataclasses.fields(EngineArgs)} == set(vars(defaults))


def test_serve_subprocess_logs_pool_and_exports_metrics(tmp_path):
    """`pagedrag serve` logs the KV pool at start and serves pagedrag:gpu_cache_usage_perc, labelled
    with the first --served-model-name."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pagedrag", "serve", "--port", str(port), "--max-model-len", "256",
             "--num-gpu-blocks-override", "64", "--max-num-seqs", "8", "--enable-prefix-caching",
             "--served-model-name", "rag-model", "smol"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
                break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise AssertionError(f"serve did not come up: {log_path.read_text()}")
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0  # Ctrl-C: a graceful exit
    assert "Traceback" not in log_path.read_text()
    assert any(line.startswith("pagedrag:gpu_cache_usage_perc") for line in metrics.splitlines())
    assert 'model_name="rag-model"' in metrics  # the first served name, as vLLM labels its metrics
    assert "num_cpu_blocks=64" in log_path.read_text()


def test_work_is_cancelled_when_the_client_leaves_first():
    """A client that disconnects before the answer: ClientDisconnected (a 499, logged as such),
    never an InvalidStateError of the cancelled work read too early."""
    from pagedrag.server.streams import ClientDisconnected, unless_disconnected

    class LeavingClient:
        async def receive(self):
            return {"type": "http.disconnect"}

    class StayingClient:
        async def receive(self):
            await asyncio.sleep(3600)

    async def main():
        work = asyncio.ensure_future(asyncio.sleep(3600))
        with pytest.raises(ClientDisconnected):
            await unless_disconnected(LeavingClient(), work)
        await asyncio.sleep(0)
        assert work.cancelled()
        assert await unless_disconnected(StayingClient(), asyncio.sleep(0, result="done")) == "done"

    asyncio.run(main())


def test_the_engine_aborts_by_request_id_as_vllms_does(engine):
    """``await engine.abort(id)`` ends the stream with finish_reason "abort"; unknown ids are ignored."""
    from pagedrag import AsyncLLMEngine as exported, SamplingParams

    async def main():
        stream = engine.generate("Tell me a long story", SamplingParams(max_tokens=400, ignore_eos=True),
                                 request_id="to-abort")
        async for output in stream:
            await engine.abort(["to-abort", "no-such-request"])
            await engine.abort("no-such-request")
        return output

    last = asyncio.run(asyncio.wait_for(main(), 120))
    assert exported is AsyncLLMEngine
    assert last.finished and last.outputs[0].finish_reason == "abort" and len(last.outputs[0].token_ids) < 400
    _wait_idle(engine)
