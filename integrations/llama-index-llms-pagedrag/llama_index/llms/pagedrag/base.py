"""PagedRAG: pagedrag as a LlamaIndex LLM, in process or through a ``pagedrag serve``."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import TYPE_CHECKING, Any

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
)
from llama_index.core.bridge.pydantic import BaseModel, ConfigDict, Field, model_validator
from llama_index.core.constants import DEFAULT_NUM_OUTPUTS
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.program.utils import get_program_for_llm
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.types import BasePydanticProgram, PydanticProgramMode

from pagedrag.client import Prompt
from pagedrag.rag.chunk_reuse_support import ChunkReuseSettings
from pagedrag.sampling_params import SamplingParams

from .messages import engine_messages
from .responses import arunning_text, chat_response, completion_response, running_text
from .tools import (
    keep_first_call,
    no_call_error,
    openai_tool_choice,
    openai_tools,
    split_tool_kwargs,
    tool_selections,
)

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

logger = logging.getLogger(__name__)


class PagedRAG(ChunkReuseSettings, FunctionCallingLLM):
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

    Every response carries the request's figures (KV-tier hits in ``tier_cache_hits``
    included) in ``additional_kwargs`` and ``raw`` (with OpenAI's ``usage`` and all n
    ``choices``; see ``responses``); ``stats()`` returns the engine's counters as
    ``pagedrag.LLM.stats()`` does. ``context_window`` follows the engine's max_model_len
    unless given.

    Chunk reuse (``enable_chunk_reuse=True``, ``chunk_recompute_fraction``: EngineArgs
    fields, in ``engine_kwargs`` / ``vllm_kwargs`` or as arguments of their own; refused
    with ``base_url``, whose server decides): a retrieved chunk's KV is reused wherever the
    chunk lands. Every call takes ``chunks=[texts]``, the retrieved chunks its prompt holds,
    for an exact cut; without it, the chunks CanonicalNodePostprocessor(llm=this) told of
    (``expect_chunks``) that the prompt holds are passed, and otherwise the engine cuts the
    prompt at blank lines. Responses report prefix_cache_hits, chunk_cache_hits,
    chunk_tokens_recomputed and prompt_tokens_computed (see ``responses``).

    A FunctionCallingLLM (unless ``messages_to_prompt`` turns chats into text): tools go to
    the engine as OpenAI specs, and calls come back in the message's
    ``additional_kwargs["tool_calls"]`` in OpenAI's shape (in a stream, on the last
    piece), so agents and memory send them back as they got them. A required or named
    tool_choice is enforced by a grammar, so even the embedded model makes a schema-valid
    call; structured_predict, its stream and async forms and ``as_structured_llm`` force
    their tool that way. ``chat(messages, structured_outputs={"json": schema})`` (any
    pagedrag.StructuredOutputsParams) constrains a plain reply instead::

        response = llm.chat_with_tools([FunctionTool.from_defaults(fn=add)], user_msg="2 + 3?",
                                       tool_required=True)
        [call] = llm.get_tool_calls_from_response(response)   # ToolSelection: add, {"a": 2, "b": 3}
        album = llm.structured_predict(Album, PromptTemplate("An album about {topic}."), topic="the sea")
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="Model folder or name; None: the embedded SmolLM2 "
                                                        "(with base_url: the served model name).")
    additional_kwargs: dict[str, Any] = Field(default_factory=dict,
                                              description="Other pagedrag.SamplingParams fields.")
    context_window: int | None = Field(default=None, gt=0,
                                       description="Tokens LlamaIndex packs a prompt into; None: max_model_len.")
    is_chat_model: bool = Field(default=True, description="Whether LlamaIndex sends chats (else completions).")
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
        logprobs = {} if self.logprobs is None else {"logprobs": self.logprobs}
        return {**logprobs, **self.extra_fields(self.additional_kwargs, "additional_kwargs")}

    @property
    def metadata(self) -> LLMMetadata:
        info = self.client.info()
        return LLMMetadata(context_window=self.context_window or info.max_model_len,
                           num_output=self.max_tokens or DEFAULT_NUM_OUTPUTS,
                           is_chat_model=self.is_chat_model, is_function_calling_model=self._engine_renders_chats,
                           model_name=info.model_name)

    # ---- chat ----------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, params, call = self._chat_request(messages, kwargs)
        return chat_response(self.client.generate(prompt, params, self.cache_salt, **call))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt, params, call = self._chat_request(messages, kwargs)
        pieces = self.client.stream(prompt, params, self.cache_salt, **call)
        return (chat_response(piece, text) for piece, text in running_text(pieces))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, params, call = self._chat_request(messages, kwargs)
        return chat_response(await self.client.agenerate(prompt, params, self.cache_salt, **call))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prompt, params, call = self._chat_request(messages, kwargs)
        pieces = self.client.astream(prompt, params, self.cache_salt, **call)
        return (chat_response(piece, text) async for piece, text in arunning_text(pieces))

    # ---- function calling ------------------------------------------------------------------
    def _prepare_chat_with_tools(self, tools: Sequence[BaseTool], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: str | dict | None = None, strict: bool | None = None,
                                 **kwargs: Any) -> dict[str, Any]:
        """chat()'s keywords: the history, then ``user_msg``; the tools as OpenAI specs;
        ``tool_choice`` a tool's name or OpenAI's form (None: "required" when
        ``tool_required``, else "auto"); parallel calls only when allowed. Without tools, a
        plain chat. ``chat_history`` is not changed."""
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        messages = [*(chat_history or []), *([user_msg] if user_msg else [])]
        specs = openai_tools(tools, strict)
        if not specs:
            return {"messages": messages, **kwargs}
        return {"messages": messages, "tools": specs, "tool_choice": openai_tool_choice(tool_choice, tool_required),
                "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def _validate_chat_with_tools_response(self, response: ChatResponse, tools: Sequence[BaseTool],
                                           allow_parallel_tool_calls: bool = False, **kwargs: Any) -> ChatResponse:
        """The response, trimmed to its first call unless parallel calls are allowed."""
        return response if allow_parallel_tool_calls else keep_first_call(response)

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        """The response's calls (``message.additional_kwargs["tool_calls"]``) as
        ToolSelections, arguments decoded; none is a ValueError saying why, unless
        ``error_on_no_tool_call`` is False."""
        selections = tool_selections(response)
        if not selections and error_on_no_tool_call:
            raise no_call_error(response)
        return selections

    # ---- structured outputs ------------------------------------------------------------------
    def _structured_stream_call(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                                llm_kwargs: dict[str, Any] | None = None,
                                **prompt_args: Any) -> Generator[Any, None, None]:
        return self._structured_program(output_cls, prompt).stream_call(llm_kwargs=llm_kwargs, **prompt_args)

    async def _structured_astream_call(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                                       llm_kwargs: dict[str, Any] | None = None,
                                       **prompt_args: Any) -> AsyncGenerator[Any, None]:
        program = self._structured_program(output_cls, prompt)
        return await program.astream_call(llm_kwargs=llm_kwargs, **prompt_args)

    def _structured_program(self, output_cls: type[BaseModel], prompt: BasePromptTemplate) -> BasePydanticProgram:
        """LlamaIndex's program for ``pydantic_program_mode``; when it is a function-calling
        one, its tool is forced in streams too (LlamaIndex forces it in structured_predict
        only, and left to "auto" a small model mostly answers in prose)."""
        mode = self.pydantic_program_mode
        function_calling = mode == PydanticProgramMode.FUNCTION or (
            mode == PydanticProgramMode.DEFAULT and self._engine_renders_chats)
        forced = {"tool_choice": "required"} if function_calling else {}
        return get_program_for_llm(output_cls, prompt, self, pydantic_program_mode=mode, **forced)

    # ---- completion -----------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text, params, call = self._completion_request(prompt, formatted, kwargs)
        return completion_response(self.client.generate(text, params, self.cache_salt, **call))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        text, params, call = self._completion_request(prompt, formatted, kwargs)
        pieces = self.client.stream(text, params, self.cache_salt, **call)
        return (completion_response(piece, so_far) for piece, so_far in running_text(pieces))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text, params, call = self._completion_request(prompt, formatted, kwargs)
        return completion_response(await self.client.agenerate(text, params, self.cache_salt, **call))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        text, params, call = self._completion_request(prompt, formatted, kwargs)
        pieces = self.client.astream(text, params, self.cache_salt, **call)
        return (completion_response(piece, so_far) async for piece, so_far in arunning_text(pieces))

    # ---- prompts as LlamaIndex sends them --------------------------------------------------
    def template_prompt(self, template: BasePromptTemplate, **variables: str) -> Prompt:
        """The engine's prompt when LlamaIndex predicts with ``template`` filled with
        ``variables`` (those not given empty), as ``LLM.predict`` sends it: a chat model's
        messages (with ``system_prompt``, as ``chat`` sends them), else the text of ``complete``.
        The cache probe and the warm-up lay out a query's prompt through it."""
        variables = {**dict.fromkeys(template.template_vars, ""), **variables}
        if self.is_chat_model:
            return self._chat_prompt(self._get_messages(template, **variables))
        return self._prompt(self._get_prompt(template, **variables), formatted=True)

    # ---- helpers ----------------------------------------------------------------------------
    def _prompt(self, prompt: str, formatted: bool) -> str:
        """The text sent as is: completion_to_prompt applies unless already formatted."""
        if not isinstance(prompt, str):
            raise TypeError(f"a completion prompt must be a string, got {type(prompt).__name__}")
        return prompt if formatted else self.completion_to_prompt(prompt)

    @property
    def _engine_renders_chats(self) -> bool:
        """Whether chats reach the engine as messages, which the model's chat template
        renders with their tools, rather than as the text a given ``messages_to_prompt``
        makes (Vllm's way; then there is no function calling)."""
        return self.messages_to_prompt is generic_messages_to_prompt

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> Prompt:
        """The conversation as engine messages, or the text ``messages_to_prompt`` makes."""
        return engine_messages(messages) if self._engine_renders_chats else self.messages_to_prompt(messages)

    def _chat_request(self, messages: Sequence[ChatMessage],
                      kwargs: dict[str, Any]) -> tuple[Prompt, SamplingParams, dict[str, Any]]:
        """(prompt, sampling params, the client's other keywords) of a chat call: its keywords
        are the tool request's (tools, tool_choice, parallel_tool_calls), ``chunks`` or
        SamplingParams'."""
        tools, sampling = split_tool_kwargs(kwargs)
        prompt = self._chat_prompt(messages)
        chunks = self.call_chunks(prompt, sampling.pop("chunks", None))
        return prompt, self.sampling(sampling), {**tools, "chunks": chunks}

    def _completion_request(self, prompt: str, formatted: bool,
                            kwargs: dict[str, Any]) -> tuple[str, SamplingParams, dict[str, Any]]:
        """(text, sampling params, the client's other keywords) of a completion call: its
        keywords are ``chunks`` or SamplingParams'."""
        text, sampling = self._prompt(prompt, formatted), dict(kwargs)
        chunks = self.call_chunks(text, sampling.pop("chunks", None))
        return text, self.sampling(sampling), {"chunks": chunks}
