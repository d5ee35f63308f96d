"""The remote back end: a ``pagedrag serve`` (or any OpenAI-compatible server that reports
``usage.prompt_tokens_details.cached_tokens``) through the official openai SDK. A call's
``chunks`` travel as pagedrag's ``prompt_chunks``, and the chunk-reuse and KV-tier figures come
from pagedrag's keys in ``prompt_tokens_details`` (0 from a server without them).

The SDK retries with backoff on connection errors and on 408/409/429/5xx answers (the
server's 503 when its --max-queue is full included), pools connections, and types its
errors; here they become what the in-process client raises: ValueError for bad input
(400), RemoteError for anything else. vLLM's extras (cache_salt, top_k, ...) travel in
``extra_body``, each only where it differs from SamplingParams' default (the server's
defaults mean the same); ``n`` and ``logprobs`` are named as each route names them; the
engine's counters come from the server's JSON ``/v1/stats``, a warm-up goes to pagedrag's
``/v1/warm``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai

from pagedrag.sampling_params import SamplingParams
from pagedrag.server.protocol import MAX_PROMPTS_PER_REQUEST
from pagedrag.client.types import (EngineClient, EngineInfo, Generation, Prompt, TokenLogprob, ToolRequest,
                                   WarmSummary, tier_hits)
from pagedrag.text_checks import check_utf8_within
from pagedrag.tools import ToolCall

# SamplingParams fields that the SDK's create() names, always sent; the others are extras
_OPENAI_FIELDS = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "stop",
                  "max_tokens")
_ROUTE_FIELDS = ("logprobs",)  # named differently by the two routes (see _logprobs_body)
# Read by the client itself (its streams are pieces of its own) or by nothing (plugins' extra_args):
# never sent to the server
_CLIENT_FIELDS = ("output_kind", "extra_args")
_DEFAULTS = dataclasses.asdict(SamplingParams())
# The SDK wants a key; a server without --api-key ignores it (vLLM's documented placeholder).
# Never left to the SDK: it would send the OPENAI_API_KEY of the environment to this server.
NO_API_KEY = "EMPTY"


class RemoteError(RuntimeError):
    """The server answered with an error other than bad input (which raises ValueError), or
    did not answer; ``status_code`` is the HTTP status, None without one."""

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(message)
        self.status_code = status_code


class RemoteClient(EngineClient):
    """A client of an OpenAI-compatible server at ``base_url`` (with or without ``/v1``).

    Invariant: each event loop has its own AsyncOpenAI (pooled connections belong to the
    loop that opened them); synchronous calls all run on the bridge's one loop.
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, max_retries: int = openai.DEFAULT_MAX_RETRIES,
                 headers: dict[str, str] | None = None):
        self.base_url = base_url.rstrip("/").removesuffix("/v1") + "/v1"
        self.model = model
        self._settings = {"base_url": self.base_url, "api_key": api_key or NO_API_KEY,
                          "timeout": timeout, "max_retries": max_retries, "default_headers": headers}
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, openai.AsyncOpenAI] = (
            weakref.WeakKeyDictionary())
        self._clients_lock = threading.Lock()
        self._info: EngineInfo | None = None  # what /v1/models said; it does not change

    async def _generate(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None,
                        tools: ToolRequest | None = None, chunks: tuple[str, ...] | None = None) -> Generation:
        with _translated_errors():
            response = await self._create(prompt, params, cache_salt, stream=False, tools=tools, chunks=chunks)
        first, *more = (_choice(choice, isinstance(prompt, str))
                        for choice in sorted(response.choices, key=lambda choice: choice.index))
        return _with_usage(dataclasses.replace(first, more=tuple(more)), response.usage)

    async def _stream(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None,
                      tools: ToolRequest | None = None, chunks: tuple[str, ...] | None = None
                      ) -> AsyncIterator[Generation]:
        finish_reason, usage, completion = None, None, isinstance(prompt, str)
        calls = _StreamedCalls()
        with _translated_errors():
            stream = await self._create(prompt, params, cache_salt, stream=True, tools=tools, chunks=chunks)
            try:
                async for chunk in stream:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        finish_reason = choice.finish_reason or finish_reason
                        text = choice.text if completion else choice.delta.content
                        if not completion:
                            calls.add(choice.delta.tool_calls)
                        logprobs = _logprobs(choice.logprobs, completion, params.logprobs)
                        if text or logprobs:
                            yield Generation(text or "", logprobs=logprobs)
            finally:
                await stream.close()  # closing early drops the connection: the server aborts
        empty = None if params.logprobs is None else ()
        yield _with_usage(Generation("", finish_reason, logprobs=empty, tool_calls=calls.whole()), usage)

    async def _warm(self, prompts: list[Prompt], cache_salt: str | None,
                    chunks: tuple[str, ...] | None) -> WarmSummary:
        """POST /v1/warm for the texts and for the conversations (the route takes one kind a
        call), at most MAX_PROMPTS_PER_REQUEST prompts a call, one call after another; their
        figures added up."""
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        conversations = [prompt for prompt in prompts if not isinstance(prompt, str)]
        model = await self._model_name()
        summaries = [await self._post_warm({"model": model, field: kind[start:start + MAX_PROMPTS_PER_REQUEST],
                                            **_salt_and_chunks(cache_salt, chunks)})
                     for field, kind in (("prompt", texts), ("conversations", conversations))
                     for start in range(0, len(kind), MAX_PROMPTS_PER_REQUEST)]
        return sum(summaries, WarmSummary())

    async def _post_warm(self, body: dict[str, Any]) -> WarmSummary:
        with _translated_errors():
            answer = (await self._openai().post("warm", body=body, cast_to=httpx.Response)).json()
        return WarmSummary(answer["prompts"], answer["prompt_tokens"], answer["cached_tokens"])

    async def _model_name(self) -> str:
        """The model a request names: the client's, else the first one the server serves."""
        return self.model if self.model is not None else (await self.ainfo()).model_name

    async def atokenize(self, text: str) -> list[int]:
        """Through the server's /tokenize (as vLLM serves it, beside /v1)."""
        check_utf8_within(text, "text")
        body = {"model": await self._model_name(), "prompt": text, "add_special_tokens": False}
        with _translated_errors():
            response = await self._openai().post(self.base_url.removesuffix("/v1") + "/tokenize", body=body,
                                                 cast_to=httpx.Response)
            return response.json()["tokens"]

    @property
    def known_model_name(self) -> str | None:
        return self.model if self.model is not None else (None if self._info is None else self._info.model_name)

    async def astats(self) -> dict[str, Any]:
        with _translated_errors():
            # the raw response, then its JSON: a bare ``dict`` cast fails in openai 2.x
            response = await self._openai().get("stats", cast_to=httpx.Response)
            return response.json()

    async def ainfo(self) -> EngineInfo:
        if self._info is None:
            with _translated_errors():
                cards = (await self._openai().models.list()).data
            card = next((c for c in cards if c.id == self.model), cards[0])
            self._info = EngineInfo(card.id, card.model_extra["max_model_len"])
        return self._info

    async def _create(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None, stream: bool,
                      tools: ToolRequest | None = None, chunks: tuple[str, ...] | None = None):
        """A completion (text) or chat (messages) request through the SDK; text that is not
        UTF-8 is refused here, as the engine refuses it (the SDK could not send it)."""
        check_utf8_within(prompt, "prompt" if isinstance(prompt, str) else "messages")
        options = {"model": await self._model_name(), "stream": stream, **_sampling_body(params, cache_salt, chunks),
                   **_logprobs_body(params.logprobs, completion=isinstance(prompt, str))}
        if stream:
            options["stream_options"] = {"include_usage": True}
        client = self._openai()
        if isinstance(prompt, str):
            if tools is not None:
                raise ValueError("tools need a chat (a list of messages), not a text prompt")
            return await client.completions.create(prompt=prompt, **options)
        return await client.chat.completions.create(messages=prompt, **options, **_tools_body(tools))

    def _openai(self) -> openai.AsyncOpenAI:
        """The running event loop's SDK client."""
        loop = asyncio.get_running_loop()
        with self._clients_lock:
            client = self._clients.get(loop)
            if client is None:
                client = self._clients[loop] = openai.AsyncOpenAI(**self._settings)
            return client


def _sampling_body(params: SamplingParams, cache_salt: str | None,
                   chunks: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The SDK's named sampling arguments, and ``extra_body`` with the extras that differ
    from their defaults (and the salt and the chunks, if any)."""
    fields = dataclasses.asdict(params)
    if not params.detokenize:
        raise ValueError("detokenize=False needs an in-process engine: a server's answers are text")
    extras = {name: value for name, value in fields.items()
              if name not in (*_OPENAI_FIELDS, *_ROUTE_FIELDS, *_CLIENT_FIELDS) and value != _DEFAULTS[name]}
    return {**{name: fields[name] for name in _OPENAI_FIELDS},
            "extra_body": {**extras, **_salt_and_chunks(cache_salt, chunks)}}


def _salt_and_chunks(cache_salt: str | None, chunks: tuple[str, ...] | None) -> dict[str, Any]:
    """The request's cache_salt and chunks (pagedrag's prompt_chunks), those that were given."""
    extras = {"cache_salt": cache_salt, "prompt_chunks": None if chunks is None else list(chunks)}
    return {name: value for name, value in extras.items() if value is not None}


def _tools_body(tools: ToolRequest | None) -> dict[str, Any]:
    """The chat's tools, tool_choice and parallel_tool_calls, those that were given."""
    if tools is None:
        return {}
    body = {"tools": tools.tools, "tool_choice": tools.tool_choice, "parallel_tool_calls": tools.parallel_tool_calls}
    return {name: value for name, value in body.items() if value is not None}


class _StreamedCalls:
    """Tool calls as a chat stream sends them: pieces by index (id and name first, then the
    arguments' text in parts), joined once the stream ends."""

    def __init__(self):
        self._calls: dict[int, dict[str, str]] = {}

    def add(self, pieces) -> None:
        for piece in pieces or ():
            call = self._calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            if piece.function is not None:
                call["name"] = piece.function.name or call["name"]
                call["arguments"] += piece.function.arguments or ""

    def whole(self) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(call["id"], call["name"], call["arguments"])
                     for _, call in sorted(self._calls.items()))


def _logprobs_body(top: int | None, completion: bool) -> dict[str, Any]:
    """SamplingParams.logprobs as each route asks for it: /v1/completions ``logprobs=k``,
    /v1/chat/completions ``logprobs=true, top_logprobs=k``."""
    if top is None:
        return {}
    return {"logprobs": top} if completion else {"logprobs": True, "top_logprobs": top}


def _choice(choice, completion: bool) -> Generation:
    """One choice of a whole response (prompt figures come from the usage)."""
    text = choice.text if completion else choice.message.content or ""
    calls = () if completion else tuple(ToolCall(call.id, call.function.name, call.function.arguments)
                                        for call in choice.message.tool_calls or ())
    return Generation(text, choice.finish_reason, logprobs=_logprobs(choice.logprobs, completion, None),
                      tool_calls=calls)


def _logprobs(logprobs, completion: bool, asked: int | None) -> tuple[TokenLogprob, ...] | None:
    """A choice's logprobs (either route's shape) as TokenLogprobs; without any: None, or
    ``()`` when ``asked`` says they were asked for (a stream piece without tokens)."""
    if logprobs is None:
        return None if asked is None else ()
    return _completion_logprobs(logprobs) if completion else _chat_logprobs(logprobs)


def _completion_logprobs(logprobs) -> tuple[TokenLogprob, ...]:
    """/v1/completions' parallel lists: tokens, token_logprobs, top_logprobs (dicts)."""
    tokens = logprobs.tokens or []
    tops = logprobs.top_logprobs or [{}] * len(tokens)
    return tuple(TokenLogprob(token, float("-inf") if logprob is None else logprob,
                              tuple(sorted((top or {}).items(), key=lambda item: -item[1])))
                 for token, logprob, top in zip(tokens, logprobs.token_logprobs or [], tops))


def _chat_logprobs(logprobs) -> tuple[TokenLogprob, ...]:
    """/v1/chat/completions' entries: token, logprob, top_logprobs [{token, logprob}]."""
    return tuple(TokenLogprob(entry.token, entry.logprob, tuple((top.token, top.logprob) for top in entry.top_logprobs))
                 for entry in logprobs.content or [])


def _with_usage(generation: Generation, usage) -> Generation:
    """The generation with the token counts of the response's usage (if it had one); a
    count the server did not report is 0. pagedrag's keys in ``prompt_tokens_details``
    (chunk figures, ``tier_cache_hits``) are fields the SDK does not know, which it keeps
    as attributes."""
    if usage is None:
        return generation
    details = usage.prompt_tokens_details

    def detail(name: str) -> int:
        return getattr(details, name, None) or 0

    return dataclasses.replace(generation, prompt_tokens=usage.prompt_tokens,
                               completion_tokens=usage.completion_tokens, cached_tokens=detail("cached_tokens"),
                               chunk_cache_hits=detail("chunk_cache_hits"),
                               chunk_tokens_recomputed=detail("chunk_tokens_recomputed"),
                               tier_cache_hits=tier_hits(getattr(details, "tier_cache_hits", None)))


@contextlib.contextmanager
def _translated_errors() -> Iterator[None]:
    """The SDK's errors as the client raises them: ValueError for bad input, RemoteError else."""
    try:
        yield
    except openai.APIError as error:
        raise _translated(error) from error


def _translated(error: openai.APIError) -> Exception:
    """A 400, or an invalid_request_error event inside a stream (whose status said 200),
    is bad input; anything else (other statuses, no answer) is a RemoteError."""
    body = error.body if isinstance(error.body, dict) else {}
    message = body.get("message") or error.message
    status = getattr(error, "status_code", None)
    if status == 400 or (status is None and body.get("type") == "invalid_request_error"):
        return ValueError(message)
    return RemoteError(f"pagedrag server error ({status or body.get('type') or 'no answer'}): {message}", status)
