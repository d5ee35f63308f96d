"""What ChatPagedRAG and PagedRAGLLM share: their settings and the engine client."""

from __future__ import annotations

from typing import Any

from langchain_core.language_models import LangSmithParams
from langchain_core.utils import from_env, secret_from_env
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from pagedrag import SamplingParams
from pagedrag.client import DEFAULT_MODEL_NAME, EngineClient, Generation, connect, sampling_params


class EngineSettings(BaseModel):
    """Where the engine is and how to sample; instances with the same engine arguments
    share one in-process engine."""

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    model_name: str | None = Field(default=None, alias="model",
                                   description="Model folder or name; None: the embedded SmolLM2 "
                                               "(with base_url: the served model name).")
    base_url: str | None = Field(default_factory=from_env("PAGEDRAG_BASE_URL", default=None),
                                 description="URL of a `pagedrag serve` (env PAGEDRAG_BASE_URL); "
                                             "None: in process.")
    api_key: SecretStr | None = Field(default_factory=secret_from_env("PAGEDRAG_API_KEY", default=None),
                                      description="API key of the server (env PAGEDRAG_API_KEY).")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="pagedrag.EngineArgs fields.")
    temperature: float = Field(default=0.0, ge=0.0, description="0: greedy decoding.")
    max_tokens: int | None = Field(default=256, description="Most tokens to generate; None: until EOS.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] | None = Field(default=None, description="Stop strings.")
    seed: int | None = None
    cache_salt: str | None = Field(default=None, description="Keeps this tenant's cached prefixes apart.")
    timeout: float | None = Field(default=None, description="Seconds a server may take (default 600).")
    max_retries: int = Field(default=2, ge=0, description="Retries of failed connections to a server.")
    model_kwargs: dict[str, Any] = Field(default_factory=dict, description="Other pagedrag.SamplingParams fields.")

    _client: EngineClient | None = PrivateAttr(default=None)

    @property
    def client(self) -> EngineClient:
        """The engine client, connected (and the engine loaded) on first use."""
        if self._client is None:
            api_key = self.api_key.get_secret_value() if self.api_key else None
            self._client = connect(self.model_name, base_url=self.base_url, api_key=api_key,
                                   engine_kwargs=self.engine_kwargs, timeout=self.timeout or 600.0,
                                   max_retries=self.max_retries)
        return self._client

    @property
    def model_label(self) -> str:
        """The model's name as responses and traces report it."""
        return self.model_name or DEFAULT_MODEL_NAME

    def stats(self) -> dict[str, Any]:
        """The engine's counters (prefix cache figures in tokens), as pagedrag.LLM.stats()."""
        return self.client.stats()

    def _sampling(self, stop: list[str] | None, overrides: dict[str, Any]) -> SamplingParams:
        """The instance's sampling settings, updated by a call's stop and keywords."""
        settings = {"temperature": self.temperature, "max_tokens": self.max_tokens, "top_p": self.top_p,
                    "stop": stop if stop is not None else self.stop, "seed": self.seed, **self.model_kwargs}
        return sampling_params(settings, overrides)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_label, "base_url": self.base_url,
                "engine_kwargs": self.engine_kwargs, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "top_p": self.top_p, "seed": self.seed,
                "cache_salt": self.cache_salt, **self.model_kwargs}

    def _with_model_name(self, params: LangSmithParams, overrides: dict[str, Any]) -> LangSmithParams:
        """Tracing parameters naming the model (a per-call ``model`` wins)."""
        model = overrides.get("model")
        params["ls_model_name"] = model if isinstance(model, str) else self.model_label
        return params


def generation_info(generation: Generation, model_label: str) -> dict[str, Any]:
    """What a finished generation reports: finish reason, token and cache figures, model."""
    return {**generation.cache_figures(), "model_name": model_label}
