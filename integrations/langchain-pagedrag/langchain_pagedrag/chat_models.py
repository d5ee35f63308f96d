"""ChatPagedRAG: pagedrag as a LangChain chat model, in process or through a ``pagedrag serve``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import RunnableConfig

from pagedrag.client import Generation, Messages, run_sync

from ._engine import LangChainSettings, generation_info, openai_logprobs

_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool", "function": "function"}


class ChatPagedRAG(LangChainSettings, BaseChatModel):
    """A pagedrag engine as a LangChain chat model; chats go through the model's chat template.

    ``ChatPagedRAG()`` runs the embedded SmolLM2-135M-Instruct in process;
    ``ChatPagedRAG(model=..., engine_kwargs={...})`` any other model and pagedrag.EngineArgs;
    ``ChatPagedRAG(base_url="http://host:8000")`` talks to a ``pagedrag serve``.

    A drop-in for ChatOpenAI (and ChatOllama where the names map): see LangChainSettings
    and pagedrag.rag.aliases. Every reply carries ``usage_metadata`` (cached prompt tokens
    in ``input_token_details["cache_read"]``; in a stream on the last chunk, unless
    ``stream_usage=False``) and ``response_metadata`` (finish_reason, prompt_tokens,
    completion_tokens, cached_tokens, cache_hit_rate, model_name; ``logprobs`` when asked
    for). With n > 1, ``generate`` returns n generations per input (``invoke`` the first).
    ``batch`` submits every input before collecting any, so the engine runs them as one
    batch. Decoding is greedy unless ``temperature`` says otherwise. Tool calling and
    structured output are not supported.
    """

    @property
    def _llm_type(self) -> str:
        return "pagedrag-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._with_model_name(super()._get_ls_params(stop=stop, **kwargs), kwargs)

    # ---- one engine batch --------------------------------------------------------------
    def batch(self, inputs: list[LanguageModelInput], config: RunnableConfig | list[RunnableConfig] | None = None,
              *, return_exceptions: bool = False, **kwargs: Any) -> list[BaseMessage]:
        """Every input in one engine batch: the async batch, run to its end (the default
        batch would invoke each input on a thread of its own)."""
        return run_sync(self.abatch(inputs, config, return_exceptions=return_exceptions, **kwargs))

    # ---- generation -----------------------------------------------------------------------
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        params = self.call_sampling(kwargs, stop)
        return self._result(self.client.generate(engine_messages(messages), params, self.cache_salt))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        params = self.call_sampling(kwargs, stop)
        return self._result(await self.client.agenerate(engine_messages(messages), params, self.cache_salt))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        params, usage = self.call_sampling(kwargs, stop), self.wants_stream_usage(kwargs)
        for piece in self.client.stream(engine_messages(messages), params, self.cache_salt):
            chunk = self._chunk(piece, usage)
            if run_manager:
                run_manager.on_llm_new_token(piece.text, chunk=chunk)
            yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        params, usage = self.call_sampling(kwargs, stop), self.wants_stream_usage(kwargs)
        async for piece in self.client.astream(engine_messages(messages), params, self.cache_salt):
            chunk = self._chunk(piece, usage)
            if run_manager:
                await run_manager.on_llm_new_token(piece.text, chunk=chunk)
            yield chunk

    def engine_prompt(self, prompt: PromptValue) -> Messages:
        """A rendered prompt as this model sends it: its messages."""
        return engine_messages(prompt.to_messages())

    def _result(self, whole: Generation) -> ChatResult:
        """One ChatGeneration per completion, each with the request's usage (as ChatOpenAI)."""
        generations = []
        for choice in whole.choices:
            info = generation_info(choice, whole, self.model_label)
            message = AIMessage(content=choice.text, usage_metadata=_usage(whole), response_metadata=info)
            generations.append(ChatGeneration(message=message, generation_info=info))
        return ChatResult(generations=generations, llm_output={"model_name": self.model_label})

    def _chunk(self, piece: Generation, with_usage: bool) -> ChatGenerationChunk:
        """A stream chunk (its logprobs in response_metadata, when asked for); the last one
        carries the response metadata, and the usage unless ``with_usage`` is false."""
        if piece.finish_reason is None:
            metadata = {} if piece.logprobs is None else {"logprobs": openai_logprobs(piece)}
            return ChatGenerationChunk(message=AIMessageChunk(content=piece.text, response_metadata=metadata))
        info = generation_info(piece, piece, self.model_label)
        message = AIMessageChunk(content=piece.text, usage_metadata=_usage(piece) if with_usage else None,
                                 response_metadata=info, chunk_position="last")
        return ChatGenerationChunk(message=message, generation_info=info)


def _usage(generation: Generation) -> UsageMetadata:
    return UsageMetadata(input_tokens=generation.prompt_tokens, output_tokens=generation.completion_tokens,
                         total_tokens=generation.prompt_tokens + generation.completion_tokens,
                         input_token_details={"cache_read": generation.cached_tokens})


def engine_messages(messages: Sequence[BaseMessage]) -> Messages:
    """LangChain messages as ``{"role", "content"}`` dicts; text content only."""
    return [{"role": _role(message), "content": _text(message.content, index)}
            for index, message in enumerate(messages)]


def _role(message: BaseMessage) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    if message.type not in _ROLES:
        raise ValueError(f"ChatPagedRAG cannot send a {message.type!r} message")
    return _ROLES[message.type]


def _text(content: Any, index: int) -> str:
    """A message's content as text: a string, or a list of strings and text blocks."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise TypeError(f"messages[{index}] holds a {kind!r} block; ChatPagedRAG takes text only")
    return "\n".join(parts)
