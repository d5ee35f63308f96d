"""ChatPagedRAG: pagedrag as a LangChain chat model, in process or through a ``pagedrag serve``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import Field

from pagedrag.client import Generation, Messages
from pagedrag.rag.chunk_reuse_support import cache_read_tokens
from pagedrag.sampling_params import SamplingParams

from ._engine import LangChainSettings, generation_info, openai_logprobs
from ._structured import METHODS, content_parser, json_schema_format, tool_parser, with_raw
from ._tool_calls import TOOL_KEYWORDS, message_tool_calls, openai_tool_calls, stream_tool_call_chunks, tool_request

# Message classes (and their chunks, subclasses) and the roles they send as
_ROLES = ((SystemMessage, "system"), (HumanMessage, "user"), (AIMessage, "assistant"), (ToolMessage, "tool"),
          (FunctionMessage, "function"))
# Content blocks that restate one of an AIMessage's tool_calls (Anthropic's, LangChain v1's)
_CALL_BLOCKS = ("tool_use", "tool_call")


class ChatPagedRAG(LangChainSettings, BaseChatModel):
    """A pagedrag engine as a LangChain chat model; chats go through the model's chat template.

    ``ChatPagedRAG()`` runs the embedded SmolLM2-135M-Instruct in process;
    ``ChatPagedRAG(model=..., engine_kwargs={...})`` any other model and pagedrag.EngineArgs;
    ``ChatPagedRAG(base_url="http://host:8000")`` talks to a ``pagedrag serve``.

    A drop-in for ChatOpenAI (and ChatOllama where the names map): see LangChainSettings
    and pagedrag.rag.aliases. Every reply carries ``usage_metadata`` (cached prompt tokens
    in ``input_token_details["cache_read"]``: prefix-cache and chunk-cache hits, of which
    ``input_token_details["cache_read_by_tier"]`` came from each KV tier; in a stream on
    the last chunk, unless ``stream_usage=False``) and ``response_metadata`` (finish_reason,
    prompt_tokens, completion_tokens, cached_tokens, cache_hit_rate, tier_cache_hits
    ({"host": m, "disk": n}), prefix_cache_hits, chunk_cache_hits, chunk_tokens_recomputed,
    prompt_tokens_computed, model_name; ``logprobs`` when asked for). With n > 1,
    ``generate`` returns n generations per input (``invoke`` the first).
    ``batch`` submits every input before collecting any, so the engine runs them as one
    batch. Decoding is greedy unless ``temperature`` says otherwise.

    Tool calling and structured output as ChatOpenAI has them: ``bind_tools`` (replies carry
    ``tool_calls``, streams ``tool_call_chunks`` on their last chunk, finish_reason
    "tool_calls"; AIMessages with calls and ToolMessages go back to the model) and
    ``with_structured_output`` (methods "json_schema", "function_calling", "json_mode").
    A forced tool choice ("required", "any", a tool's name) and a schema are enforced by a
    grammar in the engine, so even a small model replies with a call or JSON of the right
    shape (cut short only by ``max_tokens``). Per call, ``response_format`` (OpenAI's) or
    ``structured_outputs`` (pagedrag.StructuredOutputsParams or its fields) constrain a reply.

    Chunk reuse (``enable_chunk_reuse=True``, ``chunk_recompute_fraction``: EngineArgs
    fields, in ``engine_kwargs`` or as arguments of their own; refused with ``base_url``,
    whose server decides): a retrieved chunk's KV is reused wherever it lands. A call takes
    ``chunks=[texts]`` (the retrieved chunks its prompt holds) for an exact cut; without
    it, the documents CanonicalDocuments(llm=this) told of that the last human message
    holds are passed, and otherwise the engine cuts at blank lines.
    """

    max_tokens: int | None = Field(default=None, description="Most tokens to generate; None (ChatOpenAI's "
                                                             "default): until EOS or max_model_len.")

    @property
    def _llm_type(self) -> str:
        return "pagedrag-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._with_model_name(super()._get_ls_params(stop=stop, **kwargs), kwargs)

    # ---- tools and structured output ----------------------------------------------------
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | bool | dict | None = None, parallel_tool_calls: bool | None = None,
                   strict: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with ``tools`` offered on every call.

        ``tools``: whatever convert_to_openai_tool takes (pydantic classes, TypedDicts,
        functions, BaseTools, JSON schemas or OpenAI tools), with ``strict`` set on each
        function when given. ``tool_choice``: "auto" (or None: the model decides), "none",
        "required" / "any" / True (at least one call; "any" and True with one tool bound:
        exactly one, unless ``parallel_tool_calls=True``), a bound tool's name or OpenAI's
        ``{"type": "function", "function": {"name": ...}}`` (exactly that call).
        ``parallel_tool_calls=False``: at most one call. Other ``kwargs`` are bound as call
        keywords too.
        """
        formatted = [convert_to_openai_tool(tool, strict=strict) for tool in tools]
        names = [tool["function"]["name"] for tool in formatted]
        return super().bind(tools=formatted, **tool_request(tool_choice, parallel_tool_calls, names), **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type | None = None, *,
                               method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, dict | Any]:
        """This model replying in ``schema``'s shape, parsed: a pydantic class gives its
        instances, a TypedDict, JSON schema or OpenAI tool dicts.

        ``method``: "json_schema" constrains the content to the schema (the default);
        "function_calling" forces one call of the schema as a tool and reads its arguments;
        "json_mode" constrains the content to some JSON object (the prompt must say which;
        ``schema`` may then be None). ``strict`` (not with json_mode) forbids properties the
        schema does not name. ``include_raw=True`` returns ``{"raw", "parsed",
        "parsing_error"}`` instead of raising when the reply does not parse. Other
        ``kwargs`` are bound as call keywords.
        """
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if method == "json_mode" and strict is not None:
            raise ValueError("strict does not apply to method='json_mode' (any JSON object)")
        if schema is None and method != "json_mode":
            raise ValueError(f"method={method!r} needs a schema")
        trace = {"ls_structured_output_format": {"kwargs": {"method": method, "strict": strict}, "schema": schema}}
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, parallel_tool_calls=False, strict=strict,
                                  **trace, **kwargs)
            parser = tool_parser(schema, name)
        else:
            response_format = {"type": "json_object"} if method == "json_mode" else json_schema_format(schema, strict)
            llm = self.bind(response_format=response_format, **trace, **kwargs)
            parser = content_parser(schema)
        return with_raw(llm, parser) if include_raw else llm | parser

    # ---- generation -----------------------------------------------------------------------
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        prompt = engine_messages(messages)
        params, call = self._call_options(prompt, kwargs, stop)
        return self._result(self.client.generate(prompt, params, self.cache_salt, **call))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        prompt = engine_messages(messages)
        params, call = self._call_options(prompt, kwargs, stop)
        return self._result(await self.client.agenerate(prompt, params, self.cache_salt, **call))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        prompt = engine_messages(messages)
        (params, call), usage = self._call_options(prompt, kwargs, stop), self.wants_stream_usage(kwargs)
        for piece in self.client.stream(prompt, params, self.cache_salt, **call):
            chunk = self._chunk(piece, usage)
            if run_manager:
                run_manager.on_llm_new_token(piece.text, chunk=chunk)
            yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        prompt = engine_messages(messages)
        (params, call), usage = self._call_options(prompt, kwargs, stop), self.wants_stream_usage(kwargs)
        async for piece in self.client.astream(prompt, params, self.cache_salt, **call):
            chunk = self._chunk(piece, usage)
            if run_manager:
                await run_manager.on_llm_new_token(piece.text, chunk=chunk)
            yield chunk

    def _call_options(self, prompt: Messages, kwargs: dict[str, Any],
                      stop: list[str] | None) -> tuple[SamplingParams, dict[str, Any]]:
        """A call's sampling (call_sampling), and what the engine client takes apart from the
        sampling: its tool keywords and ``chunks`` (``call_chunks`` of the prompt)."""
        tools = {name: value for name, value in kwargs.items() if name in TOOL_KEYWORDS}
        sampling = {name: value for name, value in kwargs.items() if name not in TOOL_KEYWORDS}
        chunks = self.call_chunks(prompt, kwargs.get("chunks"))
        return self.call_sampling(sampling, stop), {**tools, "chunks": chunks}

    def engine_prompt(self, prompt: PromptValue) -> Messages:
        """A rendered prompt as this model sends it: its messages."""
        return engine_messages(prompt.to_messages())

    def _result(self, whole: Generation) -> ChatResult:
        """One ChatGeneration per completion, each with the request's usage (as ChatOpenAI)."""
        generations = []
        for choice in whole.choices:
            info = generation_info(choice, whole, self.model_label)
            message = AIMessage(content=choice.text, usage_metadata=_usage(whole), response_metadata=info,
                                **message_tool_calls(choice.tool_calls))
            generations.append(ChatGeneration(message=message, generation_info=info))
        return ChatResult(generations=generations, llm_output={"model_name": self.model_label})

    def _chunk(self, piece: Generation, with_usage: bool) -> ChatGenerationChunk:
        """A stream chunk (its logprobs in response_metadata, when asked for); the last one
        carries the response metadata, the tool calls (whole, one tool_call_chunk each) and
        the usage unless ``with_usage`` is false."""
        if piece.finish_reason is None:
            metadata = {} if piece.logprobs is None else {"logprobs": openai_logprobs(piece)}
            return ChatGenerationChunk(message=AIMessageChunk(content=piece.text, response_metadata=metadata))
        info = generation_info(piece, piece, self.model_label)
        message = AIMessageChunk(content=piece.text, usage_metadata=_usage(piece) if with_usage else None,
                                 response_metadata=info, tool_call_chunks=stream_tool_call_chunks(piece.tool_calls),
                                 chunk_position="last")
        return ChatGenerationChunk(message=message, generation_info=info)


def _usage(generation: Generation) -> UsageMetadata:
    """The request's token usage; ``cache_read``: prompt tokens served by the prefix cache or
    by reused chunks, and next to it (a provider key, as InputTokenDetails allows)
    ``cache_read_by_tier``: those of them loaded from each KV tier, ``{"host": m, "disk": n}``.

    A dict, not an int per tier: LangChain's standard tests take the int details for
    disjoint parts of input_tokens, which a share of cache_read is not; they skip a dict,
    and ``add_usage`` adds dicts up key by key when stream chunks are summed."""
    details = {"cache_read": cache_read_tokens(generation), "cache_read_by_tier": dict(generation.tier_cache_hits)}
    return UsageMetadata(input_tokens=generation.prompt_tokens, output_tokens=generation.completion_tokens,
                         total_tokens=generation.prompt_tokens + generation.completion_tokens,
                         input_token_details=details)


def engine_messages(messages: Sequence[BaseMessage]) -> Messages:
    """LangChain messages as the engine's OpenAI-style dicts ``{"role", "content"}``, text
    content only; an AIMessage that made calls also has ``tool_calls`` (its content None
    when it has no text), a ToolMessage its ``tool_call_id``."""
    return [_engine_message(message, index) for index, message in enumerate(messages)]


def _engine_message(message: BaseMessage, index: int) -> dict[str, Any]:
    if isinstance(message, AIMessage) and (message.tool_calls or message.invalid_tool_calls):
        calls = openai_tool_calls(message)
        text = _text(message.content, index, restated={call["id"] for call in calls})
        return {"role": "assistant", "content": text or None, "tool_calls": calls}
    converted = {"role": _role(message), "content": _text(message.content, index)}
    if isinstance(message, ToolMessage):
        converted["tool_call_id"] = message.tool_call_id
    return converted


def _role(message: BaseMessage) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    role = next((role for kind, role in _ROLES if isinstance(message, kind)), None)
    if role is None:
        raise ValueError(f"ChatPagedRAG cannot send a {message.type!r} message")
    return role


def _text(content: Any, index: int, restated: Collection[str] = ()) -> str:
    """A message's content as text: a string, or a list of strings and text blocks; blocks
    that restate the message's own tool calls (ids in ``restated``) are left to its
    ``tool_calls``."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif not (isinstance(block, dict) and block.get("type") in _CALL_BLOCKS and block.get("id") in restated):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise TypeError(f"messages[{index}] holds a {kind!r} block; ChatPagedRAG takes text only")
    return "\n".join(parts)
