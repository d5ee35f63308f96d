"""What ChatPagedRAG and PagedRAGLLM share beyond the engine settings both integrations
share: LangChain's conventions for those settings, and what a response reports."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from langchain_core.language_models import LangSmithParams, LanguageModelInput
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import get_config_list
from langchain_core.utils import from_env, secret_from_env
from langchain_core.utils.utils import _build_model_kwargs, get_pydantic_field_names
from pydantic import Field, SecretStr, model_validator

from pagedrag.client import DEFAULT_MODEL_NAME, Generation, gather_or_cancel, run_sync
from pagedrag.rag import aliases
from pagedrag.rag.chunk_reuse_support import ChunkReuseSettings, chunk_reuse_figures, chunk_reuse_settings
from pagedrag.rag.integration_settings import SAMPLING_SETTINGS, drop_ignored
from pagedrag.sampling_params import SamplingParams
from pagedrag.structured.params import response_format_fields

API_KEY_ENV, BASE_URL_ENV = "PAGEDRAG_API_KEY", "PAGEDRAG_BASE_URL"
# Call keywords that are not sampling: LangChain's own (whether to stream, usage in a stream),
# and the retrieved chunks' texts, which go to the engine client (ChunkReuseSettings.call_chunks)
_CALL_ONLY = ("stream", "stream_usage", "chunks")
_CONSTRAINTS = ("structured_outputs", "guided_decoding")  # SamplingParams fields that shape a reply too
# Arguments of the classes replaced (langchain_community's VLLM / VLLMOpenAI) that do nothing at
# these values: dropped with a warning (drop_ignored); any other value is still refused
_IGNORED_ARGUMENTS = {"use_beam_search": False}


class LangChainSettings(ChunkReuseSettings):
    """The shared engine settings (``pagedrag.rag.integration_settings``, with chunk reuse:
    ``pagedrag.rag.chunk_reuse_support``) as LangChain
    spells them, with ChatOpenAI's names: ``model`` (field ``model_name``), ``model_kwargs``
    and ``extra_body`` for other SamplingParams fields, ``logprobs`` / ``top_logprobs``,
    ``streaming``, ``stream_usage``; the server's URL and key read from the environment.
    ChatOllama's ``num_predict``, ``num_ctx`` and ``repeat_penalty`` are aliases too.
    ``enable_chunk_reuse`` and ``chunk_recompute_fraction`` join ``engine_kwargs``.

    Invariants: as ChatOpenAI does, an unknown constructor argument moves into
    ``model_kwargs`` with a warning; every ``model_kwargs`` / ``extra_body`` key must be a
    SamplingParams field (else the constructor raises), so nothing is dropped.
    """

    model_name: str | None = Field(default=None, alias="model",
                                   description="Model folder or name; None: the embedded SmolLM2 "
                                               "(with base_url: the served model name).")
    base_url: str | None = Field(default_factory=from_env(BASE_URL_ENV, default=None),
                                 description=f"URL of a `pagedrag serve` (env {BASE_URL_ENV}); None: in process.")
    api_key: SecretStr | None = Field(default_factory=secret_from_env(API_KEY_ENV, default=None),
                                      description=f"API key of the server (env {API_KEY_ENV}).")
    model_kwargs: dict[str, Any] = Field(default_factory=dict, description="Other pagedrag.SamplingParams fields.")
    extra_body: dict[str, Any] | None = Field(default=None,
                                              description="Other pagedrag.SamplingParams fields (ChatOpenAI's "
                                                          "name for vLLM's extras).")
    logprobs: bool | None = Field(default=None, description="Return the generated tokens' log probabilities.")
    top_logprobs: int | None = Field(default=None, description="Alternatives per token (needs logprobs=True).")
    streaming: bool = Field(default=False, description="Generate through the stream (callbacks see each token).")
    stream_usage: bool = Field(default=True, description="The last streamed chunk carries the token usage.")

    @model_validator(mode="before")
    @classmethod
    def _route_unknown_arguments(cls, values: Any) -> Any:
        """Aliases renamed and the chunk-reuse engine arguments moved into engine_kwargs first
        (``chunk_reuse_settings``), then ChatOpenAI's rule: unknown arguments go into
        model_kwargs, with a warning."""
        if not isinstance(values, dict):
            return values
        values = drop_ignored(chunk_reuse_settings(values), _IGNORED_ARGUMENTS, cls.__name__,
                              "pagedrag samples n completions, without beam search")
        values["model_kwargs"] = dict(values.get("model_kwargs") or {})  # moved from: not the caller's dict
        return _build_model_kwargs(values, get_pydantic_field_names(cls))

    @model_validator(mode="after")
    def _one_completion_when_streaming(self) -> "LangChainSettings":
        if self.streaming and self.n not in (1, None):
            raise ValueError(f"n must be 1 when streaming, got n={self.n}")
        return self

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": API_KEY_ENV}

    @property
    def lc_attributes(self) -> dict[str, Any]:
        """base_url even when None: a loaded in-process model must not turn remote because
        the loading process has PAGEDRAG_BASE_URL set."""
        return {"base_url": self.base_url}

    @property
    def model_id(self) -> str | None:
        return self.model_name

    @property
    def extra_sampling(self) -> dict[str, Any]:
        kwargs = self.extra_fields(self.model_kwargs, "model_kwargs")
        body = self.extra_fields(dict(self.extra_body or {}), "extra_body")
        both = sorted(set(kwargs) & set(body))
        if both:
            raise ValueError(f"{both} set in both model_kwargs and extra_body; give each once")
        logprobs = self.sampling_logprobs(self.logprobs, self.top_logprobs)
        return {**kwargs, **body, **({"logprobs": logprobs} if logprobs is not None else {})}

    @property
    def model_label(self) -> str:
        """The model's name as responses and traces report it: the one given, else the one the
        engine serves once known (a server's after its first answer), else the embedded model's."""
        known = None if self._client is None else self._client.known_model_name
        return self.model_name or known or DEFAULT_MODEL_NAME

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_label, "base_url": self.base_url, "engine_kwargs": self.engine_kwargs,
                "cache_salt": self.cache_salt, **{name: getattr(self, name) for name in SAMPLING_SETTINGS},
                **self.extra_sampling}

    def call_sampling(self, kwargs: dict[str, Any], stop: list[str] | None) -> SamplingParams:
        """The sampling of one call: ChatOpenAI's per-call keywords (``logprobs`` /
        ``top_logprobs`` and ``response_format`` included) over the instance's settings;
        ``stream`` and ``stream_usage`` are LangChain's own and ``chunks`` the engine
        client's (``call_chunks``): they take no part."""
        call = {name: value for name, value in kwargs.items() if name not in _CALL_ONLY}
        if "logprobs" in call or "top_logprobs" in call:
            call["logprobs"] = self.sampling_logprobs(call.pop("logprobs", self.logprobs),
                                                      call.pop("top_logprobs", self.top_logprobs))
        if "response_format" in call:
            call = _with_response_format(call)
        return self.sampling(call, stop)

    def sampling_logprobs(self, logprobs: bool | int | None, top_logprobs: int | None) -> int | None:
        """SamplingParams.logprobs for a ``logprobs`` / ``top_logprobs`` pair: ChatOpenAI's
        rule (a switch, and the number of alternatives: ``aliases.openai_logprobs``).
        PagedRAGLLM overrides it with the completion LLMs' rule."""
        return aliases.openai_logprobs(logprobs, top_logprobs)

    # ---- one engine batch, failures per input ------------------------------------------
    def batch(self, inputs: list[LanguageModelInput], config: RunnableConfig | list[RunnableConfig] | None = None,
              *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """Every input in one engine batch: ``abatch``, run to its end (Runnable's batch would
        invoke each input on a thread of its own)."""
        return run_sync(self.abatch(inputs, config, return_exceptions=return_exceptions, **kwargs))

    async def abatch(self, inputs: list[LanguageModelInput],
                     config: RunnableConfig | list[RunnableConfig] | None = None,
                     *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """One ``ainvoke`` per input, gathered on one event loop, so the engine client queues
        them in one loop turn (one engine batch). With ``return_exceptions`` (Runnable's
        abatch) a bad input's place holds its error and the others their results; without,
        the first error aborts the other inputs' requests and is raised. (BaseLLM's abatch
        sends every prompt in one generate call, where one bad prompt fails them all.)"""
        if return_exceptions or not inputs:
            return await Runnable.abatch(self, inputs, config, return_exceptions=return_exceptions, **kwargs)
        configs = get_config_list(config, len(inputs))
        limit = configs[0].get("max_concurrency")
        slots = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()

        async def invoke(one: LanguageModelInput, one_config: RunnableConfig) -> Any:
            async with slots:
                return await self.ainvoke(one, one_config, **kwargs)

        return await gather_or_cancel(invoke(one, one_config) for one, one_config in zip(inputs, configs))

    def get_token_ids(self, text: str) -> list[int]:
        """``text`` in the engine's own tokens (in process, or through the server's /tokenize):
        what get_num_tokens and trim_messages count (LangChain's default is GPT-2's)."""
        return self.client.tokenize(text)

    def wants_stream_usage(self, kwargs: dict[str, Any]) -> bool:
        """A call's ``stream_usage`` keyword, else the instance's."""
        value = kwargs.get("stream_usage")
        return self.stream_usage if value is None else bool(value)

    def _with_model_name(self, params: LangSmithParams, overrides: dict[str, Any]) -> LangSmithParams:
        """Tracing parameters naming the model (a per-call ``model`` wins)."""
        model = overrides.get("model")
        params["ls_model_name"] = model if isinstance(model, str) else self.model_label
        return params


def _with_response_format(call: dict[str, Any]) -> dict[str, Any]:
    """Call keywords with OpenAI's ``response_format`` ({"type": "json_schema", "json_schema":
    {"schema": ...}}, {"type": "json_object"} or {"type": "text"}) turned into the
    ``structured_outputs`` it stands for, as ``pagedrag serve`` reads it; "text" constrains
    nothing. A call that also constrains its output another way is a ValueError."""
    call = dict(call)
    constraint = response_format_fields(call.pop("response_format"))
    if constraint is None:
        return call
    given = [name for name in _CONSTRAINTS if call.get(name) is not None]
    if given:
        raise ValueError(f"response_format and {given[0]} both constrain the output; give one")
    return {**call, "structured_outputs": constraint}


def generation_info(choice: Generation, whole: Generation, model_label: str) -> dict[str, Any]:
    """What a finished completion reports: its finish reason, the request's token and cache
    figures (``Generation.cache_figures``: tier hits included; with where the prompt tokens
    came from: ``chunk_reuse_figures``), the model, and (when asked for) its logprobs as
    ChatOpenAI reports them."""
    info = {**whole.cache_figures(), **chunk_reuse_figures(whole), "finish_reason": choice.finish_reason,
            "model_name": model_label}
    if choice.logprobs is not None:
        info["logprobs"] = openai_logprobs(choice)
    return info


def openai_logprobs(generation: Generation) -> dict[str, Any]:
    """A generation's logprobs in OpenAI's chat shape: ``{"content": [{token, logprob,
    bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(item.token, item.logprob), "top_logprobs": [entry(*top) for top in item.top]}
                        for item in generation.logprobs or ()]}
