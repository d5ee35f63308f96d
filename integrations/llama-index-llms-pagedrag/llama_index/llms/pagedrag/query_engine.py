"""The keyword arguments that make ``index.as_query_engine`` cache-friendly:

    index.as_query_engine(llm=llm, **canonical_query_engine_kwargs())
    index.as_query_engine(llm=llm, **canonical_query_engine_kwargs(order="cache_aware", llm=llm))
    index.as_query_engine(llm=llm, **canonical_query_engine_kwargs(llm=llm))   # chunk reuse: exact cuts
"""

from __future__ import annotations

from typing import Any

from .base import PagedRAG
from .postprocessor import CanonicalNodePostprocessor
from .templates import PAGEDRAG_QA_TEMPLATE, PAGEDRAG_REFINE_TEMPLATE


def canonical_query_engine_kwargs(order: str = "stable", max_context_tokens: int | None = None,
                                  tokenizer: Any = None, llm: PagedRAG | None = None) -> dict[str, Any]:
    """The canonical node postprocessor (``order`` "stable", "cache_aware" with the query
    engine's ``llm``, or "relevance") and the QA / refine templates in the canonical layout.
    With chunk reuse, pass the query engine's ``llm`` in any order: the postprocessor tells
    it the retrieved nodes, so its calls cut the prompt exactly around them."""
    postprocessor = CanonicalNodePostprocessor(order=order, max_context_tokens=max_context_tokens,
                                               tokenizer=tokenizer, llm=llm, qa_template=PAGEDRAG_QA_TEMPLATE)
    return {"node_postprocessors": [postprocessor], "text_qa_template": PAGEDRAG_QA_TEMPLATE,
            "refine_template": PAGEDRAG_REFINE_TEMPLATE}
