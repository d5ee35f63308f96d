"""Llama-family models for the paged KV cache and the loader that builds them.

The names below load lazily, so importing ``pagedrag.models.attention`` (the
kernels' seam) does not import transformers.
"""

from importlib import import_module

_EXPORTS = {
    "LlamaForCausalLM": "pagedrag.models.llama",
    "SUPPORTED_ARCHITECTURES": "pagedrag.models.llama",
    "LoadedModel": "pagedrag.models.loader",
    "load_model": "pagedrag.models.loader",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
