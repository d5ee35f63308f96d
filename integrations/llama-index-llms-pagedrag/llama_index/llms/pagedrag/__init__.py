"""pagedrag for LlamaIndex: the PagedRAG LLM (function calling and structured outputs
included), canonical node order, cache-friendly templates and a structured sub-question
generator."""

from .base import PagedRAG
from .postprocessor import CanonicalNodePostprocessor
from .query_engine import canonical_query_engine_kwargs
from .question_gen import StructuredQuestionGenerator
from .templates import PAGEDRAG_QA_TEMPLATE, PAGEDRAG_REFINE_TEMPLATE

__all__ = [
           "PAGEDRAG_QA_TEMPLATE",
           "PAGEDRAG_REFINE_TEMPLATE",
           "CanonicalNodePostprocessor",
           "PagedRAG",
           "StructuredQuestionGenerator",
           "canonical_query_engine_kwargs",
]
