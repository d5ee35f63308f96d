"""Structured outputs: constraints on a request's output (params), compiled to grammars
(compiler), whose masks limit each step's tokens (masks)."""

from pagedrag.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
