"""Fuzz the OpenAI-compatible server while canary requests run.

    python benchmarks/fuzz_server.py                               # in-process server, embedded model
    python benchmarks/fuzz_server.py --num-generated 5000 --clients 8 --seed 1
    python benchmarks/fuzz_server.py --base-url http://127.0.0.1:8000 --pid 1234   # a running server

Requests come from three sources and are sent, shuffled together, from --clients threads:

1. hypothesis: bodies for /v1/completions and /v1/chat/completions built from a valid
   body with up to three edits (a field set to a hostile value: wrong type, huge,
   negative or non-finite number, lone surrogate, long list, nesting; an unknown field
   added; a field dropped), and raw bodies (malformed JSON, deep nesting, bytes, odd
   content types and methods). Valid bodies generate at most MAX_GEN_TOKENS tokens.
2. HOSTILE_CASES: requests that once failed every request in flight or stalled the
   server, each with the statuses it must get (check_hostile).
3. schemathesis: positive and negative cases of every operation of the server's own
   /openapi.json.

Meanwhile two canaries loop a greedy completion (one whole, one streamed) whose answer
must never change, and a poller times /health. A 5xx is unexpected unless declared
(DECLARED_5XX), as is a dropped connection or a server error inside a 200 stream.
Afterwards the KV pool must be all free (with an engine in this process) and the RSS
back near where it was after the first --warmup share of the requests (Bounds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

MODEL = "smol"
ENGINE_ARGS = dict(max_model_len=256, num_gpu_blocks_override=96, max_num_seqs=16)
COMPLETIONS, CHAT, WARM = "/v1/completions", "/v1/chat/completions", "/v1/warm"
MAX_GEN_TOKENS = 4  # valid generated bodies generate at most this many tokens per sequence
REQUEST_TIMEOUT_S = 60.0
DECLARED_5XX = frozenset({(503, "queue_full")})  # (status, error code) a client may be told
STREAM_ERROR_STATUS = {"server_error": 500, "service_unavailable_error": 503}  # by OpenAI error type
CANARY_BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
QUICK_S = 5.0  # a body under the size limit whose prompt is too long is refused within this
MiB = 1 << 20

PROMPTS = ("Hello", "The capital of France is", "1, 2, 3,", "Once upon a time")
MAX_VALID_TOKEN_ID = 1000  # token-id prompts of valid bodies use ids up to this
SURROGATES = ("\ud800", "\udbff", "\udc80", "\udfff")
BOUNDARY_INTS = (0, -1, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70,
                 -(2**63), -(2**63) - 1, 10**100, -(10**100))
ODD_FLOATS = (1e-40, -0.0, 5e-324, 1e308, float("inf"), float("-inf"), float("nan"), 0.5, 1.0000001)
ODD_STRINGS = ("", "\x00", "NaN", "1e309", "true", "null", " " * 1000, "\u202e", "<|im_end|>",
               "{{ 7 * 7 }}", "smol\x00", "SMOL")
RAW_BODIES = (b'{"prompt": "x",', b'{"prompt": NaN, "max_tokens": 1}', b'{"prompt": "x", "max_tokens": Infinity}',
              b'\xff\xfe{"prompt": "x"}', b'{"prompt": "\\ud800", "max_tokens": 1}', b"[]", b"null", b'"prompt"',
              b'{"prompt": "x", "prompt": [1], "max_tokens": 1}', b'{"prompt": "\xc3\x28", "max_tokens": 1}',
              b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}', b"{}", b"",
              b'{"prompt": "x", "max_tokens": 1}' + b" " * 100_000)


# ---- requests and what came back ------------------------------------------------
def encode(body: Any) -> bytes:
    """JSON as a client may send it: ASCII with escapes (so a lone surrogate travels as
    ``\\ud800``), NaN and Infinity as Python writes them."""
    return json.dumps(body, ensure_ascii=True).encode("ascii")


@dataclass(frozen=True)
class FuzzRequest:
    """One HTTP request; ``content`` is sent as it is. ``source``: generated,
    schemathesis, canary, health, or hostile:<case name>."""

    source: str
    path: str  # relative to the base URL, or absolute
    content: bytes = b""
    method: str = "POST"
    content_type: str | None = "application/json"
    params: dict = field(default_factory=dict)

    @classmethod
    def post(cls, source: str, path: str, body: Any) -> "FuzzRequest":
        """POST ``body`` as JSON (encode)."""
        return cls(source, path, encode(body))


@dataclass
class Outcome:
    """What one request got: ``status`` None when no response came (dropped, timed out)."""

    request: FuzzRequest
    status: int | None
    seconds: float
    body: str  # the response body, or the transport error
    content_type: str = ""

    @property
    def status_class(self) -> str:
        return "no response" if self.status is None else f"{self.status // 100}xx"

    @property
    def streamed(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    def payloads(self) -> list:
        """The JSON body, or the JSON events of a stream ([DONE] left out); [] if not JSON."""
        try:
            if self.streamed:
                return [json.loads(line[6:]) for line in self.body.splitlines()
                        if line.startswith("data: ") and line != "data: [DONE]"]
            return [json.loads(self.body)]
        except ValueError:
            return []

    def error(self) -> dict | None:
        """The OpenAI error object of an error body, or of an error event inside a stream."""
        for payload in self.payloads():
            if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                return payload["error"]
        return None

    def choice_texts(self) -> list[str]:
        """The text of each choice in index order, whole or streamed, completion or chat."""
        texts: dict[int, str] = {}
        for payload in self.payloads():
            for choice in (payload.get("choices") or []) if isinstance(payload, dict) else []:
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("message") or choice.get("delta") or {}).get("content") or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + piece
        return [texts[index] for index in sorted(texts)]

    def describe(self, limit: int = 300) -> str:
        return f"{self.request.source} {self.request.method} {self.request.path} -> {self.status}: {self.body[:limit]}"


def send(client: httpx.Client, request: FuzzRequest, timeout: float = REQUEST_TIMEOUT_S) -> Outcome:
    """Send ``request``; a transport error (dropped connection, timeout) is an Outcome too."""
    headers = {"Content-Type": request.content_type} if request.content_type else {}
    start = time.monotonic()
    try:
        response = client.request(request.method, request.path, content=request.content or None,
                                  headers=headers, params=request.params, timeout=timeout)
    except httpx.HTTPError as error:
        return Outcome(request, None, time.monotonic() - start, repr(error))
    return Outcome(request, response.status_code, time.monotonic() - start, response.text,
                   response.headers.get("content-type", ""))


def unexpected(outcome: Outcome, declared: frozenset = DECLARED_5XX) -> bool:
    """No response at all, or an undeclared 5xx: as the status, or as an error event
    inside a 200 stream (its type standing for the status, STREAM_ERROR_STATUS)."""
    if outcome.status is None:
        return True
    error = outcome.error() or {}
    status = STREAM_ERROR_STATUS.get(error.get("type"), 200) if outcome.status == 200 else outcome.status
    return status >= 500 and (status, error.get("code")) not in declared


# ---- the hostile requests -----------------------------------------------------------
@dataclass(frozen=True)
class HostileCase:
    """A request that once failed every request in flight or stalled the server.

    ``expect``: the statuses it may get. ``same_as``: a 200 must carry the same choice
    texts as this body gets. ``max_seconds``: the answer must come within this.
    ``body`` may be a callable building the body (large bodies are built when sent).
    """

    name: str
    path: str
    body: Any
    expect: frozenset
    same_as: dict | None = None
    max_seconds: float | None = None

    def payload(self) -> Any:
        return self.body() if callable(self.body) else self.body

    def request(self) -> FuzzRequest:
        return FuzzRequest.post(f"hostile:{self.name}", self.path, self.payload())


def _hello(**fields) -> dict:
    return {"prompt": "Hello", "max_tokens": 5, **fields}


def _chat(content: Any = "Say hi.", role: str = "user", **fields) -> dict:
    return {"messages": [{"role": role, "content": content}], "max_tokens": 5, **fields}


def _template(template: str) -> dict:
    return _chat(chat_template_kwargs={"chat_template": template})


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


HUGE_TEMPLATE = "{{ 'A ' * 3000000 }}"
NESTED_LOOP_TEMPLATE = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
BAD, REFUSED, TOO_LARGE = frozenset({400}), frozenset({400, 404}), frozenset({413})
CLEAN = frozenset({200, 400})  # either answer is right; a 200 must be a correct answer
HOSTILE_CASES = (
    HostileCase("stop_token_ids=1e9,min_tokens", COMPLETIONS, _hello(min_tokens=3, stop_token_ids=[10**9]), BAD),
    HostileCase("stop_token_ids=2**70,min_tokens", COMPLETIONS, _hello(min_tokens=3, stop_token_ids=[2**70]), BAD),
    HostileCase("stop_token_ids=-1e6,min_tokens", COMPLETIONS, _hello(min_tokens=3, stop_token_ids=[-10**6]), BAD),
    HostileCase("seed=2**64-1,n=2", COMPLETIONS, _hello(n=2, seed=2**64 - 1), CLEAN),
    # the vLLM sampling extras added with the drop-in work
    HostileCase("logit_bias=out_of_vocab", COMPLETIONS, _hello(logit_bias={str(10**9): 1.0}), BAD),
    HostileCase("logit_bias=huge_value", COMPLETIONS, _hello(logit_bias={"5": 1e30}), BAD),
    HostileCase("allowed_token_ids=negative", COMPLETIONS, _hello(allowed_token_ids=[-1]), BAD),
    HostileCase("bad_words=lone_surrogate", COMPLETIONS, _hello(bad_words=["\udc80"]), BAD),
    HostileCase("truncate_prompt_tokens=0", COMPLETIONS, _hello(truncate_prompt_tokens=0), BAD),
    HostileCase("prompt_logprobs=1000", COMPLETIONS, _hello(prompt_logprobs=1000), BAD),
    HostileCase("speculative_decoding=string", COMPLETIONS, _hello(speculative_decoding="no"), BAD),
    HostileCase("cache_salt=lone_surrogate", COMPLETIONS,
                {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "cache_salt": "\ud800"}, CLEAN),
    # what today's openai SDK can send that this server cannot honour: refused by name, not dropped
    HostileCase("modalities=audio", CHAT, _chat(modalities=["text", "audio"], audio={"voice": "alloy"}), BAD),
    HostileCase("web_search_options", CHAT, _chat(web_search_options={}), BAD),
    HostileCase("stream_options_without_stream", CHAT, _chat(stream_options={"include_usage": True}), BAD),
    HostileCase("cache_salt=empty", COMPLETIONS, _hello(cache_salt=""), BAD),
    HostileCase("continuous_usage_stats", CHAT,
                _chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}), BAD),
    HostileCase("message_function_call", CHAT, {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]}, BAD),
    HostileCase("chat_template=3M_string", CHAT, _template(HUGE_TEMPLATE), BAD),
    HostileCase("chat_template=nested_loop", CHAT, _template(NESTED_LOOP_TEMPLATE), BAD),
    HostileCase("chat_message=4MB", CHAT, lambda: _chat("hello " * 666_666), BAD, max_seconds=QUICK_S),
    HostileCase("chat_message=4MiB", CHAT, lambda: _chat("x" * (4 * MiB)), TOO_LARGE),
    HostileCase("prompt=20MB", COMPLETIONS, lambda: _hello(prompt="x" * 20_000_000), TOO_LARGE),
    *(HostileCase(f"n={n}", COMPLETIONS, _hello(n=n), BAD) for n in (64, 200, 1000, 100_000)),
    HostileCase("stop=1000x2000_chars", COMPLETIONS,
                lambda: _hello(stop=[f"{i:04d}" + "x" * 1996 for i in range(1000)]), BAD),
    HostileCase("model=lone_surrogate", COMPLETIONS, _hello(model="\udc80"), REFUSED),
    HostileCase("temperature=1e-40", COMPLETIONS, _hello(temperature=1e-40), frozenset({200}),
                same_as=_hello(temperature=0)),
    HostileCase("stream=yes", COMPLETIONS, _hello(stream="yes"), BAD),
    HostileCase("max_tokens=string", COMPLETIONS, {"prompt": "Hello", "max_tokens": "10"}, BAD),
    HostileCase("prompt=bools", COMPLETIONS, _hello(prompt=[True, False]), BAD),
    HostileCase("chat_role=custom", CHAT, _chat(role="wizard"), frozenset({200})),  # the template's, as vLLM
    HostileCase("chat_role=empty", CHAT, _chat(role=""), BAD),
    HostileCase("chat_echo=true", CHAT, _chat(echo=True), BAD),
    HostileCase("echo=false", COMPLETIONS, _hello(echo=False), frozenset({200})),  # the openai SDK's default
    HostileCase("lone_surrogate_key", COMPLETIONS, _hello(logit_bias={"\ud800": 1.0}), BAD),
    HostileCase("allowed_token_ids=empty", COMPLETIONS, _hello(allowed_token_ids=[]), BAD),
    HostileCase("priority=5", COMPLETIONS, _hello(priority=5), BAD),
    HostileCase("grammar=accepts_nothing", CHAT, _chat(structured_outputs={"grammar": "root ::= root"}), BAD),
    HostileCase("chat_user_content=null", CHAT, _chat(content=None), BAD),
    HostileCase("guided_json=array_300_deep", CHAT, lambda: _chat(guided_json=_deep_schema(300)), BAD,
                max_seconds=QUICK_S),
    HostileCase("guided_json=not_a_schema", CHAT, _chat(guided_json={"type": "frobnicate"}), BAD),
    HostileCase("guided_regex=unclosed", COMPLETIONS, _hello(guided_regex="(a"), BAD),
    HostileCase("guided_grammar=undefined_rule", COMPLETIONS, _hello(guided_grammar="root ::= nope"), BAD),
    HostileCase("guided_choice=empty", COMPLETIONS, _hello(guided_choice=[]), BAD),
    HostileCase("response_format=yaml", CHAT, _chat(response_format={"type": "yaml"}), BAD),
    HostileCase("completions.response_format=yaml", COMPLETIONS, _hello(response_format={"type": "yaml"}), BAD),
    HostileCase("completions.response_format_and_guided_regex", COMPLETIONS,
                _hello(response_format={"type": "json_object"}, guided_regex="a"), BAD),
    HostileCase("structured_outputs=two_kinds", CHAT, _chat(structured_outputs={"regex": "a", "choice": ["b"]}), BAD),
    HostileCase("tools=garbage", CHAT, _chat(tools=[{"type": "function", "function": {"name": "a b"}}]), BAD),
    HostileCase("tool_choice=unknown_function", CHAT,
                _chat(tools=[{"type": "function", "function": {"name": "f"}}],
                      tool_choice={"type": "function", "function": {"name": "g"}}), BAD),
    HostileCase("tool_calls=garbage", CHAT,
                {"messages": [{"role": "assistant", "tool_calls": [{"oops": 1}]}], "max_tokens": 5}, BAD),
    # chunk reuse's boundaries (meaningful with --enable-chunk-reuse, validated either way)
    HostileCase("prompt_segments=and_prompt", COMPLETIONS, _hello(prompt_segments=["a", "b"]), BAD),
    HostileCase("prompt_segments=nested_junk", COMPLETIONS,
                {"prompt_segments": [{"token_ids": "abc"}, [[1]]], "max_tokens": 5}, BAD),
    HostileCase("prompt_segments=100k", COMPLETIONS, lambda: {"prompt_segments": ["a"] * 100_000, "max_tokens": 5},
                BAD, max_seconds=QUICK_S),
    HostileCase("prompt_chunks=not_texts", CHAT, _chat(prompt_chunks=[1, {"a": 2}]), BAD),
    HostileCase("prompt_chunks=10k", CHAT, lambda: _chat(prompt_chunks=["x"] * 10_000), BAD, max_seconds=QUICK_S),
    HostileCase("prompt_segments=on_chat", CHAT, _chat(prompt_segments=["a"]), BAD),
    HostileCase("prompt_chunks=token_prompt", COMPLETIONS, {"prompt": [1, 2, 3], "prompt_chunks": ["x"], "max_tokens": 5},
                BAD),
    HostileCase("tool_choice=required,n=3", CHAT,
                _chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required", n=3,
                      max_tokens=40), CLEAN),
    # pagedrag's POST /v1/warm: checked as completions and chats are, counted against the queue
    HostileCase("warm=prompt_and_conversations", WARM, {"prompt": "x", "conversations": [_chat()["messages"]]}, BAD),
    HostileCase("warm=nothing", WARM, {"cache_salt": "x"}, BAD),
    HostileCase("warm=prompt_bools", WARM, {"prompt": [True, False]}, BAD),
    HostileCase("warm=token_ids=2**40", WARM, {"prompt": [[1, 2**40]]}, BAD),
    HostileCase("warm=prompt_chunks_on_token_prompt", WARM, {"prompt": [1, 2, 3], "prompt_chunks": ["x"]}, BAD),
    HostileCase("warm=prompt_segments_and_prompt", WARM, {"prompt": "x", "prompt_segments": ["a"]}, BAD),
    HostileCase("warm=conversation_role_empty", WARM, {"conversations": [_chat(role="")["messages"]]}, BAD),
    HostileCase("warm=conversations_not_lists", WARM, {"conversations": ["hi", {"role": "user"}]}, BAD),
    HostileCase("warm=conversation_empty", WARM, {"conversations": [[]]}, BAD),
    HostileCase("warm=prompts=2000", WARM, lambda: {"prompt": ["x"] * 2000}, BAD, max_seconds=QUICK_S),
    HostileCase("warm=conversations=10k", WARM, lambda: {"conversations": [_chat()["messages"]] * 10_000}, BAD,
                max_seconds=QUICK_S),
    HostileCase("warm=prompt_chunks=10k", WARM, lambda: {"prompt": "x", "prompt_chunks": ["x"] * 10_000}, BAD,
                max_seconds=QUICK_S),
    HostileCase("warm=prompt_over_max_model_len", WARM, lambda: {"prompt": "hello " * 100_000}, BAD,
                max_seconds=QUICK_S),
    HostileCase("warm=prompt=20MB", WARM, lambda: {"prompt": "x" * 20_000_000}, TOO_LARGE),
    HostileCase("warm=model_unknown", WARM, {"model": "SMOL", "prompt": "x"}, frozenset({404})),
    HostileCase("warm=cache_salt=lone_surrogate", WARM, {"prompt": "Hello", "cache_salt": "\ud800"}, CLEAN),
    HostileCase("warm=prompts=256", WARM, lambda: {"prompt": [f"{i} warm" for i in range(256)]},
                frozenset({200, 503})),
)
HOSTILE_BY_NAME = {case.name: case for case in HOSTILE_CASES}


def _expected_choices(body: Any) -> int:
    n = body.get("n", 1) if isinstance(body, dict) else 1
    return n if isinstance(n, int) and not isinstance(n, bool) else 1


def check_hostile(case: HostileCase, outcome: Outcome, client: httpx.Client) -> list[str]:
    """What is wrong with ``outcome`` as the answer to ``case`` ([] if nothing): a status
    outside ``case.expect``, a 4xx without an OpenAI error body, a 200 with the wrong
    number of choices or other texts than ``case.same_as``, or an answer too slow."""
    problems = []
    if outcome.status not in case.expect:
        problems.append(f"{case.name}: expected {sorted(case.expect)}, got {outcome.describe()}")
    if outcome.status is not None and 400 <= outcome.status < 500 and not (outcome.error() or {}).get("message"):
        problems.append(f"{case.name}: a {outcome.status} without an OpenAI error body: {outcome.body[:300]}")
    if outcome.status == 200:
        problems += _check_warm(case, outcome) if case.path == WARM else _check_answer(case, outcome, client)
    if case.max_seconds is not None and outcome.seconds > case.max_seconds:
        problems.append(f"{case.name}: answered in {outcome.seconds:.1f} s, over {case.max_seconds} s")
    return problems


def _check_answer(case: HostileCase, outcome: Outcome, client: httpx.Client) -> list[str]:
    texts, wanted = outcome.choice_texts(), _expected_choices(case.payload())
    if len(texts) != wanted or outcome.error() is not None:
        return [f"{case.name}: a 200 with {len(texts)} choices (wanted {wanted}): {outcome.body[:300]}"]
    if case.same_as is not None:
        reference = send(client, FuzzRequest.post("reference", case.path, case.same_as))
        if reference.choice_texts() != texts:
            return [f"{case.name}: answered {texts}, but {case.same_as} answers {reference.describe()}"]
    return []


def _check_warm(case: HostileCase, outcome: Outcome) -> list[str]:
    """A warm-up's 200: one ``{"object": "warm", ...}`` counting every prompt it was sent."""
    answer, body = (outcome.payloads() or [{}])[0], case.payload()
    prompts = body.get("conversations") or body.get("prompt")
    wanted = len(prompts) if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int) else 1
    if not isinstance(answer, dict) or answer.get("object") != "warm" or answer.get("prompts") != wanted:
        return [f"{case.name}: a 200 that is not a warm-up of {wanted} prompts: {outcome.body[:300]}"]
    return []


# ---- generated requests (hypothesis) ------------------------------------------------
def examples(strategy: st.SearchStrategy, count: int, seed: int) -> list:
    """Up to ``count`` values drawn from ``strategy`` (fewer if it cannot make more),
    the same ones for the same ``seed``."""
    drawn: list = []

    @hypothesis_seed(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
    @given(strategy)
    def collect(value):
        drawn.append(value)

    with contextlib.suppress(Unsatisfiable):
        collect()
    return drawn


def _nested_list(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@functools.cache
def hostile_values() -> st.SearchStrategy:
    """Values a field should not get: any JSON type, boundary and non-finite numbers,
    strings with lone surrogates, nesting, long lists."""
    surrogate_text = st.tuples(st.text(max_size=8), st.sampled_from(SURROGATES), st.text(max_size=8)).map("".join)
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(BOUNDARY_INTS), st.floats(),
                        st.sampled_from(ODD_FLOATS), st.text(max_size=20), surrogate_text,
                        st.sampled_from(ODD_STRINGS))
    nested = st.recursive(scalars, lambda children: st.lists(children, max_size=4)
                          | st.dictionaries(st.text(max_size=6), children, max_size=4), max_leaves=10)
    long_lists = st.builds(lambda item, size: [item] * size, scalars, st.integers(100, 5000))
    deep = st.integers(50, 400).map(_nested_list)  # deeper is sent raw (json.dumps recurses)
    return st.one_of(nested, long_lists, deep)


def _sampling_fields() -> dict[str, st.SearchStrategy]:
    """Valid values of the optional fields both endpoints take."""
    return {
        "model": st.just(MODEL), "n": st.integers(1, 2), "temperature": st.sampled_from([0, 0.7]) | st.floats(0, 2),
        "top_p": st.floats(0.1, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 0.5),
        "seed": st.integers(0, 2**32), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2),
        "stop": st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1, max_size=5), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, MAX_VALID_TOKEN_ID), max_size=3), "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, 1), "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(), "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "cache_salt": st.text(max_size=8), "user": st.text(max_size=8), "speculative_decoding": st.booleans(),
    }


@functools.cache
def _valid_completions() -> st.SearchStrategy:
    prompts = st.one_of(st.sampled_from(PROMPTS), st.lists(st.integers(0, MAX_VALID_TOKEN_ID), min_size=1, max_size=8),
                        st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=2))
    return st.fixed_dictionaries({"prompt": prompts, "max_tokens": st.integers(1, MAX_GEN_TOKENS)},
                                 optional={**_sampling_fields(), "logprobs": st.integers(0, 5)})


@functools.cache
def _valid_chats() -> st.SearchStrategy:
    parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), max_size=2)
    message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                     "content": st.text(max_size=40) | parts})
    return st.fixed_dictionaries(
        {"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": st.integers(1, MAX_GEN_TOKENS)},
        optional={**_sampling_fields(), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3),
                  "max_completion_tokens": st.integers(1, MAX_GEN_TOKENS), "add_generation_prompt": st.booleans()})


EDITS = ("set", "set", "add", "drop")
ALWAYS_SET = ("model", "n", "prompt", "messages", "max_tokens")  # fields an edit may set even when absent


def _edit(draw: Callable, body: dict) -> dict:
    """``body`` with up to three edits: a field set to a hostile value (one of its own
    or of ALWAYS_SET), an unknown field added, a field dropped."""
    body = dict(body)
    for _ in range(draw(st.integers(0, 3))):
        edit = draw(st.sampled_from(EDITS))
        if edit == "set":
            body[draw(st.sampled_from(sorted({*body, *ALWAYS_SET})))] = draw(hostile_values())
        elif edit == "add":
            body[draw(st.text(max_size=12))] = draw(hostile_values())
        elif body:
            del body[draw(st.sampled_from(sorted(body)))]
    return body


@st.composite
def completion_bodies(draw) -> dict:
    """A valid completion body, edited by _edit."""
    return _edit(draw, draw(_valid_completions()))


@st.composite
def chat_bodies(draw) -> dict:
    """A valid chat body, edited by _edit, its first message too (half of the time)."""
    body = draw(_valid_chats())
    if draw(st.booleans()):
        body["messages"] = [_edit(draw, body["messages"][0]), *body["messages"][1:]]
    return _edit(draw, body)


@functools.cache
def raw_requests() -> st.SearchStrategy:
    """Bodies no JSON encoder writes: malformed, deeply nested, bytes; odd content types and methods."""
    deep = st.integers(1000, 200_000).map(lambda depth: b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}")
    content = st.one_of(st.binary(max_size=64), deep, st.sampled_from(RAW_BODIES))
    content_type = st.sampled_from(("application/json", "application/json", "text/plain", None,
                                    "application/x-www-form-urlencoded", "application/json; charset=latin-1"))
    method = st.sampled_from(("POST", "POST", "POST", "GET", "PUT"))
    return st.builds(FuzzRequest, st.just("generated"), st.sampled_from((COMPLETIONS, CHAT)), content, method,
                     content_type)


def bounded(body: Any) -> Any:
    """``body`` generating at most MAX_GEN_TOKENS tokens per sequence, so that a run stays
    fast: an absent or null max_tokens, or a valid larger one, is lowered (as is a larger
    max_completion_tokens); hostile values are kept."""
    if not isinstance(body, dict):
        return body

    def too_many(value: Any) -> bool:
        return type(value) is int and MAX_GEN_TOKENS < value < 2**63

    body = dict(body)
    if body.get("max_tokens") is None or too_many(body["max_tokens"]):
        body["max_tokens"] = MAX_GEN_TOKENS
    if too_many(body.get("max_completion_tokens")):
        body["max_completion_tokens"] = MAX_GEN_TOKENS
    return body


@functools.cache
def generated_requests() -> st.SearchStrategy:
    """9 completion bodies to 9 chat bodies to 2 raw requests."""
    def posted(path: str, bodies: st.SearchStrategy) -> st.SearchStrategy:
        return bodies.map(lambda body: FuzzRequest.post("generated", path, bounded(body)))

    kinds = (posted(COMPLETIONS, completion_bodies()),) * 9 + (posted(CHAT, chat_bodies()),) * 9 \
        + (raw_requests(),) * 2
    return st.sampled_from(kinds).flatmap(lambda kind: kind)


# ---- schemathesis -------------------------------------------------------------------
def schemathesis_requests(base_url: str, examples_per_operation: int, seed: int) -> list[FuzzRequest]:
    """Positive and negative cases of every operation of the server's /openapi.json, up to
    ``examples_per_operation`` of each (JSON bodies bounded as generated ones are)."""
    import schemathesis

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    requests = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in schemathesis.GenerationMode:
            strategy = operation.as_strategy(generation_mode=mode).map(functools.partial(_case_request, base_url))
            requests += examples(strategy, examples_per_operation, seed)
    return requests


def _case_request(base_url: str, case) -> FuzzRequest:
    """The FuzzRequest of a schemathesis Case."""
    kwargs = case.as_transport_kwargs(base_url=base_url)
    if "json" in kwargs:
        content = encode(bounded(kwargs["json"]))
    else:
        data = kwargs.get("data") or b""
        content = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    headers = {name.lower(): value for name, value in (kwargs.get("headers") or {}).items()}
    return FuzzRequest("schemathesis", kwargs["url"], content, kwargs["method"], headers.get("content-type"),
                       dict(kwargs.get("params") or {}))


# ---- canaries and the /health poller ----------------------------------------------
class _Loop:
    """A daemon thread sending ``request`` every ``pause`` seconds until stopped; it
    records each latency, and each outcome ``failed`` rejects."""

    def __init__(self, base_url: str, name: str, request: FuzzRequest, pause: float = 0.0):
        self.name, self.request, self.pause = name, request, pause
        self.client = httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.last_start = float("-inf")  # when the last finished request was sent (monotonic)
        self._stop_after = float("inf")
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, after: float = float("-inf")) -> None:
        """Stop once a request sent at or after ``after`` (monotonic) has finished; by
        default once the request in flight has."""
        self._stop_after = after
        self._wake.set()
        self._thread.join(2 * REQUEST_TIMEOUT_S)
        self.client.close()

    def failed(self, outcome: Outcome) -> bool:
        return outcome.status != 200

    def _run(self) -> None:
        while self.last_start < self._stop_after:
            started = time.monotonic()
            outcome = send(self.client, self.request)
            self.latencies.append(outcome.seconds)
            if self.failed(outcome):
                self.failures.append(f"{self.name}: {outcome.describe()}")
            self.last_start = started
            self._wake.wait(self.pause)


class Canary(_Loop):
    """Loops the greedy CANARY_BODY (whole or streamed); every answer must be ``expected``."""

    def __init__(self, base_url: str, expected: str, stream: bool):
        super().__init__(base_url, f"canary-{'stream' if stream else 'whole'}",
                         FuzzRequest.post("canary", COMPLETIONS, {**CANARY_BODY, "stream": stream}))
        self.expected = expected

    def failed(self, outcome: Outcome) -> bool:
        return outcome.status != 200 or outcome.error() is not None or outcome.choice_texts() != [self.expected]


def health_poller(base_url: str, interval: float = 0.1) -> _Loop:
    """GET /health every ``interval`` seconds; anything but a 200 is a failure."""
    return _Loop(base_url, "health-poller", FuzzRequest("health", "/health", method="GET", content_type=None),
                 pause=interval)


def canary_answer(base_url: str) -> str:
    """The answer of the first canary request: what every later one must get."""
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        outcome = send(client, FuzzRequest.post("canary", COMPLETIONS, CANARY_BODY))
    if outcome.status != 200 or len(outcome.choice_texts()) != 1:
        raise RuntimeError(f"the first canary request failed: {outcome.describe()}")
    return outcome.choice_texts()[0]


@dataclass(frozen=True)
class Bounds:
    """What a run may not exceed."""

    canary_s: float = 20.0  # a canary request's latency (the worst stall)
    health_s: float = 2.0  # a /health answer's latency
    rss_growth_mb: float = 300.0  # RSS after the run over RSS after the warm-up (run_fuzz)


@dataclass
class WatchReport:
    canary_requests: int
    canary_failures: list[str]
    worst_canary_s: float
    health_polls: int
    health_failures: list[str]
    worst_health_s: float

    def problems(self, bounds: Bounds) -> list[str]:
        """Canary and /health failures, and latencies over ``bounds``."""
        return [*self.canary_failures, *self.health_failures,
                *_over("worst canary latency", self.worst_canary_s, bounds.canary_s, "s"),
                *_over("worst /health latency", self.worst_health_s, bounds.health_s, "s")]


def _over(what: str, value: float | None, bound: float, unit: str) -> list[str]:
    return [] if value is None or value < bound else [f"{what} {value:.2f} {unit}, over {bound} {unit}"]


def pool_problems(stats: dict) -> list[str]:
    """[] if every KV block is free in these engine stats (taken when idle)."""
    free, total = stats.get("num_free_blocks"), stats.get("num_gpu_blocks")
    return [] if free == total else [f"the KV pool is not all free when idle: {free} of {total} blocks free"]


class Watch:
    """Two canaries (one whole, one streamed) and a /health poller, while a block runs:
    ``with Watch(url, expected) as watch: ...``, then ``watch.report``."""

    def __init__(self, base_url: str, expected: str):
        self.canaries = [Canary(base_url, expected, stream) for stream in (False, True)]
        self.health = health_poller(base_url)
        self.report: WatchReport | None = None

    def __enter__(self) -> "Watch":
        for loop in (*self.canaries, self.health):
            loop.start()
        return self

    def settle(self) -> None:
        """Stop the canaries once each has finished a request sent after this call (the
        /health poller runs on until the block ends)."""
        now = time.monotonic()
        for canary in self.canaries:
            canary.stop(after=now)

    def __exit__(self, *exc) -> None:
        for loop in (*self.canaries, self.health):
            loop.stop()
        latencies = [s for canary in self.canaries for s in canary.latencies]
        self.report = WatchReport(
            canary_requests=len(latencies), canary_failures=[f for c in self.canaries for f in c.failures],
            worst_canary_s=max(latencies, default=0.0), health_polls=len(self.health.latencies),
            health_failures=self.health.failures, worst_health_s=max(self.health.latencies, default=0.0))


# ---- the engine and the process -----------------------------------------------------
def engine_stats(engine) -> dict:
    """``LLMEngine.stats()``, read on the engine thread between two steps (through the
    AsyncLLMEngine API of either side of the change to an async ``stats()``)."""
    if hasattr(engine, "submit"):
        return engine.submit(engine.engine.stats).result(timeout=60)
    return asyncio.run(asyncio.wait_for(engine.stats(), 60))


def wait_idle(engine, timeout: float = 60.0) -> dict:
    """The engine stats once no request is in flight and every KV block is free, or when
    ``timeout`` runs out (the caller checks)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(engine)
        idle = engine.num_in_flight == 0 and stats["num_free_blocks"] == stats["num_gpu_blocks"]
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def rss_mb(pid: int) -> float | None:
    """Resident memory of a process in MiB (Linux /proc; None elsewhere)."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / MiB


@contextlib.contextmanager
def serve_embedded(**config) -> Iterator[tuple[Any, Any]]:
    """(engine, BackgroundServer) on the embedded model with ENGINE_ARGS; ``config``:
    ServerConfig fields besides the model name."""
    from pagedrag import EngineArgs
    from pagedrag.entrypoints.async_engine import AsyncLLMEngine
    from pagedrag.server.app import build_app
    from pagedrag.server.background import BackgroundServer
    from pagedrag.server.serving import ServerConfig

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(**ENGINE_ARGS))
    try:
        with BackgroundServer(build_app(engine, ServerConfig(served_model_names=[MODEL], **config))) as server:
            yield engine, server
    finally:
        engine.shutdown()


# ---- the run ----------------------------------------------------------------------
@dataclass
class FuzzReport:
    requests_tried: int
    requests_skipped: int  # not sent: the time limit ran out
    by_source: dict[str, Counter]  # source (hostile cases together) -> status class -> count
    unexpected: list[str]  # undeclared 5xx, no response, server errors in streams (with bodies)
    hostile_problems: list[str]  # hostile cases not answered as HOSTILE_CASES says
    watch: WatchReport
    kv_free_blocks: int | None  # when idle after the run; None without an engine
    kv_total_blocks: int | None
    rss_before_mb: float | None
    rss_after_mb: float | None
    seconds: float

    @property
    def by_class(self) -> Counter:
        return sum(self.by_source.values(), Counter())

    @property
    def rss_growth_mb(self) -> float | None:
        if self.rss_before_mb is None or self.rss_after_mb is None:
            return None
        return self.rss_after_mb - self.rss_before_mb

    def problems(self, bounds: Bounds) -> list[str]:
        """Everything the run got wrong: unexpected outcomes, hostile cases not answered as
        expected, skipped requests, canary and /health failures or latencies, a KV pool
        not all free, and RSS growth, against ``bounds``."""
        skipped = [f"{self.requests_skipped} requests not sent: the time limit ran out"] * bool(self.requests_skipped)
        pool = pool_problems({"num_free_blocks": self.kv_free_blocks, "num_gpu_blocks": self.kv_total_blocks})
        return [*self.unexpected, *self.hostile_problems, *skipped, *self.watch.problems(bounds), *pool,
                *_over("RSS growth", self.rss_growth_mb, bounds.rss_growth_mb, "MiB")]

    def markdown(self, bounds: Bounds, max_listed: int = 20) -> str:
        """The figures, the status classes by source, then the problems (the first ``max_listed``)."""
        problems = self.problems(bounds)
        listed = ["", f"problems ({len(problems)}):", *(f"- {p}" for p in problems[:max_listed])] if problems else []
        return "\n".join([*self._figures(), "", *self._sources(), *listed])

    def _figures(self) -> list[str]:
        classes = self.by_class
        watch = self.watch
        rows = [
            ("requests tried", f"{self.requests_tried} in {self.seconds:.0f} s"
                               + (f" ({self.requests_skipped} skipped: time limit)" if self.requests_skipped else "")),
            ("2xx / 4xx / 5xx / no response",
             " / ".join(str(classes[c]) for c in ("2xx", "4xx", "5xx", "no response"))),
            ("unexpected (5xx, dropped, stream errors)", str(len(self.unexpected))),
            ("hostile cases not as expected", f"{len(self.hostile_problems)} of {len(HOSTILE_CASES)}"),
            ("canary requests / failures", f"{watch.canary_requests} / {len(watch.canary_failures)}"),
            ("worst canary latency", f"{watch.worst_canary_s:.2f} s"),
            ("/health polls / failures / worst", f"{watch.health_polls} / {len(watch.health_failures)} / "
                                                 f"{watch.worst_health_s:.2f} s"),
            ("KV free blocks when idle", f"{self.kv_free_blocks} / {self.kv_total_blocks}"),
            ("RSS before -> after", f"{_mb(self.rss_before_mb)} -> {_mb(self.rss_after_mb)}"),
        ]
        return ["| figure | value |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]

    def _sources(self) -> list[str]:
        classes = ("2xx", "3xx", "4xx", "5xx", "no response")
        return [f"| source | {' | '.join(classes)} |", "|---" * (len(classes) + 1) + "|",
                *(f"| {source} | {' | '.join(str(counts[c]) for c in classes)} |"
                  for source, counts in sorted(self.by_source.items()))]


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} MiB"


def build_requests(base_url: str, num_generated: int, seed: int, schemathesis_examples: int,
                   hostile: bool) -> list[FuzzRequest]:
    """Every request of a run, shuffled (the same order for the same seed)."""
    requests = examples(generated_requests(), num_generated, seed)
    if schemathesis_examples:
        requests += schemathesis_requests(base_url, schemathesis_examples, seed)
    if hostile:
        requests += [case.request() for case in HOSTILE_CASES]
    random.Random(seed).shuffle(requests)
    return requests


def dispatch(base_url: str, requests: Iterable[FuzzRequest], num_clients: int,
             deadline: float | None) -> list[Outcome]:
    """Send ``requests`` from ``num_clients`` threads; those not sent by ``deadline``
    (monotonic) are left out."""
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)
    with httpx.Client(base_url=base_url, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        def one(request: FuzzRequest) -> Outcome | None:
            return None if deadline is not None and time.monotonic() > deadline else send(client, request)

        with ThreadPoolExecutor(num_clients, thread_name_prefix="fuzz-client") as pool:
            return [outcome for outcome in pool.map(one, requests) if outcome is not None]


def hostile_problems(base_url: str, outcomes: Iterable[Outcome]) -> list[str]:
    """check_hostile of every outcome of a hostile case."""
    prefix = "hostile:"
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        return [problem for o in outcomes if o.request.source.startswith(prefix)
                for problem in check_hostile(HOSTILE_BY_NAME[o.request.source.removeprefix(prefix)], o, client)]


def settled_rss_mb(pid: int | None) -> float | None:
    """RSS after a garbage collection; None without a pid."""
    gc.collect()
    return rss_mb(pid) if pid else None


def run_fuzz(base_url: str, num_generated: int, seed: int = 0, *, num_clients: int = 8,
             schemathesis_examples: int = 50, hostile: bool = True, warmup: float = 0.25, engine=None,
             rss_pid: int | None = None, time_limit_s: float | None = None,
             declared_5xx: frozenset = DECLARED_5XX) -> FuzzReport:
    """Fuzz the server at ``base_url`` with ``num_generated`` hypothesis requests,
    ``schemathesis_examples`` per schemathesis operation and mode, and (``hostile``)
    HOSTILE_CASES, while a Watch runs.

    The RSS is read after the first ``warmup`` share of the requests (per-thread state and
    per-shape kernel caches are built lazily: RSS grows towards a plateau) and once the
    engine is idle at the end. ``engine``: the AsyncLLMEngine behind the server when it
    runs in this process (for the KV pool check; the RSS is then this process's, else
    ``rss_pid``'s). ``time_limit_s``: requests not sent by then are skipped.
    """
    requests = build_requests(base_url, num_generated, seed, schemathesis_examples, hostile)
    num_warmup = int(len(requests) * warmup)
    pid = os.getpid() if engine is not None else rss_pid
    start = time.monotonic()
    deadline = None if time_limit_s is None else start + time_limit_s
    with Watch(base_url, canary_answer(base_url)) as watch:
        outcomes = dispatch(base_url, requests[:num_warmup], num_clients, deadline)
        rss_before = settled_rss_mb(pid)
        outcomes += dispatch(base_url, requests[num_warmup:], num_clients, deadline)
        problems = hostile_problems(base_url, outcomes)
        watch.settle()
    seconds = time.monotonic() - start
    stats = wait_idle(engine) if engine is not None else {}
    skipped = len(requests) - len(outcomes)
    by_source: dict[str, Counter] = {}
    for outcome in outcomes:
        by_source.setdefault(outcome.request.source.split(":")[0], Counter())[outcome.status_class] += 1
    return FuzzReport(
        requests_tried=len(outcomes), requests_skipped=skipped, by_source=by_source,
        unexpected=[o.describe(1000) for o in outcomes if unexpected(o, declared_5xx)],
        hostile_problems=problems, watch=watch.report, kv_free_blocks=stats.get("num_free_blocks"),
        kv_total_blocks=stats.get("num_gpu_blocks"), rss_before_mb=rss_before,
        rss_after_mb=settled_rss_mb(pid), seconds=seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-generated", type=int, default=3000, help="hypothesis requests (default: %(default)s)")
    parser.add_argument("--schemathesis-examples", type=int, default=100,
                        help="schemathesis cases per operation and mode (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent client threads (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=float, default=0.25,
                        help="share of the requests sent before the starting RSS is read (default: %(default)s)")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds; later requests are skipped")
    parser.add_argument("--no-hostile", action="store_true", help="leave HOSTILE_CASES out")
    parser.add_argument("--base-url", default=None, help="fuzz a running server instead of an in-process one")
    parser.add_argument("--pid", type=int, default=None, help="with --base-url: the server's pid, for its RSS")
    parser.add_argument("--verbose", action="store_true", help="keep pagedrag's warnings (one per odd request)")
    args = parser.parse_args(argv)
    if not args.verbose:
        logging.getLogger("pagedrag").setLevel(logging.ERROR)
    run = functools.partial(run_fuzz, num_generated=args.num_generated, seed=args.seed, num_clients=args.clients,
                            schemathesis_examples=args.schemathesis_examples, hostile=not args.no_hostile,
                            warmup=args.warmup, time_limit_s=args.time_limit)
    if args.base_url:
        report = run(args.base_url, rss_pid=args.pid)
    else:
        with serve_embedded() as (engine, server):
            report = run(server.base_url, engine=engine)
    print(report.markdown(Bounds()))
    return 0 if not report.problems(Bounds()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
