"""Which tokens of reused chunks the model computes again (chunk reuse: core.chunk_cache).

Each imported chunk (``Recompute``) gets ``count`` tokens recomputed with the full context,
picked among all but its last ``tail`` tokens, and those ``tail`` tokens (the ones nearest the
question; EngineArgs.chunk_recompute_window):

- "deviation" (as CacheBlend does): the model first runs its first PROBE_LAYERS layers over
  the request's whole uncomputed span, imported tokens included. The imported tokens whose
  K/V at the last probe layer moved most from the cached copy are those whose attention to
  the new context matters most: the ``count`` largest of each chunk are recomputed. The
  probe costs PROBE_LAYERS / num_layers of a prefill of the span, and it leaves exact K/V in
  those layers for every token of the span (they depend on exact lower layers only).
- "first" (as EPIC does): each chunk's first ``count`` tokens.
"""

from __future__ import annotations

import torch

from pagedrag.core.chunk_cache import Recompute

PROBE_LAYERS = 2


def first_tokens(recompute: list[Recompute]) -> list[int]:
    return [p for item in recompute for p in (*range(item.start, item.start + item.count),
                                              *range(item.end - item.tail, item.end))]


def candidate_positions(recompute: list[Recompute]) -> list[int]:
    return [p for item in recompute for p in range(item.start, item.end)]


def most_deviating(deviation: list[float], recompute: list[Recompute]) -> list[int]:
    """The ``count`` positions of each chunk with the largest deviation, outside its ``tail``,
    and its tail; ``deviation`` lists every candidate position (candidate_positions order)."""
    picked, offset = [], 0
    for item in recompute:
        length = item.end - item.start
        scores = deviation[offset:offset + length]
        ranked = sorted(range(length - item.tail), key=scores.__getitem__, reverse=True)
        picked.extend(item.start + i for i in ranked[:item.count])
        picked.extend(range(item.end - item.tail, item.end))
        offset += length
    return picked


@torch.inference_mode()
def probe_deviation(model: torch.nn.Module, layers: list[tuple[torch.Tensor, torch.Tensor]],
                    input_ids: torch.Tensor, positions: torch.Tensor, meta, slots: torch.Tensor) -> list[float]:
    """Run the probe layers over the packed span; the squared change of the K/V at ``slots``
    in the last probe layer, one value per slot (a host list: the step waits for it)."""
    last = min(PROBE_LAYERS, len(layers)) - 1
    flat = [cache.view(-1, *cache.shape[2:]) for cache in layers[last]]
    # gathered by indexing: index_select on the pool's layer-strided views is ~70x slower on CPU
    before = [cache[slots].float() for cache in flat]
    model.forward_layers(input_ids, positions, layers, meta, last + 1)
    change = sum((cache[slots].float() - old).square().sum(dim=(1, 2)) for cache, old in zip(flat, before))
    return change.tolist()
