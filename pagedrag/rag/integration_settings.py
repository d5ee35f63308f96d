"""The settings block that the LlamaIndex and LangChain integrations share: where the
engine is, how to sample, and the calls built on those (client, stats, cache probe).

Each integration's model class inherits ``EngineSettings`` next to its framework's base
class and keeps only its framework's conventions: what the model's name and the extra
sampling fields are called (``model_id`` and ``extra_sampling`` map them here), and
where a default comes from (LangChain reads the environment).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from pagedrag.client import EngineClient, Prompt, connect, sampling_params
from pagedrag.sampling_params import SamplingParams

from pagedrag.rag.prefix_probe import cached_prefix_len

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MAX_TOKENS = 256


class EngineSettings(BaseModel):
    """Where the engine is and how to sample.

    Invariants: the client connects on first use of ``client`` and is the same object
    afterwards; instances whose model and engine arguments match (after EngineArgs fills
    in defaults) share one in-process engine and its prefix cache, which ``cache_salt``
    divides between tenants.
    """

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    base_url: str | None = Field(default=None, description="URL of a `pagedrag serve`; None: in process.")
    api_key: SecretStr | None = Field(default=None, description="API key of the server, if it asks for one.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="pagedrag.EngineArgs fields.")
    temperature: float = Field(default=0.0, ge=0.0, description="0: greedy decoding.")
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS,
                                   description="Most tokens to generate; None: until EOS.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] | None = Field(default=None, description="Stop strings.")
    seed: int | None = None
    cache_salt: str | None = Field(default=None, description="Keeps this tenant's cached prefixes apart.")
    timeout: float | None = Field(default=None,
                                  description=f"Seconds a server may take; None: {DEFAULT_TIMEOUT_S:.0f}.")
    max_retries: int = Field(default=2, ge=0, description="Retries of failed connections to a server.")

    _client: EngineClient | None = PrivateAttr(default=None)

    @property
    def model_id(self) -> str | None:
        """The model to connect to (None: the embedded default, or the served one)."""
        raise NotImplementedError

    @property
    def extra_sampling(self) -> dict[str, Any]:
        """Other pagedrag.SamplingParams fields the instance sets."""
        raise NotImplementedError

    @property
    def client(self) -> EngineClient:
        """The engine client, connected (and the engine loaded) on first use."""
        if self._client is None:
            api_key = self.api_key.get_secret_value() if self.api_key else None
            timeout = DEFAULT_TIMEOUT_S if self.timeout is None else self.timeout
            self._client = connect(self.model_id, base_url=self.base_url, api_key=api_key,
                                   engine_kwargs=self.engine_kwargs, timeout=timeout, max_retries=self.max_retries)
        return self._client

    def stats(self) -> dict[str, Any]:
        """The engine's counters (prefix cache figures in tokens), as pagedrag.LLM.stats()."""
        return self.client.stats()

    def sampling(self, overrides: dict[str, Any], stop: list[str] | None = None) -> SamplingParams:
        """The instance's sampling settings, updated by a call's ``stop`` (when given) and
        its SamplingParams keywords."""
        settings = {"temperature": self.temperature, "max_tokens": self.max_tokens, "top_p": self.top_p,
                    "stop": self.stop if stop is None else stop, "seed": self.seed, **self.extra_sampling}
        return sampling_params(settings, overrides)

    def cached_prefix_len(self, prompt: Prompt) -> int:
        """Leading tokens of ``prompt`` (a text, or chat messages) that the engine's prefix
        cache holds now for this instance's ``cache_salt``; what cache-aware order asks."""
        return cached_prefix_len(self.client, prompt, self.cache_salt)
