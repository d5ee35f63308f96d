"""pagedrag for LlamaIndex: the PagedRAG LLM (function calling and structured outputs
included), canonical node order, cache-friendly templates, a structured sub-question
generator and an ingestion step that warms the engine (PagedRAGWarmup)."""

from .base import PagedRAG
from .postprocessor import CanonicalNodePostprocessor
from .query_engine import canonical_query_engine_kwargs
from .question_gen import StructuredQuestionGenerator
from .templates import PAGEDRAG_QA_TEMPLATE, PAGEDRAG_REFINE_TEMPLATE
from .warmup import PagedRAGWarmup

__all__ = [
           "PAGEDRAG_QA_TEMPLATE",
           "PAGEDRAG_REFINE_TEMPLATE",
           "CanonicalNodePostprocessor",
           "PagedRAG",
           "PagedRAGWarmup",
           "StructuredQuestionGenerator",
           "canonical_query_engine_kwargs",
]
