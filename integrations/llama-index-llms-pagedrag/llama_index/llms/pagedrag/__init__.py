"""pagedrag for LlamaIndex: the PagedRAG LLM, canonical node order and cache-friendly templates."""

from .base import PagedRAG
from .postprocessor import CanonicalNodePostprocessor
from .query_engine import canonical_query_engine_kwargs
from .templates import PAGEDRAG_QA_TEMPLATE, PAGEDRAG_REFINE_TEMPLATE

__all__ = [
           "PAGEDRAG_QA_TEMPLATE",
           "PAGEDRAG_REFINE_TEMPLATE",
           "CanonicalNodePostprocessor",
           "PagedRAG",
           "canonical_query_engine_kwargs",
]
