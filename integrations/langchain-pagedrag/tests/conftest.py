"""Fixtures of the LangChain integration tests: the embedded model on a small KV pool and a
faiss retriever with MiniLM embeddings (offline) over the RAG workload."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from langchain_core.embeddings import Embeddings
from langchain_pagedrag import ChatPagedRAG

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # integrations/: the shared test support
import testing_support


class MiniLMEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 through sentence-transformers, offline."""

    def __init__(self) -> None:
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(testing_support.embedding_model_path(), device="cpu")

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.model.encode(texts, normalize_embeddings=True).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


@pytest.fixture
def chat() -> ChatPagedRAG:
    return ChatPagedRAG(engine_kwargs=testing_support.ENGINE_KWARGS, max_tokens=testing_support.MAX_TOKENS)


@pytest.fixture(scope="session")
def retriever():
    """Top-k retrieval from a faiss store of the workload's documents."""
    from langchain_community.vectorstores import FAISS

    documents = testing_support.rag_documents()
    store = FAISS.from_texts([doc.text for doc in documents], MiniLMEmbeddings(),
                             metadatas=[{"source": doc.source_id} for doc in documents])
    return store.as_retriever(search_kwargs={"k": testing_support.TOP_K})


@pytest.fixture(scope="session")
def server() -> str:
    """The base URL of a real `pagedrag serve` on loopback."""
    return testing_support.shared_server()
