"""pagedrag for LlamaIndex: the PagedRAG LLM, canonical node order and cache-friendly templates."""

from .base import PagedRAG
from .postprocessor import CanonicalNodePostprocessor
from .templates import PAGEDRAG_QA_TEMPLATE, PAGEDRAG_REFINE_TEMPLATE, canonical_query_engine_kwargs

__all__ = [
           "PAGEDRAG_QA_TEMPLATE",
           "PAGEDRAG_REFINE_TEMPLATE",
           "CanonicalNodePostprocessor",
           "PagedRAG",
           "canonical_query_engine_kwargs",
]
