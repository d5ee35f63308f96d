"""CanonicalNodePostprocessor: retrieved nodes in canonical order, so prompts share prefixes."""

from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import Field, model_validator
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle

from pagedrag.rag.canonical import Chunk
from pagedrag.rag.ordering import ChunkOrder, canonical_items, check_cache_aware

from .base import PagedRAG
from .templates import PAGEDRAG_QA_TEMPLATE


class CanonicalNodePostprocessor(BaseNodePostprocessor):
    """Puts retrieved nodes into an order that does not depend on the retriever's ranking.

    Two queries that retrieve the same nodes (or sets that start with the same nodes)
    then build prompts with the same leading tokens, which the prefix cache serves.
    Orders (see ``pagedrag.rag.canonical.canonical_order``): "stable" sorts by source document
    id, then start position, then a hash of the text; "cache_aware" starts from that and
    greedily puts first the nodes that extend the prefix ``llm``'s engine holds for its
    ``cache_salt``, probing the prompt as the query engine renders it with ``qa_template``;
    "relevance" keeps the retriever's order. Nodes with empty or repeated text are removed.

    With ``max_context_tokens``, the nodes' texts are also fitted into that many tokens of
    ``tokenizer`` (default: the embedded model's) by the canonicalizer's rule: nodes are
    kept while they fit, the first that does not is cut at a token boundary, the rest are
    dropped. (Without it, LlamaIndex's response synthesizer splits what does not fit the
    LLM's context window across refine calls.)

    With ``llm`` (a PagedRAG), the nodes' texts, as LlamaIndex's response synthesizer packs
    them into context_str (``packed_text``), are told to it as retrieved chunks
    (``PagedRAG.expect_chunks``; a no-op unless chunk reuse may be on), so its calls pass
    them as ``chunks=`` and the engine cuts the prompt exactly around each node, wherever it
    lands. LlamaIndex joins the nodes without numbering them, so a node renders the same
    at any position.
    """

    order: ChunkOrder = Field(default="stable")
    max_context_tokens: int | None = Field(default=None, gt=0)
    tokenizer: Any = Field(default=None, exclude=True, description="A Hugging Face tokenizer.")
    llm: PagedRAG | None = Field(default=None, exclude=True,
                                 description="The LLM whose cache 'cache_aware' asks, and which is told of the "
                                             "nodes as retrieved chunks (chunk reuse).")
    qa_template: BasePromptTemplate = Field(default=PAGEDRAG_QA_TEMPLATE, exclude=True,
                                            description="The query engine's text_qa_template.")

    @model_validator(mode="after")
    def _needs_llm_for_cache_aware(self) -> CanonicalNodePostprocessor:
        check_cache_aware(self.order, self.llm)
        return self

    @classmethod
    def class_name(cls) -> str:
        return "CanonicalNodePostprocessor"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        ordered = canonical_items(nodes, _chunk, _with_text, self.order, max_tokens=self.max_context_tokens,
                                  tokenizer=self.tokenizer, cached_len=self._cached_len, identity=_shown)
        if self.llm is not None:
            self.llm.expect_chunks(packed_text(scored.node) for scored in ordered)
        return ordered

    def _cached_len(self, leading: list[NodeWithScore]) -> int:
        """Cached tokens of the QA prompt whose context starts with these nodes."""
        return self.llm.cached_prefix_len(self.llm.template_prompt(self.qa_template, context_str=_context(leading)))


def _context(nodes: list[NodeWithScore]) -> str:
    """The nodes' texts as LlamaIndex's response synthesizer packs them into context_str."""
    return "\n\n".join(text for text in (packed_text(scored.node) for scored in nodes) if text)


def packed_text(node: BaseNode) -> str:
    """A node's text as LlamaIndex's response synthesizer packs it: its content with its
    LLM metadata, stripped."""
    return node.get_content(metadata_mode=MetadataMode.LLM).strip()


def _chunk(scored: NodeWithScore) -> Chunk:
    """The node as the canonicalizer sees it: its text, source document and start offset, and
    (in its metadata) what the packed context shows of it."""
    node = scored.node
    return Chunk(node.get_content(), node.ref_doc_id or node.node_id, node.start_char_idx, scored.score,
                 metadata={"shown": packed_text(node)})


def _shown(chunk: Chunk) -> str:
    """A node's identity for ordering and dedupe: its text with its LLM metadata, as packed
    (two nodes of one text and other metadata show, and so order, apart)."""
    return chunk.metadata["shown"]


def _with_text(scored: NodeWithScore, text: str) -> NodeWithScore:
    return NodeWithScore(node=scored.node.model_copy(update={"text": text}), score=scored.score)
