"""How much of a prompt an engine's prefix cache holds, asked through an integration's client.

Stands in for a client call (``EngineClient.cached_prefix_len(prompt, cache_salt)``) that
the client does not offer yet; when it does, ``EngineSettings.cached_prefix_len`` calls
it and this module goes.
"""

from __future__ import annotations

from pagedrag.client import EngineClient, InProcessClient, Prompt, run_sync


def cached_prefix_len(client: EngineClient, prompt: Prompt, cache_salt: str | None = None) -> int:
    """Leading tokens of ``prompt`` (a text, or messages rendered by the model's chat
    template, tokenized as a request would be) that the engine's prefix cache holds now
    under ``cache_salt``. Nothing is cached, touched or evicted by asking.

    Only an in-process engine answers: a ``pagedrag serve`` does not report its cache.
    """
    if not isinstance(client, InProcessClient):
        raise NotImplementedError("cache-aware order needs an in-process engine; a pagedrag serve "
                                  "does not report what it has cached (use order='stable')")
    token_ids = client.shared.engine_prompt(prompt).token_ids
    return run_sync(client.shared.engine.cached_prefix_len(token_ids, cache_salt))
