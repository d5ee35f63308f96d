"""What the integrations call: the EngineClient interface and its result types.

A back end (in process, remote) implements four async primitives; the completion, chat,
batch and synchronous forms are derived here once, so that both back ends behave alike.
A text prompt is a completion, a list of ``{"role", "content"}`` messages a chat, checked
by ``pagedrag.engine.inputs.check_conversation`` (the one rule, the engine's own).
"""

from __future__ import annotations

import asyncio
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pagedrag.engine.inputs import check_conversation
from pagedrag.models.loader import EMBEDDED_NAME
from pagedrag.sampling_params import SamplingParams
from pagedrag.client.bridge import iterate_sync, run_sync

DEFAULT_MODEL_NAME = EMBEDDED_NAME
Messages = list[dict[str, str]]
Prompt = str | Messages
"""A completion prompt (text) or a chat conversation (messages)."""
_SAMPLING_FIELDS = frozenset(field.name for field in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class Generation:
    """One completion, or one piece of a stream.

    A stream yields pieces whose ``text`` is new text and whose ``finish_reason`` is None,
    then a last piece (its text possibly empty) with the finish reason and the request's
    token counts; the counts of earlier pieces are 0, so summing pieces gives the totals.
    """

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def cache_hit_rate(self) -> float:
        """The share of prompt tokens served from the prefix cache."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def cache_figures(self) -> dict[str, Any]:
        """Finish reason, token counts and hit rate, as the integrations report them."""
        return {"finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "cache_hit_rate": self.cache_hit_rate}


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves: the model's name and its context window in tokens."""

    model_name: str
    max_model_len: int


def sampling_params(settings: dict[str, Any], overrides: dict[str, Any]) -> SamplingParams:
    """An adapter's sampling settings, updated by a call's keyword arguments. Keywords that
    are not SamplingParams fields are left out: frameworks pass other things along."""
    chosen = {**settings, **{key: value for key, value in overrides.items() if key in _SAMPLING_FIELDS}}
    return SamplingParams(**chosen)


def check_single(params: SamplingParams) -> None:
    """A Generation is one completion: the integrations never ask for n > 1."""
    if params.n != 1:
        raise ValueError(f"the integrations return one completion per prompt; got n={params.n}")


async def collect(pieces: AsyncIterator[Generation]) -> Generation:
    """The whole Generation of a stream: its texts joined, the last piece's figures."""
    texts, last = [], Generation("")
    async for piece in pieces:
        texts.append(piece.text)
        last = piece
    return dataclasses.replace(last, text="".join(texts))


class EngineClient(ABC):
    """What the integrations call. Back ends implement the async primitives; the
    completion, chat, batch and synchronous forms are derived here."""

    @abstractmethod
    async def agenerate(self, prompt: Prompt, params: SamplingParams,
                        cache_salt: str | None = None) -> Generation:
        """The whole completion of a text prompt or a conversation."""

    @abstractmethod
    def astream(self, prompt: Prompt, params: SamplingParams,
                cache_salt: str | None = None) -> AsyncIterator[Generation]:
        """The completion as it is generated (see ``Generation`` for the pieces).
        Closing the iterator early aborts the request."""

    @abstractmethod
    async def astats(self) -> dict[str, Any]:
        """The engine's counters, keyed as ``pagedrag.LLM.stats()`` keys them."""

    @abstractmethod
    async def ainfo(self) -> EngineInfo:
        """The served model's name and context window."""

    # ---- completion and chat, async -------------------------------------------------
    async def acomplete(self, prompt: str, params: SamplingParams, cache_salt: str | None = None) -> Generation:
        return await self.agenerate(_text(prompt), params, cache_salt)

    async def achat(self, messages: Messages, params: SamplingParams, cache_salt: str | None = None) -> Generation:
        return await self.agenerate(_conversation(messages), params, cache_salt)

    def astream_complete(self, prompt: str, params: SamplingParams,
                         cache_salt: str | None = None) -> AsyncIterator[Generation]:
        return self.astream(_text(prompt), params, cache_salt)

    def astream_chat(self, messages: Messages, params: SamplingParams,
                     cache_salt: str | None = None) -> AsyncIterator[Generation]:
        return self.astream(_conversation(messages), params, cache_salt)

    async def abatch(self, prompts: Sequence[Prompt], params: SamplingParams,
                     cache_salt: str | None = None) -> list[Generation]:
        """All prompts submitted at once (one engine batch), results in their order. Every
        prompt is checked before any is submitted."""
        checked = [prompt if isinstance(prompt, str) else _conversation(prompt) for prompt in prompts]
        tasks = [asyncio.ensure_future(self.agenerate(prompt, params, cache_salt)) for prompt in checked]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # one failed (or the caller gave up): abort the others
                task.cancel()
            raise

    # ---- synchronous forms ------------------------------------------------------------
    def complete(self, prompt: str, params: SamplingParams, cache_salt: str | None = None) -> Generation:
        return run_sync(self.acomplete(prompt, params, cache_salt))

    def chat(self, messages: Messages, params: SamplingParams, cache_salt: str | None = None) -> Generation:
        return run_sync(self.achat(messages, params, cache_salt))

    def stream_complete(self, prompt: str, params: SamplingParams,
                        cache_salt: str | None = None) -> Iterator[Generation]:
        return iterate_sync(self.astream_complete(prompt, params, cache_salt))

    def stream_chat(self, messages: Messages, params: SamplingParams,
                    cache_salt: str | None = None) -> Iterator[Generation]:
        return iterate_sync(self.astream_chat(messages, params, cache_salt))

    def batch(self, prompts: Sequence[Prompt], params: SamplingParams,
              cache_salt: str | None = None) -> list[Generation]:
        return run_sync(self.abatch(prompts, params, cache_salt))

    def stats(self) -> dict[str, Any]:
        return run_sync(self.astats())

    def info(self) -> EngineInfo:
        return run_sync(self.ainfo())


def _text(prompt: Any) -> str:
    if not isinstance(prompt, str):
        raise TypeError(f"a completion prompt must be a string, got {type(prompt).__name__}")
    return prompt


def _conversation(messages: Any) -> Messages:
    """The messages as a list, once ``check_conversation`` accepts them (ValueError otherwise)."""
    check_conversation(messages)
    return list(messages)
