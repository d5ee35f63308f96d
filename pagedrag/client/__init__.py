"""The engine client that the LlamaIndex and LangChain integrations share.

One interface (``types.EngineClient``: sync, async and streaming forms of completion and
chat, results as ``Generation``; warm-ups, ``warm`` / ``awarm``) over two back ends, chosen by
``connect``:

- ``inprocess``: an AsyncLLMEngine shared by every client of the same engine arguments;
- ``remote``: a ``pagedrag serve`` through the official openai SDK.

``bridge`` runs the synchronous forms on a private event loop. RAG tools (prompt
helpers, chunk order) are in ``pagedrag.rag``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import openai

from pagedrag.config import EngineArgs
from pagedrag.client.bridge import gather_or_cancel, iterate_sync, run_sync
from pagedrag.client.inprocess import InProcessClient, SharedEngine, engine_args, shared_engine, shutdown_shared_engines
from pagedrag.client.remote import RemoteClient, RemoteError
from pagedrag.client.types import (DEFAULT_MODEL_NAME, KV_TIERS, EngineClient, EngineInfo, Generation, Messages,
                                   Prompt, TokenLogprob, ToolRequest, WarmSummary, tier_hits)
from pagedrag.tools import ToolCall

__all__ = ["DEFAULT_MODEL_NAME", "KV_TIERS", "EngineClient", "EngineInfo", "Generation", "InProcessClient", "Messages",
           "Prompt", "RemoteClient", "RemoteError", "SharedEngine", "TokenLogprob", "ToolCall", "ToolRequest",
           "WarmSummary", "check_connection", "connect", "engine_args", "gather_or_cancel", "iterate_sync", "run_sync",
           "shared_engine",
           "shutdown_shared_engines", "tier_hits"]
_ENGINE_DEFAULTS = {field.name: field.default for field in dataclasses.fields(EngineArgs)}


def connect(model: str | None = None, *, base_url: str | None = None, api_key: str | None = None,
            engine_kwargs: dict[str, Any] | None = None, timeout: float = 600.0,
            max_retries: int = openai.DEFAULT_MAX_RETRIES, headers: dict[str, str] | None = None) -> EngineClient:
    """A client of a ``pagedrag serve`` at ``base_url``, or else of the shared in-process
    engine for ``model`` (None: the embedded SmolLM2) and ``engine_kwargs`` (EngineArgs
    fields). ``timeout`` (seconds per request), ``max_retries`` (with backoff, on
    connection errors and 408/409/429/5xx answers) and ``headers`` (sent with every
    request) apply to a server; ``check_connection`` says what does not fit."""
    check_connection(base_url, engine_kwargs or {}, headers)
    if base_url is None:
        return InProcessClient(shared_engine(model, engine_kwargs or {}))
    return RemoteClient(base_url, model, api_key, timeout, max_retries, headers)


def check_connection(base_url: str | None, engine_kwargs: dict[str, Any], headers: dict[str, str] | None) -> None:
    """ValueError for settings the chosen back end would not use: engine arguments other
    than EngineArgs' defaults for a server (it runs with its own flags), HTTP headers for
    an in-process engine."""
    if base_url is None:
        if headers:
            raise ValueError("HTTP headers go to a server (base_url); an in-process engine has none")
        return
    changed = sorted(name for name, value in engine_kwargs.items()
                     if name not in _ENGINE_DEFAULTS or _ENGINE_DEFAULTS[name] != value)
    if changed:
        raise ValueError(f"engine arguments {changed} configure an in-process engine; a server (base_url) "
                         "runs with its own flags (pagedrag serve --help)")
