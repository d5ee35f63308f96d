"""PagedRAGWarmup: an ingestion step that computes each node's KV before the first query."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.schema import BaseNode, TransformComponent

from pagedrag.client import Prompt
from pagedrag.rag.warmup import DEFAULT_BATCH_SIZE, awarm_chunks, warm_chunks

from .base import PagedRAG
from .postprocessor import packed_text
from .templates import PAGEDRAG_QA_TEMPLATE


class PagedRAGWarmup(TransformComponent):
    """Warms ``llm``'s engine with every node that goes through an ingestion pipeline, and
    returns the nodes unchanged::

        pipeline = IngestionPipeline(transformations=[SentenceSplitter(), embed_model, PagedRAGWarmup(llm=llm)])
        index = VectorStoreIndex(pipeline.run(documents=documents), embed_model=embed_model)
        index.as_query_engine(llm=llm, **canonical_query_engine_kwargs(llm=llm))

    Each node is warmed under the canonical layout, as the query engine's ``qa_template`` (the
    integration's PAGEDRAG_QA_TEMPLATE unless told otherwise) renders a prompt whose first node
    it is, through ``PagedRAG.template_prompt``: with prefix caching, the system prompt and the
    node are then cached for every query that retrieves it first (canonical order); with chunk
    reuse (``chunk_reuse_possible``) the node also goes as a retrieved chunk, so its own KV is
    stored for reuse wherever it lands. With KV tiers (``kv_disk_path``) the warm-up outlives
    the process. ``batch_size`` nodes go to the engine at a time; a progress bar counts them
    unless ``show_progress`` is False. Blank nodes are skipped.

    IngestionPipeline caches each step's output by its input nodes: a pipeline run again on
    the same nodes skips this step (pass ``disable_cache=True`` to the pipeline to warm again).

    An in-process ``llm``'s engine lives in the process that made this component: run on a
    copy in another process (``pipeline.run(num_workers=N)`` pickles it into workers) it
    raises rather than load a second engine there and warm that one, which the worker drops.
    With ``base_url`` (a ``pagedrag serve``) workers warm the server.
    """

    llm: PagedRAG = Field(exclude=True, description="The LLM whose engine is warmed.")
    qa_template: BasePromptTemplate = Field(default=PAGEDRAG_QA_TEMPLATE, exclude=True,
                                            description="The query engine's text_qa_template.")
    batch_size: int = Field(default=DEFAULT_BATCH_SIZE, gt=0, description="Nodes warmed per engine call.")
    show_progress: bool = Field(default=True, description="A progress bar over the nodes.")

    # A field, not a private attribute: LlamaIndex unpickles components through __init__,
    # which would make a private one anew in the worker.
    engine_process: int = Field(default_factory=os.getpid, exclude=True,
                                description="The process whose in-process engine is warmed (where this was made).")

    @classmethod
    def class_name(cls) -> str:
        return "PagedRAGWarmup"

    def _check_engine_process(self) -> None:
        if self.llm.base_url is None and os.getpid() != self.engine_process:
            raise RuntimeError("PagedRAGWarmup runs in another process than its in-process engine "
                               "(IngestionPipeline.run(num_workers=...) copies it into workers): that "
                               "process would load an engine of its own and drop what it warmed. Run "
                               "the pipeline without num_workers, or give the LLM base_url= of a "
                               "pagedrag serve")

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        warm_chunks(self.llm, *self._prompts(nodes), self.batch_size, self.show_progress)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        await awarm_chunks(self.llm, *self._prompts(nodes), self.batch_size, self.show_progress)
        return nodes

    def _prompts(self, nodes: Sequence[BaseNode]) -> tuple[list[Prompt], list[str]]:
        """(prompt, text) of each node that has text: the QA prompt with it as the context."""
        self._check_engine_process()
        texts = [text for text in map(packed_text, nodes) if text]
        return [self.llm.template_prompt(self.qa_template, context_str=text) for text in texts], texts
