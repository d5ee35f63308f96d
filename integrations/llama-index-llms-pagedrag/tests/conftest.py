"""Fixtures of the LlamaIndex integration tests: the embedded model on a small KV pool,
MiniLM embeddings (offline) and a faiss-backed VectorStoreIndex over the RAG workload."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.llms.pagedrag import PagedRAG

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # integrations/: the shared test support
import testing_support


@pytest.fixture
def llm() -> PagedRAG:
    return PagedRAG(engine_kwargs=testing_support.ENGINE_KWARGS, max_tokens=testing_support.MAX_TOKENS)


@pytest.fixture(scope="session")
def embed_model():
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=testing_support.embedding_model_path(), device="cpu")


@pytest.fixture(scope="session")
def index(embed_model):
    """A VectorStoreIndex over the workload's documents, stored in faiss."""
    import faiss
    from llama_index.core import Document, StorageContext, VectorStoreIndex
    from llama_index.vector_stores.faiss import FaissVectorStore

    store = FaissVectorStore(faiss_index=faiss.IndexFlatL2(384))
    documents = [Document(text=doc.text, id_=doc.source_id) for doc in testing_support.rag_documents()]
    return VectorStoreIndex.from_documents(documents, embed_model=embed_model,
                                           storage_context=StorageContext.from_defaults(vector_store=store))


@pytest.fixture(scope="session")
def server() -> str:
    """The base URL of a real `pagedrag serve` on loopback."""
    return testing_support.shared_server()


class ChatRecorder(BaseEventHandler):
    """Records every chat an LLM answered: (messages, response)."""

    chats: list = Field(default_factory=list)

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent):
            self.chats.append((event.messages, event.response))


@pytest.fixture
def recorder():
    """Every chat LlamaIndex makes while the test runs."""
    dispatcher = get_dispatcher()
    handler = ChatRecorder()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)
