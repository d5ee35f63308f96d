"""The engine client that the LlamaIndex and LangChain integrations share.

One interface (``types.EngineClient``: sync, async and streaming forms of completion and
chat, results as ``Generation``) over two back ends, chosen by ``connect``:

- ``inprocess``: an AsyncLLMEngine shared by every client of the same engine arguments;
- ``remote``: a ``pagedrag serve`` through the official openai SDK.

``bridge`` runs the synchronous forms on a private event loop. RAG tools (prompt
helpers, chunk order) are in ``pagedrag.rag``.
"""

from __future__ import annotations

from typing import Any

import openai

from pagedrag.client.bridge import iterate_sync, run_sync
from pagedrag.client.inprocess import InProcessClient, SharedEngine, shared_engine
from pagedrag.client.remote import RemoteClient, RemoteError
from pagedrag.client.types import DEFAULT_MODEL_NAME, EngineClient, EngineInfo, Generation, Messages, Prompt, sampling_params

__all__ = ["DEFAULT_MODEL_NAME", "EngineClient", "EngineInfo", "Generation", "InProcessClient", "Messages",
           "Prompt", "RemoteClient", "RemoteError", "SharedEngine", "connect", "iterate_sync", "run_sync",
           "sampling_params", "shared_engine"]


def connect(model: str | None = None, *, base_url: str | None = None, api_key: str | None = None,
            engine_kwargs: dict[str, Any] | None = None, timeout: float = 600.0,
            max_retries: int = openai.DEFAULT_MAX_RETRIES) -> EngineClient:
    """A client of a ``pagedrag serve`` at ``base_url``, or else of the shared in-process
    engine for ``model`` (None: the embedded SmolLM2) and ``engine_kwargs`` (EngineArgs
    fields). ``timeout`` (seconds per request) and ``max_retries`` (with backoff, on
    connection errors and 408/409/429/5xx answers) apply to a server."""
    if base_url is None:
        return InProcessClient(shared_engine(model, engine_kwargs or {}))
    if engine_kwargs:
        raise ValueError("engine_kwargs configure an in-process engine; a server takes its own flags")
    return RemoteClient(base_url, model, api_key, timeout, max_retries)
