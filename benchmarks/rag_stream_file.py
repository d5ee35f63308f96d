"""The RAG stream's requests and the embedded model's shape as small files, for a machine
without MiniLM, the embedded GGUF or a network (bench_router --save-stream / --stream,
--save-model-folder).

- The stream file (JSON): the chat messages of every question of benchmarks/rag_stream.py,
  after MiniLM retrieval and the canonicalizer, in stream order: what bench_router posts
  and simulates, so the other machine computes nothing of it.
- The model folder: the embedded SmolLM2-135M-Instruct's config.json, generation_config.json
  and tokenizer, no weights: `pagedrag serve FOLDER --load-format dummy` runs a model of the
  same shape on random weights, and tokenizes (so hashes and prefix-cache hits) as the
  embedded model does.
"""

from __future__ import annotations

import json
from pathlib import Path

from rag_stream import SYSTEM_PROMPT, rag_stream

FORMAT = 1


def stream_messages() -> list[list[dict]]:
    """Every question's chat messages (MiniLM's top chunks through the canonicalizer, with the
    embedded tokenizer), in stream order."""
    from pagedrag.models.loader import load_tokenizer
    from pagedrag.rag.canonical import PromptCanonicalizer

    canonicalizer = PromptCanonicalizer(SYSTEM_PROMPT, tokenizer=load_tokenizer(None))
    return [canonicalizer.build(question, [(c.source_id, c.text) for c in chunks]).messages
            for question, chunks in rag_stream()]


def save_stream(path: Path, messages: list[list[dict]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": FORMAT, "messages": messages}, ensure_ascii=False))


def load_stream(path: Path) -> list[list[dict]]:
    """The messages save_stream wrote (refusing another format: the requests would differ)."""
    saved = json.loads(path.read_text())
    if saved.get("format") != FORMAT:
        raise ValueError(f"{path} is not a stream file of format {FORMAT}")
    return saved["messages"]


def save_model_folder(path: Path) -> None:
    """The embedded model's config, generation config and tokenizer (no weights) into ``path``."""
    from transformers import AutoConfig, GenerationConfig

    from pagedrag.models.loader import embedded_checkpoint, load_tokenizer

    checkpoint = embedded_checkpoint()
    path.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(checkpoint).save_pretrained(path)
    GenerationConfig.from_pretrained(checkpoint).save_pretrained(path)
    load_tokenizer(None).save_pretrained(path)
