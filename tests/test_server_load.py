"""A bounded load test over loopback HTTP: 200 streamed requests from 50 concurrent
clients, every fifth one dropped halfway. Greedy outputs must match the same prompt
sent alone; afterwards no KV block is in use and the Prometheus counters add up."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedrag import EngineArgs
from pagedrag.entrypoints.async_engine import AsyncLLMEngine
from pagedrag.server.app import build_app
from pagedrag.server.background import BackgroundServer
from pagedrag.server.serving import ServerConfig

NUM_REQUESTS = 200
NUM_CLIENTS = 50
ABORT_EVERY = 5  # requests 0, 5, 10, ... are dropped after ABORT_AFTER_CHUNKS chunks
ABORT_AFTER_CHUNKS = 4
MAX_TOKENS = 8
HARD_TIMEOUT_S = 900  # generous: on a loaded 2-core machine the load takes minutes, never this
# a shared preamble of more than one 16-token block, so that requests hit the prefix cache
PREAMBLE = "Complete each sentence with a few plain words, the way a short encyclopedia would: "
PROMPTS = [PREAMBLE + end for end in (
    "The capital of France is", "Water boils at", "The largest planet is", "A haiku about autumn:",
    "def fibonacci(n):", "The opposite of hot is", "My favourite book is", "Three primary colors are")]


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(max_model_len=256, num_gpu_blocks_override=256, max_num_seqs=64, seed=0))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(build_app(engine, ServerConfig(served_model_names=["smol"]))) as server:
        yield server


def _body(prompt: str, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "logprobs": 0}  # logprobs: each chunk lists its tokens, so they can be counted


def _counters(base_url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            if "finished_reason" in sample.labels:
                labeled = f'{sample.name}{{finished_reason="{sample.labels["finished_reason"]}"}}'
                values[labeled] = values.get(labeled, 0.0) + sample.value
    return values


def _aborted(values: dict[str, float]) -> float:
    return values.get('pagedrag:request_success_total{finished_reason="abort"}', 0.0)


async def _stream_one(client: httpx.AsyncClient, prompt: str, drop: bool) -> tuple[str, int, bool]:
    """(text received, tokens received, finished) of one streamed completion."""
    text, tokens, chunks = "", 0, 0
    async with client.stream("POST", "/v1/completions", json=_body(prompt, True)) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            tokens += len(choice["logprobs"]["tokens"])
            chunks += 1
            if choice["finish_reason"] is not None:
                return text, tokens, True
            if drop and chunks == ABORT_AFTER_CHUNKS:
                return text, tokens, False  # leaving the block closes the connection
    raise AssertionError(f"the stream of {prompt!r} ended without a finish_reason")


async def _load(base_url: str) -> list[tuple[int, str, int, bool]]:
    jobs: asyncio.Queue = asyncio.Queue()
    for index in range(NUM_REQUESTS):
        jobs.put_nowait(index)
    results = []
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=NUM_CLIENTS)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not jobs.empty():
            index = jobs.get_nowait()
            prompt = PROMPTS[index % len(PROMPTS)]
            results.append((index, *await _stream_one(client, prompt, index % ABORT_EVERY == 0)))

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=HARD_TIMEOUT_S) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(NUM_CLIENTS)))
    return results


def _wait_idle(engine, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = asyncio.run(asyncio.wait_for(engine.stats(), 60))
        if engine.num_in_flight == 0 and stats["num_free_blocks"] == stats["num_gpu_blocks"]:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"blocks still in use after the load: {stats}")


def test_load_with_aborts(server, engine):
    alone = {prompt: httpx.post(server.base_url + "/v1/completions", json=_body(prompt, False), timeout=HARD_TIMEOUT_S).json()
             for prompt in PROMPTS}
    before = _counters(server.base_url)

    try:
        results = asyncio.run(asyncio.wait_for(_load(server.base_url), HARD_TIMEOUT_S))
    except TimeoutError:
        pytest.fail(f"the load did not finish within {HARD_TIMEOUT_S} s: the engine stopped answering")

    assert len(results) == NUM_REQUESTS
    for index, text, tokens, finished in results:
        reference = alone[PROMPTS[index % len(PROMPTS)]]["choices"][0]["text"]
        if finished:
            assert text == reference, f"request {index}: {text!r} != alone {reference!r}"
        else:
            assert index % ABORT_EVERY == 0 and reference.startswith(text)
    stats = _wait_idle(engine)
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0

    after = _counters(server.base_url)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    prompt_tokens = sum(alone[PROMPTS[i % len(PROMPTS)]]["usage"]["prompt_tokens"] for i in range(NUM_REQUESTS))
    finished_tokens = sum(tokens for _, _, tokens, finished in results if finished)
    dropped = [(tokens, finished) for _, _, tokens, finished in results if not finished]
    assert grew("pagedrag:num_preemptions_total") == 0
    assert grew("pagedrag:prompt_tokens_total") == prompt_tokens
    assert grew("pagedrag:prefix_cache_queries_total") == prompt_tokens
    assert 0 < grew("pagedrag:prefix_cache_hits_total") < prompt_tokens
    assert (finished_tokens + sum(t for t, _ in dropped) <= grew("pagedrag:generation_tokens_total")
            <= finished_tokens + MAX_TOKENS * len(dropped))
    assert grew("pagedrag:time_to_first_token_seconds_count") == NUM_REQUESTS
    # every request ends once, by stop, length or abort (a client gone mid-stream)
    assert grew("pagedrag:request_success_total") == NUM_REQUESTS
    assert grew("pagedrag:e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert _aborted(after) - _aborted(before) <= len(dropped)  # a dropped stream may have ended first
