"""What ChatPagedRAG and PagedRAGLLM share beyond the engine settings both integrations
share: LangChain's conventions for those settings, and what a response reports."""

from __future__ import annotations

from typing import Any

from langchain_core.language_models import LangSmithParams
from langchain_core.utils import from_env, secret_from_env
from pydantic import Field, SecretStr

from pagedrag.client import DEFAULT_MODEL_NAME, Generation
from pagedrag.rag.integration_settings import EngineSettings


class LangChainSettings(EngineSettings):
    """The shared engine settings (``pagedrag.rag.integration_settings``) as LangChain
    spells them: ``model_name`` (alias ``model``), ``model_kwargs`` for other
    SamplingParams fields, and the server's URL and key read from the environment."""

    model_name: str | None = Field(default=None, alias="model",
                                   description="Model folder or name; None: the embedded SmolLM2 "
                                               "(with base_url: the served model name).")
    base_url: str | None = Field(default_factory=from_env("PAGEDRAG_BASE_URL", default=None),
                                 description="URL of a `pagedrag serve` (env PAGEDRAG_BASE_URL); "
                                             "None: in process.")
    api_key: SecretStr | None = Field(default_factory=secret_from_env("PAGEDRAG_API_KEY", default=None),
                                      description="API key of the server (env PAGEDRAG_API_KEY).")
    model_kwargs: dict[str, Any] = Field(default_factory=dict, description="Other pagedrag.SamplingParams fields.")

    @property
    def model_id(self) -> str | None:
        return self.model_name

    @property
    def extra_sampling(self) -> dict[str, Any]:
        return self.model_kwargs

    @property
    def model_label(self) -> str:
        """The model's name as responses and traces report it."""
        return self.model_name or DEFAULT_MODEL_NAME

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
