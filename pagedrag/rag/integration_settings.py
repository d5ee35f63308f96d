"""The settings block that the LlamaIndex and LangChain integrations share: where the
engine is, how to sample, and the calls built on those (client, stats, cache probe).

Each integration's model class inherits ``EngineSettings`` next to its framework's base
class and keeps only its framework's conventions: what the model's name and the extra
sampling fields are called (``model_id`` and ``extra_sampling`` map them here), and
where a default comes from (LangChain reads the environment). The other names that
those frameworks' classes give these settings (``max_new_tokens``, ``vllm_kwargs``,
``max_completion_tokens``, ``num_ctx``, ...) are ``pagedrag.rag.aliases``'s, accepted by
every class that inherits this one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from pagedrag.client import EngineClient, Prompt, check_connection, connect, engine_args
from pagedrag.rag import aliases
from pagedrag.rag.prefix_probe import cached_prefix_len
from pagedrag.sampling_params import SamplingParams

logger = logging.getLogger("pagedrag")
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MAX_TOKENS = 512  # Vllm's and langchain_community VLLM's max_new_tokens (ChatPagedRAG: None, as ChatOpenAI)
DEFAULT_MAX_RETRIES = 2
# Settings read into every request; None leaves a field to SamplingParams' default.
# (max_tokens is always sent: None there means "until EOS", not SamplingParams' 16.)
SERVER_ONLY = ("api_key", "timeout", "max_retries")  # a connection's: an in-process engine has none
# Engine arguments that a server (base_url) ignores at the value the replaced classes default
# to: VllmServer inherits Vllm's trust_remote_code=True and never uses it.
SERVER_IGNORED_ENGINE_ARGS = {"trust_remote_code": True}
SAMPLING_SETTINGS = ("temperature", "max_tokens", "top_p", "top_k", "n", "best_of", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "stop", "seed", "ignore_eos")


class EngineSettings(BaseModel):
    """Where the engine is and how to sample.

    Invariants: the client connects on first use of ``client`` and is the same object
    afterwards; instances whose model and engine arguments match (after EngineArgs fills
    in defaults) share one in-process engine and its prefix cache, which ``cache_salt``
    divides between tenants. Every argument is kept or refused at construction: the
    sampling settings build a SamplingParams, the engine arguments an EngineArgs (for an
    in-process engine), so a value either would refuse fails here, not at the first call.
    """

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    base_url: str | None = Field(default=None, description="URL of a `pagedrag serve`; None: in process.")
    api_key: SecretStr | None = Field(default=None, description="API key of the server, if it asks for one.")
    default_headers: dict[str, str] | None = Field(default=None,
                                                   description="HTTP headers sent to the server with every request.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="pagedrag.EngineArgs fields.")
    temperature: float | None = Field(default=0.0, description="0: greedy decoding; None: 1.0 (SamplingParams').")
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS,
                                   description="Most tokens to generate; None: until EOS.")
    top_p: float | None = Field(default=None, description="Nucleus sampling; None: 1.0 (off).")
    top_k: int | None = Field(default=None, description="Top-k sampling; None, 0 or -1: off.")
    n: int | None = Field(default=1, description="Completions per prompt; None: 1.")
    best_of: int | None = Field(default=None, description="vLLM's best_of: only None or n (pagedrag samples n).")
    presence_penalty: float | None = Field(default=None, description="In [-2, 2]; None: 0.")
    frequency_penalty: float | None = Field(default=None, description="In [-2, 2]; None: 0.")
    repetition_penalty: float | None = Field(default=None, description="In (0, 2]; None: 1 (off).")
    stop: list[str] | str | None = Field(default=None, description="Stop strings (one may be given as a string).")
    seed: int | None = None
    ignore_eos: bool = Field(default=False, description="Generate past the end-of-sequence token.")
    cache_salt: str | None = Field(default=None, description="Keeps this tenant's cached prefixes apart.")
    timeout: float | None = Field(default=None,
                                  description=f"Seconds a server may take; None: {DEFAULT_TIMEOUT_S:.0f}.")
    max_retries: int | None = Field(default=DEFAULT_MAX_RETRIES, ge=0,
                                    description="Retries of failed connections to a server.")

    _client: EngineClient | None = PrivateAttr(default=None)

    # ---- copies connect afresh: a copy's fields may name another engine or server -------------
    def __copy__(self):
        copied = super().__copy__()
        copied._client = None
        return copied

    def __deepcopy__(self, memo: dict | None = None):
        memo = {} if memo is None else memo
        if self._client is not None:
            memo[id(self._client)] = None  # deepcopy hands the copy None for the client
        return super().__deepcopy__(memo)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the client (threads, an engine): the loaded copy connects on first use."""
        state = super().__getstate__()
        private = state.get("__pydantic_private__")
        if private:
            state["__pydantic_private__"] = {**private, "_client": None}
        return state

    @model_validator(mode="before")
    @classmethod
    def _canonical_names(cls, values: Any) -> Any:
        """Other frameworks' names for these settings, renamed (pagedrag.rag.aliases)."""
        return aliases.canonical_settings(values) if isinstance(values, dict) else values

    @model_validator(mode="after")
    def _check_settings(self) -> "EngineSettings":
        """Refuse now what a call would refuse later (see the class's invariants)."""
        if self.base_url is not None:
            kept = drop_ignored(self.engine_kwargs, SERVER_IGNORED_ENGINE_ARGS, type(self).__name__,
                                "the server (base_url) runs with its own flags")
            if kept is not self.engine_kwargs:  # (assigning marks the field as set)
                self.engine_kwargs = kept
        check_connection(self.base_url, self.engine_kwargs, self.default_headers)
        if self.base_url is None:
            engine_args(self.model_id, self.engine_kwargs)
            self._warn_server_only()
        self.sampling({})
        return self

    def _warn_server_only(self) -> None:
        """A logged warning (the ecosystem's way with a client setting a back end does not
        use) for connection settings given to an in-process engine. Only values other than
        the defaults count: a saved instance loaded again (``to_dict`` / ``dumpd`` spell every
        field out) is not warned about."""
        given = [name for name in SERVER_ONLY if self._differs_from_default(name)]
        if given:
            logger.warning("%s: %s not used: connection settings of a server (base_url), and the engine runs in "
                           "process", type(self).__name__, ", ".join(given))

    def _differs_from_default(self, name: str) -> bool:
        """Whether the field was given, with a value other than its default."""
        default = type(self).model_fields[name].get_default(call_default_factory=True)
        return name in self.model_fields_set and getattr(self, name) != default

    @property
    def model_id(self) -> str | None:
        """The model to connect to (None: the embedded default, or the served one)."""
        raise NotImplementedError

    @property
    def extra_sampling(self) -> dict[str, Any]:
        """Other pagedrag.SamplingParams fields the instance sets (under canonical names;
        ``extra_fields`` checks a user's dict of them)."""
        raise NotImplementedError

    @property
    def client(self) -> EngineClient:
        """The engine client, connected (and the engine loaded) on first use."""
        if self._client is None:
            api_key = self.api_key.get_secret_value() if self.api_key else None
            timeout = DEFAULT_TIMEOUT_S if self.timeout is None else self.timeout
            retries = DEFAULT_MAX_RETRIES if self.max_retries is None else self.max_retries
            self._client = connect(self.model_id, base_url=self.base_url, api_key=api_key,
                                   engine_kwargs=self.engine_kwargs, timeout=timeout, max_retries=retries,
                                   headers=self.default_headers)
        return self._client

    def stats(self) -> dict[str, Any]:
        """The engine's counters (prefix cache figures in tokens), as pagedrag.LLM.stats()."""
        return self.client.stats()

    def sampling(self, overrides: dict[str, Any], stop: list[str] | None = None) -> SamplingParams:
        """The instance's sampling settings, updated by a call's ``stop`` (when given) and
        its keywords: SamplingParams fields or their aliases (anything else: TypeError)."""
        settings = {name: getattr(self, name) for name in SAMPLING_SETTINGS}
        settings = {name: value for name, value in settings.items() if value is not None or name == "max_tokens"}
        call = aliases.canonical_sampling(overrides, "call keywords")
        call = {name: value for name, value in call.items() if value is not None or name == "max_tokens"}  # None: as set
        if stop is not None:
            if call.get("stop", stop) != stop:
                raise ValueError(f"stop={stop!r} and the call's stop sequences {call['stop']!r} set the same "
                                 "thing; give one")
            call["stop"] = stop
        return aliases.sampling_params({**settings, **self.extra_sampling, **call})

    def extra_fields(self, extras: dict[str, Any], where: str) -> dict[str, Any]:
        """A user's dict of other SamplingParams fields (additional_kwargs, model_kwargs,
        extra_body), under canonical names; they win over the settings' defaults (vLLM's
        ``extra_body={"top_k": 5}`` is top_k=5). A TypeError names keys that are not
        SamplingParams fields, a ValueError those that contradict an argument given too."""
        fields = aliases.canonical_sampling(extras, f"{where} keys")
        clashes = sorted(name for name, value in fields.items()
                         if name in self.model_fields_set and getattr(self, name) != value)
        if clashes:
            raise ValueError(f"{where} sets {clashes}, also given as arguments of their own (to other values); "
                             "give each once")
        return fields

    def cached_prefix_len(self, prompt: Prompt) -> int:
        """Leading tokens of ``prompt`` (a text, or chat messages) that the engine's prefix
        cache holds now for this instance's ``cache_salt``; what cache-aware order asks."""
        return cached_prefix_len(self.client, prompt, self.cache_salt)


def drop_ignored(values: dict[str, Any], ignored: Mapping[str, Any], owner: str, why: str) -> dict[str, Any]:
    """``values`` without the entries that hold the value ``ignored`` gives for their name (a
    replaced class's default, which does nothing here), each named in a logged warning (the
    ecosystem's way with a setting a back end does not use). Any other value of those names
    stays, to be used or refused where it would be without this."""
    dropped = sorted(name for name, value in ignored.items() if name in values and values[name] == value)
    if not dropped:
        return values
    logger.warning("%s: %s not used (ignored, as the classes it replaces ignore it): %s", owner,
                   ", ".join(f"{name}={values[name]!r}" for name in dropped), why)
    return {name: value for name, value in values.items() if name not in dropped}
