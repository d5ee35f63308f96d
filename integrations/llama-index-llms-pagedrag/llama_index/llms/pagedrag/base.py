"""PagedRAG: pagedrag as a LlamaIndex LLM, in process or through a ``pagedrag serve``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import Field
from llama_index.core.constants import DEFAULT_NUM_OUTPUTS
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM

from pagedrag.client import Generation, Messages
from pagedrag.rag.integration_settings import EngineSettings


class PagedRAG(EngineSettings, LLM):
    """A pagedrag engine as a LlamaIndex chat LLM.

    ``PagedRAG()`` runs the embedded SmolLM2-135M-Instruct in process;
    ``PagedRAG(model=..., engine_kwargs={...})`` any other model and pagedrag.EngineArgs;
    ``PagedRAG(base_url="http://host:8000")`` talks to a ``pagedrag serve``. Instances
    with the same engine arguments share one engine (and its prefix cache).

    Every response carries the request's cache figures (finish_reason, prompt_tokens,
    completion_tokens, cached_tokens, cache_hit_rate) in ``additional_kwargs`` and ``raw``;
    ``stats()`` returns the engine's counters as ``pagedrag.LLM.stats()`` does.
    Decoding is greedy unless ``temperature`` says otherwise. The settings besides
    ``model`` and ``additional_kwargs`` are those of ``pagedrag.rag.integration_settings``,
    shared with LangChain's ChatPagedRAG.
    """

    model: str | None = Field(default=None, description="Model folder or name; None: the embedded SmolLM2 "
                                                        "(with base_url: the served model name).")
    additional_kwargs: dict[str, Any] = Field(default_factory=dict,
                                              description="Other pagedrag.SamplingParams fields.")

    @classmethod
    def class_name(cls) -> str:
        return "PagedRAG"

    @property
    def model_id(self) -> str | None:
        return self.model

    @property
    def extra_sampling(self) -> dict[str, Any]:
        return self.additional_kwargs

    @property
    def metadata(self) -> LLMMetadata:
        info = self.client.info()
        return LLMMetadata(context_window=info.max_model_len, num_output=self.max_tokens or DEFAULT_NUM_OUTPUTS,
                           is_chat_model=True, model_name=info.model_name)

    # ---- chat -------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        generation = self.client.chat(engine_messages(messages), self.sampling(kwargs), self.cache_salt)
        return _chat_response(generation.text, None, generation.cache_figures())

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        pieces = self.client.stream_chat(engine_messages(messages), self.sampling(kwargs), self.cache_salt)
        return (_chat_response(text, piece.text, _figures(piece)) for piece, text in _running_text(pieces))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        generation = await self.client.achat(engine_messages(messages), self.sampling(kwargs), self.cache_salt)
        return _chat_response(generation.text, None, generation.cache_figures())

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        pieces = self.client.astream_chat(engine_messages(messages), self.sampling(kwargs), self.cache_salt)
        return (_chat_response(text, piece.text, _figures(piece)) async for piece, text in _arunning_text(pieces))

    # ---- completion -----------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        generation = self.client.complete(self._prompt(prompt, formatted), self.sampling(kwargs), self.cache_salt)
        return _completion_response(generation.text, None, generation.cache_figures())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        pieces = self.client.stream_complete(self._prompt(prompt, formatted), self.sampling(kwargs),
                                             self.cache_salt)
        return (_completion_response(text, piece.text, _figures(piece)) for piece, text in _running_text(pieces))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        generation = await self.client.acomplete(self._prompt(prompt, formatted), self.sampling(kwargs),
                                                 self.cache_salt)
        return _completion_response(generation.text, None, generation.cache_figures())

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        pieces = self.client.astream_complete(self._prompt(prompt, formatted), self.sampling(kwargs),
                                              self.cache_salt)
        return (_completion_response(text, piece.text, _figures(piece))
                async for piece, text in _arunning_text(pieces))

    # ---- helpers ----------------------------------------------------------------------------
    def _prompt(self, prompt: str, formatted: bool) -> str:
        """The text sent as is: completion_to_prompt applies unless already formatted."""
        return prompt if formatted else self.completion_to_prompt(prompt)


def engine_messages(messages: Sequence[ChatMessage]) -> Messages:
    """LlamaIndex messages as ``{"role", "content"}`` dicts; text blocks only."""
    converted = []
    for index, message in enumerate(messages):
        for block in message.blocks:
            if not isinstance(block, TextBlock):
                raise TypeError(f"messages[{index}] holds a {type(block).__name__}; PagedRAG takes text only")
        role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
        converted.append({"role": role, "content": message.content or ""})
    return converted


def _running_text(pieces: Iterator[Generation]) -> Iterator[tuple[Generation, str]]:
    """Each streamed piece with the text so far."""
    text = ""
    for piece in pieces:
        text += piece.text
        yield piece, text


async def _arunning_text(pieces: AsyncIterator[Generation]) -> AsyncIterator[tuple[Generation, str]]:
    text = ""
    async for piece in pieces:
        text += piece.text
        yield piece, text


def _figures(piece: Generation) -> dict[str, Any]:
    """A stream's cache figures, on its last piece only."""
    return piece.cache_figures() if piece.finish_reason is not None else {}


def _chat_response(text: str, delta: str | None, figures: dict[str, Any]) -> ChatResponse:
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta,
                        raw=figures or None, additional_kwargs=figures)


def _completion_response(text: str, delta: str | None, figures: dict[str, Any]) -> CompletionResponse:
    return CompletionResponse(text=text, delta=delta, raw=figures or None, additional_kwargs=figures)
