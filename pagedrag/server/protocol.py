"""The OpenAI wire format: pydantic models of requests and responses.

Requests accept OpenAI's fields plus vLLM's sampling extras (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, min_tokens, cache_salt, ...).
Types are strict, as JSON has them: "10" is not a number and "yes" not a boolean.
Every string must be valid UTF-8 (no lone surrogates). Unknown fields are ignored
with a logged warning, as OpenAI-compatible servers do; known fields this server
cannot honour (echo, suffix, the deprecated functions, ...) are rejected rather than
silently ignored. An explicit null means "the default". Structured outputs come as
vLLM's ``structured_outputs`` or its older ``guided_*`` fields, or OpenAI's
``response_format`` (on both routes, as vLLM takes it): at most one of them per request.

pagedrag's own extensions, for chunk reuse (``--enable-chunk-reuse``):

- ``prompt_segments`` (/v1/completions, instead of ``prompt``): one prompt as a list of
  segments, each a text, a token-id list or ``{"text" | "token_ids", "reusable"}``, as
  the offline API takes them (``pagedrag.engine.inputs``); the prompt is their
  concatenation, and each reusable segment's KV may be reused wherever it lands.
- ``prompt_chunks`` (both routes): the retrieved chunks' texts (at most
  MAX_PROMPT_CHUNKS); the prompt (the last user message, in a chat) is cut into segments
  around each one found in it. Only with ``prompt`` or ``messages``, not with
  ``prompt_segments``, which already say where the chunks are, nor with a prompt of token
  ids, nor with a chat template sent with the request (a 400). A chat's ``prompt_segments``
  is a 400 too (not ignored).
- ``usage.prompt_tokens_details`` (PromptTokensDetails) adds chunk_cache_hits,
  chunk_tokens_recomputed and prompt_tokens_computed to OpenAI's cached_tokens.

Without --enable-chunk-reuse both fields are accepted and checked, a prompt_segments prompt
is just its concatenation, prompt_chunks change nothing (the server logs that once), and the
chunk figures are 0.
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from pagedrag.sampling_params import MAX_LOGPROBS, ParameterError, SamplingParams
from pagedrag.structured import StructuredOutputsParams
from pagedrag.structured.params import response_format_fields
from pagedrag.text_checks import InvalidUTF8, check_utf8_within

logger = logging.getLogger("pagedrag")

MAX_TOP_LOGPROBS = MAX_LOGPROBS
MAX_PROMPTS_PER_REQUEST = 1024  # prompts in one batched /v1/completions request
MAX_PROMPT_CHUNKS = 256  # texts in prompt_chunks: each is searched for in the prompt


def named(field: str, error: Exception) -> str:
    """An error's message, led by the request field it is about unless it names it already."""
    return str(error) if field in str(error) else f"{field}: {error}"


class StrictRequest(BaseModel):
    """A request body: strict JSON types, UTF-8 strings, unknown fields logged and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)
    WARN_UNKNOWN: ClassVar[bool] = True  # False where extra fields are read on purpose
    # known fields the server does not serve: field -> the values that mean "not used" (null is
    # always accepted); anything else is a 400 (SamplingRequest), and they are never "unknown"
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _utf8_only(cls, data: Any) -> Any:
        try:
            check_utf8_within(data, cls.__name__)
        except InvalidUTF8 as error:  # the error's param: the field's path in the body, as pydantic's
            where = error.where.removeprefix("a key of ").removeprefix(cls.__name__).removeprefix(".")
            raise ParameterError(re.sub(r"\[(\d+)\]", r".\1", where) or "body", str(error)) from None
        return data

    @model_validator(mode="after")
    def _warn_unknown(self) -> "StrictRequest":
        unknown = sorted(set(self.model_extra or ()) - set(self.UNSUPPORTED))
        if unknown and self.WARN_UNKNOWN:
            logger.warning("%s: ignoring unknown fields %s", type(self).__name__, unknown[:20])
        return self


# ---- requests -------------------------------------------------------------------
class StreamOptions(StrictRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's usage on every chunk: not served, refused when true

    @field_validator("continuous_usage_stats")
    @classmethod
    def _only_final_usage(cls, value: bool) -> bool:
        if value:
            raise ValueError("'stream_options.continuous_usage_stats' is not supported by this server: "
                             "usage comes once, in the last chunk (include_usage)")
        return value


class SamplingRequest(StrictRequest):
    """The fields /v1/completions and /v1/chat/completions share."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "use_beam_search": (False,), "guided_decoding_backend": ("auto", "xgrammar"),
        "length_penalty": (1.0, 1), "priority": (0,),  # beam search and priority scheduling are not served
        "best_of": (1,)}
    UNSUPPORTED_HINTS: ClassVar[dict[str, str]] = {
        "use_beam_search": " (use the offline LLM.beam_search)", "length_penalty": " (it is beam search's)",
        "priority": " (it schedules first come, first served)"}
    GUIDED: ClassVar[dict[str, str]] = {  # vLLM's older request fields -> StructuredOutputsParams fields
        "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
        "guided_whitespace_pattern": "whitespace_pattern"}

    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's; changes nothing with a fast tokenizer (SamplingParams)
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>"
    request_id: str | None = Field(None, min_length=1, max_length=256)  # vLLM's: the response's id, after its prefix
    length_penalty: float | None = None  # vLLM's, for beam search: only 1 (see UNSUPPORTED)
    priority: int | None = None  # vLLM's, for priority scheduling: only 0 (see UNSUPPORTED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: top logprobs of each prompt token
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {"json" | "regex" | "choice" | "grammar" | ...}
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # only xgrammar (or auto) is served
    response_format: dict[str, Any] | None = None  # OpenAI's: text, json_object or json_schema
    prompt_chunks: list[str] | None = Field(None, max_length=MAX_PROMPT_CHUNKS)  # pagedrag's: see the module doc
    speculative_decoding: bool = True  # pagedrag's: false keeps the request from drafting (speculative_config)

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, unused in cls.UNSUPPORTED.items():
                if data.get(name) is not None and data[name] not in unused:
                    raise ParameterError(name, f"'{name}' is not supported by this server"
                                               f"{cls.UNSUPPORTED_HINTS.get(name, '')}")
        return data

    @field_validator("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
                     "include_stop_str_in_output", "skip_special_tokens", "stream", "speculative_decoding",
                     "spaces_between_special_tokens", "return_tokens_as_token_ids", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingRequest":
        """As OpenAI and vLLM: stream_options without streaming is a mistake, not a no-op."""
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def prompt_field(self) -> str:
        """The field that carries the prompt, named by errors about it."""
        raise NotImplementedError

    @property
    def max_tokens_field(self) -> str:
        """The field that carries the generation limit, named by errors about it."""
        return "max_tokens"

    def field_named(self, param: str | None) -> str | None:
        """This request's own field for the engine parameter an error names (its ``param``)."""
        return {"prompt": self.prompt_field, "max_tokens": self.max_tokens_field}.get(param, param)

    def max_new_tokens(self) -> int | None:
        """The generation limit; None: until EOS, a stop, or max_model_len."""
        raise NotImplementedError

    def num_prompts(self) -> int:
        """How many prompts the request carries (each runs n completions)."""
        raise NotImplementedError

    def num_logprobs(self) -> int | None:
        """Top logprobs to return per token; None: no logprobs."""
        raise NotImplementedError

    def sampling_params(self) -> SamplingParams:
        """The engine's SamplingParams; raises ValueError on out-of-range values."""
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=self.max_new_tokens(), min_tokens=self.min_tokens, logprobs=self.num_logprobs(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens, logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens, prompt_logprobs=self.prompt_logprobs,
            structured_outputs=self.structured_outputs_params(), speculative_decoding=self.speculative_decoding)

    @property
    def constraint_field(self) -> str:
        """The field that carries the output constraint, named by errors about it."""
        named = [name for name in ("structured_outputs", *self.GUIDED, "response_format")
                 if getattr(self, name) is not None]
        return named[0] if named else "structured_outputs"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever one field gave it (a ParameterError
        naming the fields for two, or the field of a bad one)."""
        given = self._constraint_sources()
        if len(given) > 1:
            raise ParameterError(sorted(given)[0], f"give one output constraint, got {sorted(given)}")
        name, fields = next(iter(given.items()), (self.constraint_field, None))
        try:
            return StructuredOutputsParams.from_any(fields)
        except (ValueError, TypeError) as error:
            raise ParameterError(name, named(name, error)) from None

    def _constraint_sources(self) -> dict[str, dict]:
        """Each field that constrains the output, as StructuredOutputsParams fields."""
        sources = {} if self.structured_outputs is None else {"structured_outputs": self.structured_outputs}
        for name, field in self.GUIDED.items():
            if getattr(self, name) is not None and name != "guided_whitespace_pattern":
                sources[name] = {field: getattr(self, name)}
        if self.guided_whitespace_pattern is not None:
            raise ParameterError("guided_whitespace_pattern",
                                 "guided_whitespace_pattern is an outlines option that xgrammar does not take; "
                                 "use structured_outputs.disable_any_whitespace for compact JSON")
        try:
            constraint = response_format_fields(self.response_format)
        except (ValueError, TypeError) as error:
            raise ParameterError("response_format", named("response_format", error)) from None
        if constraint is not None:
            sources["response_format"] = constraint
        return sources

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids") from None


class CompletionRequest(SamplingRequest):
    PREFIX: ClassVar[str] = "cmpl"  # of response ids
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **SamplingRequest.UNSUPPORTED, "echo": (False,), "suffix": ("",)}

    prompt: str | list[str] | list[int] | list[list[int]] | None = None  # required unless prompt_segments
    prompt_segments: list[Any] | None = None  # pagedrag's: checked by the engine (inputs.InputProcessor)
    max_tokens: int | None = 16
    best_of: int | None = None  # vLLM's; only 1 (or null) is accepted, see UNSUPPORTED
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (a BOS) around a text prompt

    @property
    def prompt_field(self) -> str:
        return "prompt" if self.prompt_segments is None else "prompt_segments"

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompts(self) -> int:
        return len(self.engine_prompts())

    def engine_prompts(self) -> list[str | list[int] | dict]:
        """One engine prompt (text, token ids, or {"prompt_segments": [...]}) per prompt of a
        possibly batched request; ValueError unless exactly one of prompt and prompt_segments
        is given (prompt_chunks only with prompt)."""
        if self.prompt_segments is not None:
            if self.prompt is not None:
                raise ValueError("give either prompt or prompt_segments, not both")
            if self.prompt_chunks is not None:
                raise ValueError("prompt_chunks cut a prompt into segments; prompt_segments already are "
                                 "segments: give prompt_chunks with prompt, or mark reusable segments")
            return [{"prompt_segments": self.prompt_segments}]
        prompt = self.prompt
        if prompt is None:
            raise ValueError("a completion request needs prompt (or pagedrag's prompt_segments)")
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if len(prompt) > MAX_PROMPTS_PER_REQUEST:
            raise ValueError(f"at most {MAX_PROMPTS_PER_REQUEST} prompts in one request, got {len(prompt)}")
        return list(prompt)


class TextPart(StrictRequest):
    type: Literal["text"]
    text: str


_REFUSED_MESSAGE_FIELDS = {"function_call": ": send 'tool_calls'", "audio": ""}  # name -> what to send instead


class ChatMessage(StrictRequest):
    role: str = Field(min_length=1, max_length=64)  # OpenAI's, or any the model's template knows (as vLLM)
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (checked by pagedrag.tools)
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_legacy_fields(cls, data: Any) -> Any:
        """A message's deprecated ``function_call`` and an assistant's ``audio`` reference would be
        dropped from the conversation the model sees: refused, as the request's own are."""
        if isinstance(data, dict):
            for name, instead in _REFUSED_MESSAGE_FIELDS.items():
                if data.get(name) is not None:
                    raise ValueError(f"a message's '{name}' is not supported by this server{instead}")
        return data

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> "ChatMessage":
        """Only an assistant message may come without content (OpenAI: one that made tool calls)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content: a string or a list of text parts")
        return self


class ChatCompletionRequest(SamplingRequest):
    PREFIX: ClassVar[str] = "chatcmpl"
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {  # OpenAI's audio output and web search: not served
        **SamplingRequest.UNSUPPORTED, "functions": ([],), "function_call": ("none",), "modalities": (["text"],),
        "audio": (), "web_search_options": (), "echo": (False,),
        "add_special_tokens": (False,)}  # a chat's special tokens are its template's

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply continues the last (assistant) message
    documents: list[dict[str, str]] | None = None  # vLLM's: handed to the chat template (RAG templates read them)
    chat_template: str | None = None  # vLLM's field; honoured only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_segments: Any = None  # /v1/completions' own: refused here (_no_prompt_segments)

    @field_validator("prompt_segments", mode="before")
    @classmethod
    def _no_prompt_segments(cls, value: Any) -> Any:
        """A chat has no prompt_segments (its template decides the text): rather than ignore
        them, say so and point to prompt_chunks."""
        if value is not None:
            raise ValueError("prompt_segments is a /v1/completions field; a chat's last user message is "
                             "cut around prompt_chunks (the retrieved chunks' texts)")
        return value

    def request_chat_template(self) -> str | None:
        """The chat template the request brings (top-level or in chat_template_kwargs), if any."""
        from_kwargs = (self.chat_template_kwargs or {}).get("chat_template")
        if self.chat_template is not None and from_kwargs is not None:
            raise ValueError("give chat_template once: top-level or in chat_template_kwargs, not both")
        template = self.chat_template if self.chat_template is not None else from_kwargs
        if template is not None and not isinstance(template, str):
            raise ValueError("chat_template must be a string")
        return template

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs without the template itself, with ``documents`` and
        ``continue_final_message`` where given (as vLLM hands them to the template)."""
        kwargs = {k: v for k, v in (self.chat_template_kwargs or {}).items() if k != "chat_template"}
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        return kwargs

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ParameterError("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def field_named(self, param: str | None) -> str | None:
        return "top_logprobs" if param == "logprobs" else super().field_named(param)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_field(self) -> str:
        return "messages"

    def num_prompts(self) -> int:
        return 1

    def conversation(self) -> list[dict]:
        """The messages as the engine takes them (pagedrag.engine.inputs joins text parts)."""
        return [message.model_dump(exclude_none=True) for message in self.messages]


# ---- responses ------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    """How the KV of the prompt tokens came to be, counted when each prompt was first
    scheduled: OpenAI's cached_tokens (prefix-cache hits), and pagedrag's chunk-reuse figures
    (0 without --enable-chunk-reuse): chunk_cache_hits (tokens whose KV came from a chunk
    cached at another position), chunk_tokens_recomputed (tokens of reused chunks computed
    again), prompt_tokens_computed (tokens the model computed, the recomputed ones included),
    and tier_cache_hits: of the cache hits (cached_tokens and chunk_cache_hits), those loaded
    from a KV tier, by tier (``host``, ``disk``; empty without tiers or without a tier hit).

    Invariants: prompt_tokens = cached_tokens + chunk_cache_hits + prompt_tokens_computed;
    sum(tier_cache_hits.values()) <= cached_tokens + chunk_cache_hits.
    """

    cached_tokens: int = 0
    chunk_cache_hits: int = 0
    chunk_tokens_recomputed: int = 0
    prompt_tokens_computed: int = 0
    tier_cache_hits: dict[str, int] = Field(default_factory=dict)

    @classmethod
    def of(cls, prompt_tokens: int, cached_tokens: int, chunk_cache_hits: int,
           chunk_tokens_recomputed: int, tier_cache_hits: dict[str, int]) -> "PromptTokensDetails":
        return cls(cached_tokens=cached_tokens, chunk_cache_hits=chunk_cache_hits,
                   chunk_tokens_recomputed=chunk_tokens_recomputed,
                   prompt_tokens_computed=prompt_tokens - cached_tokens - chunk_cache_hits,
                   tier_cache_hits=tier_cache_hits)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and also one chunk of a streamed one (same object, as OpenAI)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    # vLLM's extension, whole responses of one prompt with prompt_logprobs: per prompt token
    # (null for the first), token id -> {"logprob", "rank", "decoded_token"}
    prompt_logprobs: list[dict[str, dict] | None] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallItem(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCallItem):
    """A call in a stream: sent whole, in one delta, with its place among the choice's calls."""

    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallItem] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, dict] | None] | None = None  # as CompletionResponse's


class DeltaMessage(BaseModel):
    """A streamed piece of the assistant message; unset fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedrag"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
