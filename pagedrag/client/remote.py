"""The remote back end: a ``pagedrag serve`` (or any OpenAI-compatible server that reports
``usage.prompt_tokens_details.cached_tokens``) through the official openai SDK.

The SDK retries with backoff on connection errors and on 408/409/429/5xx answers (the
server's 503 when its --max-queue is full included), pools connections, and types its
errors; here they become what the in-process client raises: ValueError for bad input
(400), RemoteError for anything else. vLLM's extras (cache_salt, top_k, ...) travel in
``extra_body``, each only where it differs from SamplingParams' default (the server's
defaults mean the same); the engine's counters come from the server's JSON ``/v1/stats``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai

from pagedrag.sampling_params import SamplingParams
from pagedrag.client.types import EngineClient, EngineInfo, Generation, Prompt, check_single

# SamplingParams fields that the SDK's create() names, always sent; the others are extras
_OPENAI_FIELDS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "stop", "max_tokens")
_NOT_SENT = ("n", "logprobs")  # one choice per request (check_single); a Generation holds no logprobs
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
                 timeout: float = 600.0, max_retries: int = openai.DEFAULT_MAX_RETRIES):
        self.base_url = base_url.rstrip("/").removesuffix("/v1") + "/v1"
        self.model = model
        self._settings = {"base_url": self.base_url, "api_key": api_key or NO_API_KEY,
                          "timeout": timeout, "max_retries": max_retries}
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, openai.AsyncOpenAI] = (
            weakref.WeakKeyDictionary())
        self._clients_lock = threading.Lock()
        self._info: EngineInfo | None = None  # what /v1/models said; it does not change

    async def agenerate(self, prompt: Prompt, params: SamplingParams,
                        cache_salt: str | None = None) -> Generation:
        with _translated_errors():
            response = await self._create(prompt, params, cache_salt, stream=False)
        choice = response.choices[0]
        text = choice.text if isinstance(prompt, str) else choice.message.content or ""
        return _with_usage(Generation(text, choice.finish_reason), response.usage)

    async def astream(self, prompt: Prompt, params: SamplingParams,
                      cache_salt: str | None = None) -> AsyncIterator[Generation]:
        finish_reason, usage = None, None
        with _translated_errors():
            stream = await self._create(prompt, params, cache_salt, stream=True)
            try:
                async for chunk in stream:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        finish_reason = choice.finish_reason or finish_reason
                        text = choice.text if isinstance(prompt, str) else choice.delta.content
                        if text:
                            yield Generation(text)
            finally:
                await stream.close()  # closing early drops the connection: the server aborts
        yield _with_usage(Generation("", finish_reason), usage)

    async def astats(self) -> dict[str, Any]:
        with _translated_errors():
            return await self._openai().get("stats", cast_to=dict)

    async def ainfo(self) -> EngineInfo:
        if self._info is None:
            with _translated_errors():
                cards = (await self._openai().models.list()).data
            card = next((c for c in cards if c.id == self.model), cards[0])
            self._info = EngineInfo(card.id, card.model_extra["max_model_len"])
        return self._info

    async def _create(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None, stream: bool):
        """A completion (text) or chat (messages) request through the SDK."""
        check_single(params)
        model = self.model if self.model is not None else (await self.ainfo()).model_name
        options = {"model": model, "stream": stream, **_sampling_body(params, cache_salt)}
        if stream:
            options["stream_options"] = {"include_usage": True}
        client = self._openai()
        if isinstance(prompt, str):
            return await client.completions.create(prompt=prompt, **options)
        return await client.chat.completions.create(messages=prompt, **options)

    def _openai(self) -> openai.AsyncOpenAI:
        """The running event loop's SDK client."""
        loop = asyncio.get_running_loop()
        with self._clients_lock:
            client = self._clients.get(loop)
            if client is None:
                client = self._clients[loop] = openai.AsyncOpenAI(**self._settings)
            return client


def _sampling_body(params: SamplingParams, cache_salt: str | None) -> dict[str, Any]:
    """The SDK's named sampling arguments, and ``extra_body`` with the extras that differ
    from their defaults (and the salt, if any)."""
    fields = dataclasses.asdict(params)
    extras = {name: value for name, value in fields.items()
              if name not in _OPENAI_FIELDS and name not in _NOT_SENT and value != _DEFAULTS[name]}
    if cache_salt is not None:
        extras["cache_salt"] = cache_salt
    return {**{name: fields[name] for name in _OPENAI_FIELDS}, "extra_body": extras}


def _with_usage(generation: Generation, usage) -> Generation:
    """The generation with the token counts of the response's usage (if it had one)."""
    if usage is None:
        return generation
    details = usage.prompt_tokens_details
    return dataclasses.replace(generation, prompt_tokens=usage.prompt_tokens,
                               completion_tokens=usage.completion_tokens,
                               cached_tokens=(details.cached_tokens or 0) if details else 0)


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
