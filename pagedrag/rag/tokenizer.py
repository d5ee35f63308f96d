"""A model's tokenizer for the prompt tools (explainer, budgets), without its weights:
loaded once per process (pagedrag.models.loader.load_tokenizer saves a GGUF file's
tokenizer once per machine)."""

from __future__ import annotations

import functools
from typing import Any

from pagedrag.models import loader


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str | None = None) -> Any:
    """The tokenizer of ``model``: None for the embedded SmolLM2, a .gguf file, a model
    folder or a hub name.

    Invariant: the same object for the same ``model`` within a process; callers that use
    it from several threads at once must copy it first.
    """
    return loader.load_tokenizer(model)
