"""The names other LLM classes give pagedrag's settings, in one table for both integrations.

A user who swaps ``Vllm`` / ``VllmServer`` (llama-index-llms-vllm), ``ChatOpenAI`` or
``ChatOllama`` for a pagedrag class keeps their arguments; this module says what each one
means here. Three kinds of name:

- sampling aliases: another name of a ``pagedrag.SamplingParams`` field (constructor or
  per call): ``max_new_tokens=3`` is ``max_tokens=3``;
- engine aliases: a top-level constructor argument that is a ``pagedrag.EngineArgs``
  field; it joins ``engine_kwargs`` (``num_ctx=1024`` is ``max_model_len=1024``);
- settings aliases: another name of an ``EngineSettings`` field (``vllm_kwargs`` is
  ``engine_kwargs``; ``api_url``, a VllmServer's ``<server>/generate``, is the base URL).

Invariants: renaming never drops a value: an alias and the name it stands for given
together must agree (else ValueError); a per-call keyword that is neither a SamplingParams
field nor an alias is a TypeError naming it, never ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pagedrag.sampling_params import SamplingParams

SAMPLING_FIELDS = frozenset(field.name for field in dataclasses.fields(SamplingParams))
SAMPLING_ALIASES: Mapping[str, str] = {
    "max_new_tokens": "max_tokens",         # LlamaIndex's Vllm / VllmServer (and Hugging Face)
    "max_completion_tokens": "max_tokens",  # OpenAI, LangChain's ChatOpenAI
    "num_predict": "max_tokens",            # Ollama, LangChain's ChatOllama
    "stop_sequences": "stop",               # LangChain's ChatOpenAI / ChatAnthropic
    "repeat_penalty": "repetition_penalty",  # Ollama
}
ENGINE_ALIASES: Mapping[str, str] = {
    "dtype": "dtype",                        # Vllm: the engine arguments it names itself
    "download_dir": "download_dir",
    "trust_remote_code": "trust_remote_code",
    "tensor_parallel_size": "tensor_parallel_size",
    "num_ctx": "max_model_len",              # Ollama
}
SETTINGS_ALIASES: Mapping[str, str] = {
    "vllm_kwargs": "engine_kwargs",          # Vllm: vllm.LLM's arguments; here pagedrag.EngineArgs'
    "api_url": "base_url",                   # VllmServer: <server>/generate (see base_url_of)
    "api_headers": "default_headers",        # VllmServer; ChatOpenAI calls them default_headers
    "openai_api_base": "base_url",           # ChatOpenAI's / VLLMOpenAI's field names (base_url, api_key
    "openai_api_key": "api_key",             # and timeout are their aliases: LangChain's vLLM recipe
    "request_timeout": "timeout",            # writes VLLMOpenAI(openai_api_base=..., openai_api_key=...))
}
BEST_OF = "best_of"  # vLLM's: sample best_of, keep the n most likely; pagedrag samples exactly n
BEAM_SEARCH = "use_beam_search"  # vLLM's former SamplingParams field (LLM.beam_search replaced it)
# SamplingParams fields whose results a framework's response has no place for (pagedrag.LLM
# and the server's /v1/completions return them)
UNREPORTED = ("prompt_logprobs",)
ROUTE_SUFFIXES = ("/generate", "/v1/chat/completions", "/v1/completions", "/chat/completions", "/completions")


def alias_names() -> frozenset[str]:
    """Every alias a constructor accepts (for LangChain's sorting of unknown arguments)."""
    return frozenset({*SAMPLING_ALIASES, *ENGINE_ALIASES, *SETTINGS_ALIASES})


def base_url_of(api_url: str | None) -> str | None:
    """The server's base URL in a VllmServer ``api_url``: a trailing ``/generate`` (or an
    OpenAI route) cut off; None or "" (Vllm's "in process") stay None."""
    if not api_url:
        return None
    url = api_url.rstrip("/")
    for suffix in ROUTE_SUFFIXES:
        if url.endswith(suffix):
            return url[:-len(suffix)]
    return url


def canonical_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor arguments under pagedrag's names: settings and sampling aliases renamed,
    engine aliases moved into ``engine_kwargs`` (None: the engine's default, left out)."""
    if "api_url" in values:
        values = {**values, "api_url": base_url_of(values["api_url"])}
    settings = _renamed(values, {**SETTINGS_ALIASES, **SAMPLING_ALIASES})
    moved = {ENGINE_ALIASES[name]: settings.pop(name) for name in list(settings) if name in ENGINE_ALIASES}
    moved = {name: value for name, value in moved.items() if value is not None}
    if moved:
        settings["engine_kwargs"] = _merged(settings.get("engine_kwargs") or {}, moved, "engine_kwargs")
    return settings


def canonical_sampling(kwargs: Mapping[str, Any], where: str = "keyword arguments") -> dict[str, Any]:
    """SamplingParams keywords (and vLLM's ``best_of`` and ``use_beam_search``) under their field
    names; anything else is a TypeError naming it."""
    renamed = _renamed(kwargs, SAMPLING_ALIASES)
    unknown = sorted(set(renamed) - SAMPLING_FIELDS - {BEST_OF, BEAM_SEARCH})
    if unknown:
        raise TypeError(f"{where} {unknown} are not pagedrag.SamplingParams fields (nor their aliases "
                        f"{sorted(SAMPLING_ALIASES)})")
    return renamed


def sampling_params(settings: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams from canonical settings. ``best_of`` is accepted where it changes
    nothing (None, or equal to n); pagedrag never samples more than n (vLLM V1 dropped
    best_of too), so any other value is a ValueError rather than quietly ignored. So are
    the UNREPORTED fields, whose results would be computed and then dropped, and beam search
    (``use_beam_search``: only False is accepted)."""
    settings = dict(settings)
    if settings.pop(BEAM_SEARCH, False) is not False:
        raise ValueError("use_beam_search=True is not supported here: pagedrag samples n completions; "
                         "pagedrag.LLM.beam_search runs beam search offline")
    best_of, n = settings.pop(BEST_OF, None), settings.get("n", 1)
    if best_of is not None and best_of != n:
        raise ValueError(f"best_of={best_of} is not supported: pagedrag samples exactly n={n} completions "
                         "(use n, or best_of=None)")
    unreported = sorted(name for name in UNREPORTED if settings.get(name) is not None)
    if unreported:
        raise ValueError(f"{unreported}: the integrations' responses have no place for these results; "
                         "pagedrag.LLM and the server's /v1/completions return them")
    return SamplingParams(**settings)


def openai_logprobs(logprobs: bool | None, top_logprobs: int | None) -> int | None:
    """OpenAI's pair (logprobs: bool, top_logprobs: int) as SamplingParams.logprobs: None
    unless logprobs is true; then the number of top alternatives (0: the sampled token's only)."""
    if top_logprobs and not logprobs:
        raise ValueError("top_logprobs needs logprobs=True")
    return (top_logprobs or 0) if logprobs else None


def _renamed(values: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """``values`` with each alias renamed to its target; ValueError when an alias and its
    target (or two aliases of one target) carry different values."""
    renamed: dict[str, Any] = {}
    given: dict[str, str] = {}  # target -> the name it was given under
    for name, value in values.items():
        target = aliases.get(name, name)
        if target in renamed and renamed[target] != value:
            raise ValueError(f"{given[target]}={renamed[target]!r} and {name}={value!r} set the same thing "
                             f"({target}); give one")
        renamed[target], given[target] = value, name
    return renamed


def _merged(base: Mapping[str, Any], extra: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``base`` with ``extra`` added; ValueError when both set a key to different values."""
    clashes = sorted(name for name in extra if name in base and base[name] != extra[name])
    if clashes:
        raise ValueError(f"{clashes} set both as arguments of their own and in {where}, to different values")
    return {**base, **extra}
