"""PagedRAG: pagedrag as a LlamaIndex LLM, in process or through a ``pagedrag serve``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
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
from llama_index.core.bridge.pydantic import ConfigDict, Field, model_validator
from llama_index.core.constants import DEFAULT_NUM_OUTPUTS
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM

from pagedrag.client import Messages, Prompt
from pagedrag.rag.integration_settings import EngineSettings

from .responses import arunning_text, chat_response, completion_response, running_text

logger = logging.getLogger(__name__)


class PagedRAG(EngineSettings, LLM):
    """A pagedrag engine as a LlamaIndex chat LLM.

    ``PagedRAG()`` runs the embedded SmolLM2-135M-Instruct in process;
    ``PagedRAG(model=..., engine_kwargs={...})`` any other model and pagedrag.EngineArgs;
    ``PagedRAG(base_url="http://host:8000")`` talks to a ``pagedrag serve``. Instances
    with the same engine arguments share one engine (and its prefix cache).

    A drop-in for llama-index-llms-vllm's ``Vllm`` and ``VllmServer``: their arguments
    mean the same here (``vllm_kwargs`` are EngineArgs, ``max_new_tokens`` is
    ``max_tokens``, ``api_url`` a server's ``/generate`` URL, ...; pagedrag.rag.aliases
    has the table), per call too (``complete(prompt, max_new_tokens=3)``). Unknown
    arguments are an error. Differences: decoding is greedy unless ``temperature`` says
    otherwise, chats go through the model's chat template unless ``messages_to_prompt``
    is given, ``best_of`` must be None or n, and ``openai_like`` changes nothing (the
    OpenAI routes are always used; a warning says so).

    Every response carries the request's figures in ``additional_kwargs`` and ``raw``
    (with OpenAI's ``usage`` and all n ``choices``; see ``responses``); ``stats()``
    returns the engine's counters as ``pagedrag.LLM.stats()`` does. ``context_window``
    follows the engine's max_model_len unless given.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="Model folder or name; None: the embedded SmolLM2 "
                                                        "(with base_url: the served model name).")
    additional_kwargs: dict[str, Any] = Field(default_factory=dict,
                                              description="Other pagedrag.SamplingParams fields.")
    context_window: int | None = Field(default=None, gt=0,
                                       description="Tokens LlamaIndex packs a prompt into; None: max_model_len.")
    is_chat_model: bool = Field(default=True, description="Whether LlamaIndex sends chats (else completions).")
    best_of: int | None = Field(default=None, description="vLLM's best_of: only None or n (pagedrag samples n).")
    ignore_eos: bool = Field(default=False, description="Generate past the end-of-sequence token.")
    logprobs: int | None = Field(default=None, ge=0,
                                 description="Top log probabilities per generated token (response.logprobs).")
    openai_like: bool = Field(default=False, description="VllmServer's; PagedRAG always uses the OpenAI routes.")

    @classmethod
    def class_name(cls) -> str:
        return "PagedRAG"

    @model_validator(mode="after")
    def _warn_openai_like(self) -> "PagedRAG":
        if self.openai_like:
            logger.warning("PagedRAG ignores openai_like=True: it always uses the server's OpenAI routes "
                           "(completions for complete(), chat completions with the chat template for chat())")
        return self

    @property
    def model_id(self) -> str | None:
        return self.model

    @property
    def extra_sampling(self) -> dict[str, Any]:
        own = {"best_of": self.best_of, "ignore_eos": self.ignore_eos, "logprobs": self.logprobs}
        return {**{name: value for name, value in own.items() if value is not None},
                **self.extra_fields(self.additional_kwargs, "additional_kwargs")}

    @property
    def metadata(self) -> LLMMetadata:
        info = self.client.info()
        return LLMMetadata(context_window=self.context_window or info.max_model_len,
                           num_output=self.max_tokens or DEFAULT_NUM_OUTPUTS,
                           is_chat_model=self.is_chat_model, model_name=info.model_name)

    # ---- chat -------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return chat_response(self.client.generate(self._chat_prompt(messages), self.sampling(kwargs), self.cache_salt))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        pieces = self.client.stream(self._chat_prompt(messages), self.sampling(kwargs), self.cache_salt)
        return (chat_response(piece, text) for piece, text in running_text(pieces))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        generation = await self.client.agenerate(self._chat_prompt(messages), self.sampling(kwargs), self.cache_salt)
        return chat_response(generation)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        pieces = self.client.astream(self._chat_prompt(messages), self.sampling(kwargs), self.cache_salt)
        return (chat_response(piece, text) async for piece, text in arunning_text(pieces))

    # ---- completion -----------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        generation = self.client.generate(self._prompt(prompt, formatted), self.sampling(kwargs), self.cache_salt)
        return completion_response(generation)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        pieces = self.client.stream(self._prompt(prompt, formatted), self.sampling(kwargs), self.cache_salt)
        return (completion_response(piece, text) for piece, text in running_text(pieces))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        generation = await self.client.agenerate(self._prompt(prompt, formatted), self.sampling(kwargs),
                                                 self.cache_salt)
        return completion_response(generation)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        pieces = self.client.astream(self._prompt(prompt, formatted), self.sampling(kwargs), self.cache_salt)
        return (completion_response(piece, text) async for piece, text in arunning_text(pieces))

    # ---- helpers ----------------------------------------------------------------------------
    def _prompt(self, prompt: str, formatted: bool) -> str:
        """The text sent as is: completion_to_prompt applies unless already formatted."""
        if not isinstance(prompt, str):
            raise TypeError(f"a completion prompt must be a string, got {type(prompt).__name__}")
        return prompt if formatted else self.completion_to_prompt(prompt)

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> Prompt:
        """The conversation, rendered by the model's chat template on the engine's side; or,
        when a ``messages_to_prompt`` was given (Vllm's way), the text it makes."""
        if self.messages_to_prompt is not generic_messages_to_prompt:
            return self.messages_to_prompt(messages)
        return engine_messages(messages)


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
