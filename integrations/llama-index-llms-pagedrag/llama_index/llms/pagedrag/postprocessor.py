"""CanonicalNodePostprocessor: retrieved nodes in canonical order, so prompts share prefixes."""

from __future__ import annotations

from typing import Any, Literal

from llama_index.core.bridge.pydantic import Field
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle

from pagedrag.canonical import Chunk
from pagedrag.client import canonical_items


class CanonicalNodePostprocessor(BaseNodePostprocessor):
    """Puts retrieved nodes into an order that does not depend on the retriever's ranking.

    Two queries that retrieve the same nodes (or sets that start with the same nodes)
    then build prompts with the same leading tokens, which the prefix cache serves.
    Orders (see ``pagedrag.canonical.canonical_order``): "stable" sorts by source document
    id, then start position, then a hash of the text; "relevance" keeps the retriever's
    order. Either way nodes with empty or repeated text are removed.

    With ``max_context_tokens``, the nodes' texts are also fitted into that many tokens of
    ``tokenizer`` (default: the embedded model's) by the canonicalizer's rule: nodes are
    kept while they fit, the first that does not is cut at a token boundary, the rest are
    dropped. (Without it, LlamaIndex's response synthesizer splits what does not fit the
    LLM's context window across refine calls.)
    """

    order: Literal["stable", "relevance"] = Field(default="stable")
    max_context_tokens: int | None = Field(default=None, gt=0)
    tokenizer: Any = Field(default=None, exclude=True, description="A Hugging Face tokenizer.")

    @classmethod
    def class_name(cls) -> str:
        return "CanonicalNodePostprocessor"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        return canonical_items(nodes, _chunk, _with_text, self.order, self.max_context_tokens, self.tokenizer)


def _chunk(scored: NodeWithScore) -> Chunk:
    """The node as the canonicalizer sees it: its text, source document and start offset."""
    node = scored.node
    return Chunk(node.get_content(), node.ref_doc_id or node.node_id, node.start_char_idx, scored.score)


def _with_text(scored: NodeWithScore, text: str) -> NodeWithScore:
    return NodeWithScore(node=scored.node.model_copy(update={"text": text}), score=scored.score)
