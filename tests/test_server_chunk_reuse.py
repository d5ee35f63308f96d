"""Chunk reuse through the server and the clients: pagedrag's prompt_segments and
prompt_chunks fields, the chunk figures of usage.prompt_tokens_details (whole and streamed
responses) and of /metrics, hostile bodies refused alone, the CLI flags, and the same
fields on an engine without chunk reuse (the prompt is the concatenation, 0 chunk hits).

One engine with chunk reuse serves the in-process client and the server; the clients'
requests are salted, so that no test finds another's chunks in the cache.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedrag.client import EngineClient, connect
from pagedrag.sampling_params import SamplingParams
from pagedrag.server import cli
from pagedrag.server.app import build_app
from pagedrag.server.background import BackgroundServer
from pagedrag.server.serving import ServerConfig

MODEL = "smol"
# test_client's engine arguments: run together, the two modules share the engine without reuse
ENGINE_KWARGS = {"max_model_len": 512, "num_gpu_blocks_override": 128, "max_num_seqs": 16, "seed": 0}
HEAD = "Answer from the context below.\n\n"
# Three chunks of about 30 tokens (two full 16-token blocks each), each ending with a blank line
A = ("Mercury is the closest planet to the Sun. It has no moons and a thin exosphere made of atoms "
     "blasted off its surface by the solar wind.\n\n")
B = ("Venus rotates backwards, very slowly, and its thick carbon dioxide atmosphere makes its surface "
     "the hottest of any planet in the solar system.\n\n")
C = ("Mars has two small moons named Phobos and Deimos. Its red colour comes from iron oxide dust that "
     "covers much of its rocky surface.\n\n")
CHUNK_COUNTERS = ("pagedrag:chunk_cache_hits_total", "pagedrag:chunk_tokens_recomputed_total",
                  "pagedrag:prompt_tokens_computed_total")


@pytest.fixture(scope="module")
def local() -> EngineClient:
    # no question window: it would recompute these short chunks whole (no chunk hits to check)
    return connect(engine_kwargs={**ENGINE_KWARGS, "enable_chunk_reuse": True, "chunk_recompute_window": 0})


@pytest.fixture(scope="module")
def engine(local):
    return local.shared.engine


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(build_app(engine, ServerConfig(served_model_names=[MODEL]))) as server:
        yield server


@pytest.fixture(scope="module")
def remote(server) -> EngineClient:
    return connect(base_url=server.base_url, max_retries=0)


@pytest.fixture(scope="module")
def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def plain_server():
    """A server on an engine without chunk reuse."""
    engine = connect(engine_kwargs=ENGINE_KWARGS).shared.engine
    with BackgroundServer(build_app(engine, ServerConfig(served_model_names=[MODEL]))) as server:
        yield server


def _post(base_url: str, path: str, body) -> httpx.Response:
    """Posted as ASCII JSON, so that a lone surrogate travels as its escape (\\ud800)."""
    return httpx.post(base_url + path, content=json.dumps(body), headers={"Content-Type": "application/json"},
                      timeout=600)


def _completion(base_url: str, **body) -> dict:
    response = _post(base_url, "/v1/completions", {"model": MODEL, "temperature": 0, "max_tokens": 2, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _details(usage) -> dict:
    """prompt_tokens_details of a usage (a dict, or the SDK's object), its identity checked."""
    usage = usage if isinstance(usage, dict) else usage.model_dump()
    details = usage["prompt_tokens_details"]
    assert details["cached_tokens"] + details["chunk_cache_hits"] + details["prompt_tokens_computed"] \
        == usage["prompt_tokens"], usage
    return details


def _metrics(base_url: str) -> dict[str, float]:
    """Every sample of /metrics by name, summed over labels."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def _wait_idle(engine, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_in_flight == 0


def _question(chunks: list[str], question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "".join(chunks) + question}]


# ---- the command line -------------------------------------------------------------
def test_chunk_reuse_flags():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = cli.engine_args_from(parser.parse_args(["--enable-chunk-reuse", "--chunk-recompute-fraction", "0.2",
                                                   "--chunk-recompute-window", "64"]))
    assert args.enable_chunk_reuse and args.chunk_recompute_fraction == 0.2 and args.chunk_recompute_window == 64
    assert not cli.engine_args_from(parser.parse_args([])).enable_chunk_reuse


# ---- chunk reuse on -------------------------------------------------------------------
def test_reordered_chunks_hit_the_chunk_cache(server, sdk, engine):
    """prompt + prompt_chunks, then the same chunks in another order (streamed): the second
    reports chunk hits in its usage, and /metrics adds them up. (Both are text cut around
    their chunks, tokenized whole; prompt_segments tokenize each segment alone, so a chunk
    sent both ways has other token ids at its edges.)"""
    _wait_idle(engine)
    before = _metrics(server.base_url)
    first = _completion(server.base_url, prompt=HEAD + A + B + C + "Question: which is hottest?",
                        prompt_chunks=[A, B, C])
    assert first["choices"][0]["text"] and _details(first["usage"])["chunk_cache_hits"] == 0
    stream = sdk.completions.create(model=MODEL, prompt=HEAD + C + A + B + "Question: which is red?", max_tokens=2,
                                    temperature=0, stream=True, stream_options={"include_usage": True},
                                    extra_body={"prompt_chunks": [C, A, B]})
    *pieces, last = list(stream)
    assert "".join(piece.choices[0].text for piece in pieces) and last.choices == []
    second = _details(last.usage)
    assert second["chunk_cache_hits"] >= 32 and second["chunk_tokens_recomputed"] > 0
    after = _metrics(server.base_url)
    details = (_details(first["usage"]), second)
    for name, key in zip(CHUNK_COUNTERS, ("chunk_cache_hits", "chunk_tokens_recomputed", "prompt_tokens_computed")):
        assert after[name] - before.get(name, 0.0) == sum(d[key] for d in details), name


def test_prompt_chunks_on_chat(sdk):
    """A chat's last user message is cut around prompt_chunks: the second conversation, its
    chunks reordered, hits them (whole and streamed responses report it)."""
    def ask(chunks: list[str], **stream):
        return sdk.chat.completions.create(model=MODEL, messages=_question(chunks, "Which has two moons?"),
                                           max_tokens=2, temperature=0, extra_body={"prompt_chunks": chunks},
                                           **stream)

    ask([A, B, C])
    whole = ask([B, C, A])
    assert whole.choices[0].message.content and _details(whole.usage)["chunk_cache_hits"] >= 32
    *_, last = ask([C, B, A], stream=True, stream_options={"include_usage": True})
    assert _details(last.usage)["chunk_cache_hits"] >= 32


HOSTILE = [  # (path, body, the field the 400 names; None: the whole body's UTF-8 check refused it)
    ("/v1/completions", {"prompt_segments": "a text, not a list"}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": []}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": [1, 2]}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": [None]}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": [[True]]}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": [[10 ** 9]]}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": [[]]}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": ["a", [[["deep"]]], {"token_ids": [{"x": 1}]}]}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": [{"text": {"nested": ["junk"]}}]}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": [{"text": "a", "token_ids": [1]}]}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": [{"text": "a", "reusable": "yes"}]}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": [{"text": "a", "extra": 1}]}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": ["x"] * 5000}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": ["word " * 300] * 4}, "prompt_segments"),  # over max_model_len
    ("/v1/completions", {"prompt_segments": ["\ud800"]}, "prompt_segments.0"),
    ("/v1/completions", {"prompt_segments": ["a"], "prompt": "b"}, "prompt_segments"),
    ("/v1/completions", {"prompt_segments": ["a"], "prompt_chunks": ["a"]}, "prompt_segments"),
    ("/v1/completions", {"prompt": None, "prompt_segments": None}, "prompt"),
    ("/v1/completions", {"prompt": "x", "prompt_chunks": "x"}, "prompt_chunks"),
    ("/v1/completions", {"prompt": "x", "prompt_chunks": [1, None]}, "prompt_chunks"),
    ("/v1/completions", {"prompt": "x", "prompt_chunks": [["nested"]]}, "prompt_chunks"),
    ("/v1/completions", {"prompt": "x", "prompt_chunks": ["c"] * 300}, "prompt_chunks"),
    ("/v1/chat/completions", {"messages": _question([A], "?"), "prompt_chunks": {"a": 1}}, "prompt_chunks"),
    ("/v1/chat/completions", {"messages": _question([A], "?"), "prompt_chunks": [A, 7]}, "prompt_chunks"),
]


def test_hostile_bodies_are_400_while_a_good_request_runs(server, sdk, engine):
    """Each hostile body gets a 400 naming its field while a streamed request (with
    prompt_chunks) runs to its end; then nothing is left in flight."""
    def good() -> tuple[str, int]:
        stream = sdk.completions.create(model=MODEL, prompt=HEAD + A + B + "Question: who rotates backwards?",
                                        max_tokens=24, temperature=0, stream=True,
                                        stream_options={"include_usage": True},
                                        extra_body={"prompt_chunks": [A, B], "ignore_eos": True})
        *pieces, last = list(stream)
        return pieces[-1].choices[0].finish_reason, last.usage.completion_tokens

    def hostile(case) -> tuple[int, dict]:
        path, body, _ = case
        response = _post(server.base_url, path, {"model": MODEL, "max_tokens": 2, **body})
        return response.status_code, response.json()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = pool.submit(good)
        answers = list(pool.map(hostile, HOSTILE))
        assert running.result(timeout=600) == ("length", 24)
    for (path, body, field), (status, answer) in zip(HOSTILE, answers):
        assert status == 400, (body, answer)
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
        assert (answer["error"]["param"] or "").startswith(field or ""), (body, answer)
    _wait_idle(engine)


# ---- the clients ------------------------------------------------------------------------
@pytest.mark.parametrize("client_name", ["local", "remote"])
def test_client_chunks_and_generation_figures(request, client_name):
    """``chunks=`` reaches the engine (remotely: as prompt_chunks), and a Generation carries
    the chunk figures: on the whole generation, and on a stream's last piece only."""
    client: EngineClient = request.getfixturevalue(client_name)
    params, salt = SamplingParams(temperature=0, max_tokens=2), f"client-{client_name}"
    client.complete(HEAD + A + B + C + "Which is hottest?", params, salt, chunks=[A, B, C])
    again = client.complete(HEAD + B + C + A + "Which is red?", params, salt, chunks=[B, C, A])
    assert again.chunk_cache_hits >= 32 and again.chunk_tokens_recomputed > 0
    assert again.prompt_tokens_computed == again.prompt_tokens - again.cached_tokens - again.chunk_cache_hits
    assert again.usage()["prompt_tokens_details"]["chunk_cache_hits"] == again.chunk_cache_hits
    client.chat(_question([A, B, C], "Which has two moons?"), params, salt, chunks=[A, B, C])
    *pieces, last = client.stream_chat(_question([C, A, B], "Which has two moons?"), params, salt, chunks=[C, A, B])
    assert last.chunk_cache_hits >= 32 and last.chunk_tokens_recomputed > 0
    assert all(piece.chunk_cache_hits == piece.chunk_tokens_recomputed == 0 for piece in pieces)
    with pytest.raises(TypeError, match="chunks must be a sequence of texts"):
        client.complete("Hi", params, chunks=A)
    with pytest.raises(TypeError, match=r"chunks\[1\] must be a text"):
        client.chat(_question([A], "?"), params, chunks=[A, 3])


# ---- chunk reuse off --------------------------------------------------------------------
def test_without_chunk_reuse_segments_are_their_concatenation(plain_server):
    """prompt_segments and prompt_chunks are accepted; the prompt is the segments' tokens
    joined (each text tokenized alone, as /tokenize does it), and no chunk is ever hit."""
    question = "Question: which planet is red?"
    segments = [HEAD, A, C, question]
    token_ids = [token for index, text in enumerate(segments) for token in _post(
        plain_server.base_url, "/tokenize", {"prompt": text, "add_special_tokens": index == 0}).json()["tokens"]]
    joined = _completion(plain_server.base_url, prompt=token_ids, max_tokens=4)
    by_segments = _completion(plain_server.base_url, max_tokens=4,
                              prompt_segments=[{"text": HEAD, "reusable": False}, A, C, question])
    reordered = _completion(plain_server.base_url, prompt=HEAD + C + A + question, prompt_chunks=[C, A])
    assert by_segments["choices"][0]["text"] == joined["choices"][0]["text"]
    assert by_segments["usage"]["prompt_tokens"] == joined["usage"]["prompt_tokens"] == len(token_ids)
    assert [_details(r["usage"])["chunk_cache_hits"] for r in (joined, by_segments, reordered)] == [0, 0, 0]
    assert _details(reordered["usage"])["chunk_tokens_recomputed"] == 0
