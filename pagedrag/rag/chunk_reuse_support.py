"""Chunk reuse (``EngineArgs.enable_chunk_reuse``) in the LlamaIndex and LangChain integrations:
the constructor keywords, the retrieved chunks a call passes to the engine, and the figures a
response reports.

- Keywords: ``enable_chunk_reuse`` and ``chunk_recompute_fraction`` are EngineArgs fields, so
  they go in ``engine_kwargs`` (or LlamaIndex's ``vllm_kwargs``); given as constructor
  arguments of their own they join ``engine_kwargs`` (``chunk_reuse_settings``). A server
  (``base_url``) runs with its own flags, so there they are refused.
- Boundaries: the integrations' canonical-order components (LlamaIndex's node postprocessor,
  LangChain's CanonicalDocuments) tell the model which texts are retrieved chunks
  (``ChunkReuseSettings.expect_chunks``); each call then passes those its prompt holds as
  ``chunks=``, so the engine cuts the prompt exactly around them instead of at blank lines
  (``pagedrag.engine.segments``). A caller's own ``chunks=`` wins.
- Figures: ``chunk_reuse_figures`` of a finished generation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import PrivateAttr, model_validator

from pagedrag.client import Generation, Prompt
from pagedrag.rag import aliases
from pagedrag.rag.integration_settings import EngineSettings

CHUNK_REUSE_ARGS = ("enable_chunk_reuse", "chunk_recompute_fraction")
"""The EngineArgs fields of chunk reuse, accepted as constructor arguments of their own."""
DEFAULT_CAPACITY = 4096  # chunk texts a model remembers (the most recent); a lookup is one `in` each


def chunk_reuse_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor arguments under pagedrag's names (``aliases.canonical_settings``), with
    ``enable_chunk_reuse`` / ``chunk_recompute_fraction`` given as arguments of their own
    moved into ``engine_kwargs`` (None: the engine's default, left out).

    Invariants: nothing is dropped: a value also set in engine_kwargs must agree (else
    ValueError); with ``base_url`` (a server, which decides with ``pagedrag serve
    --enable-chunk-reuse``) any given value is a ValueError. Idempotent.
    """
    settings = aliases.canonical_settings(values)
    given = {name: settings.pop(name) for name in CHUNK_REUSE_ARGS if name in settings}
    given = {name: value for name, value in given.items() if value is not None}
    if not given:
        return settings
    if settings.get("base_url"):
        raise ValueError(f"{sorted(given)} configure an in-process engine; a server (base_url) decides chunk "
                         "reuse itself (pagedrag serve --enable-chunk-reuse [--chunk-recompute-fraction F])")
    engine_kwargs = dict(settings.get("engine_kwargs") or {})
    clashes = sorted(name for name in given if name in engine_kwargs and engine_kwargs[name] != given[name])
    if clashes:
        raise ValueError(f"{clashes} set both as arguments of their own and in engine_kwargs, to different values")
    settings["engine_kwargs"] = {**engine_kwargs, **given}
    return settings


class ChunkTexts:
    """The retrieved chunks' texts a model was told of, to find again in its prompts.

    Invariants: holds at most ``capacity`` distinct non-blank texts, the most recently added
    (least recently added dropped first). ``found_in(text)`` returns held texts that occur in
    ``text``, ordered by where they occur, none overlapping another: where several start at
    one place the longest wins, and a text that starts inside a kept one is left out. So the
    engine's search (``engine.segments.chunk_pieces``: each chunk at its first place no
    earlier chunk took) finds each exactly where it was found here. Safe to share between
    threads.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._texts: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._texts)

    def __getstate__(self) -> dict[str, Any]:
        """The texts without the lock, so that a copied or pickled model can be made."""
        with self._lock:
            return {"capacity": self.capacity, "texts": list(self._texts)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["capacity"])
        self.add(state["texts"])

    def add(self, texts: Iterable[str]) -> None:
        """Remember ``texts`` (blank ones skipped) as the most recent."""
        with self._lock:
            for text in texts:
                if text.strip():
                    self._texts[text] = None
                    self._texts.move_to_end(text)
            while len(self._texts) > self.capacity:
                self._texts.popitem(last=False)

    def found_in(self, text: str) -> list[str]:
        """The held texts in ``text``, in order, none overlapping (see the class invariants)."""
        with self._lock:
            held = list(self._texts)
        places = sorted(((text.find(chunk), -len(chunk), chunk) for chunk in held if chunk in text))
        found, end = [], 0
        for start, _, chunk in places:
            if start >= end:
                found.append(chunk)
                end = start + len(chunk)
        return found


def searched_text(prompt: Prompt) -> str | None:
    """The part of a prompt the engine cuts into chunks: a text prompt whole, a chat's last
    user message's content (None when that is not a text, as the engine then does not cut)."""
    if isinstance(prompt, str):
        return prompt
    users = [message for message in prompt if message.get("role") == "user"]
    content = users[-1].get("content") if users else None
    return content if isinstance(content, str) else None


class ChunkReuseSettings(EngineSettings):
    """The shared engine settings with chunk reuse: the constructor keywords
    (``chunk_reuse_settings``), the chunk texts the model was told of, and the ``chunks`` of
    each call. Both integrations' model classes inherit it.

    Invariants: a caller's ``chunks`` are passed on as given (an engine without chunk reuse
    ignores them); without them, a call passes the told-of texts its prompt holds, in
    prompt order, and only when chunk reuse may be on (``chunk_reuse_possible``), else None.
    """

    _chunk_texts: ChunkTexts = PrivateAttr(default_factory=ChunkTexts)

    @model_validator(mode="before")
    @classmethod
    def _chunk_reuse_arguments(cls, values: Any) -> Any:
        """``enable_chunk_reuse`` / ``chunk_recompute_fraction`` moved into engine_kwargs."""
        return chunk_reuse_settings(values) if isinstance(values, Mapping) else values

    @property
    def chunk_reuse_possible(self) -> bool:
        """Whether this model's engine may reuse chunks: in process, when its engine_kwargs
        enable it; a server decides for itself, so always with ``base_url``."""
        return self.base_url is not None or bool(self.engine_kwargs.get("enable_chunk_reuse", False))

    def expect_chunks(self, texts: Iterable[str]) -> None:
        """Tell the model that ``texts`` are retrieved chunks that its prompts may hold
        verbatim (a no-op unless ``chunk_reuse_possible``)."""
        if self.chunk_reuse_possible:
            self._chunk_texts.add(texts)

    def call_chunks(self, prompt: Prompt, given: Sequence[str] | None = None) -> Sequence[str] | None:
        """The ``chunks`` a call passes to the engine (see the class invariants)."""
        if given is not None:
            return given
        text = searched_text(prompt) if self.chunk_reuse_possible else None
        return (self._chunk_texts.found_in(text) or None) if text else None


def chunk_reuse_figures(generation: Generation) -> dict[str, int]:
    """Where a finished generation's prompt tokens came from: ``prefix_cache_hits`` (the
    prefix cache; the same as cached_tokens), ``chunk_cache_hits`` (chunks cached at another
    position), ``prompt_tokens_computed`` (the rest, computed by the model), and of those
    ``chunk_tokens_recomputed`` (tokens of reused chunks computed again).

    Invariant: prompt_tokens = prefix_cache_hits + chunk_cache_hits + prompt_tokens_computed.
    """
    return {"prefix_cache_hits": generation.cached_tokens, "chunk_cache_hits": generation.chunk_cache_hits,
            "chunk_tokens_recomputed": generation.chunk_tokens_recomputed,
            "prompt_tokens_computed": generation.prompt_tokens_computed}


def cache_read_tokens(generation: Generation) -> int:
    """Prompt tokens whose KV came from a cache: prefix hits and chunk hits."""
    return generation.cached_tokens + generation.chunk_cache_hits
