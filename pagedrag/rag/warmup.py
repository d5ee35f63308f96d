"""Warming a corpus at ingestion, for the integrations' hooks (LlamaIndex's ``PagedRAGWarmup``
transform, LangChain's ``PagedRAGWarmup`` document transformer).

A hook renders one prompt per chunk, as its framework renders a query whose first retrieved
chunk is that one (the canonical layout: system prompt, then the chunk); here those prompts go to
the model's engine client (``EngineClient.awarm``) in batches, under the model's cache_salt, with
a progress bar. With chunk reuse possible (``ChunkReuseSettings.chunk_reuse_possible``) each
batch also passes its chunks' texts as ``chunks``, so the engine cuts each prompt around its chunk
exactly as it cuts a query's, and stores the chunk's KV for reuse at any position.
"""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedrag.client import Prompt, WarmSummary, run_sync
from pagedrag.rag.chunk_reuse_support import ChunkReuseSettings

DEFAULT_BATCH_SIZE = 64  # prompts per warm-up call: one engine batch, one progress step


def check_warm_options(batch_size: object, show_progress: object) -> None:
    """TypeError / ValueError naming a hook's ``batch_size`` (an int >= 1) or ``show_progress``
    (a bool) when it is anything else, before any chunk is warmed."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not isinstance(show_progress, bool):
        raise TypeError(f"show_progress must be True or False, got {show_progress!r}")


async def awarm_chunks(llm: ChunkReuseSettings, prompts: Sequence[Prompt], chunks: Sequence[str],
                       batch_size: int = DEFAULT_BATCH_SIZE, show_progress: bool = True) -> WarmSummary:
    """Warm ``prompts[i]``, the prompt of chunk text ``chunks[i]``, through ``llm``'s client.

    Invariant: every prompt is warmed once, in order, batch by batch; the figures are the sum of
    the batches'. A failing batch raises, naming its chunks (those before it stay warm)."""
    if len(prompts) != len(chunks):
        raise ValueError(f"got {len(prompts)} prompts for {len(chunks)} chunks")
    reuse = llm.chunk_reuse_possible
    total = WarmSummary()
    with tqdm(total=len(prompts), desc="Warming chunks", unit="chunk", disable=not show_progress) as bar:
        for start in range(0, len(prompts), batch_size):
            batch = slice(start, start + batch_size)
            try:
                total += await llm.client.awarm(prompts[batch], llm.cache_salt, chunks[batch] if reuse else None)
            except (ValueError, TypeError) as error:  # which chunks, out of how many
                end = min(start + batch_size, len(prompts))
                kind = TypeError if isinstance(error, TypeError) else ValueError
                raise kind(f"warming chunks {start}-{end - 1} of {len(prompts)} (0-based): {error}") from error
            bar.update(len(prompts[batch]))
    return total


def warm_chunks(llm: ChunkReuseSettings, prompts: Sequence[Prompt], chunks: Sequence[str],
                batch_size: int = DEFAULT_BATCH_SIZE, show_progress: bool = True) -> WarmSummary:
    """``awarm_chunks``, synchronously."""
    return run_sync(awarm_chunks(llm, prompts, chunks, batch_size, show_progress))
