"""Chunk reuse on the device: copy a chunk's K/V between its own blocks and a request's,
rotating the keys to their new positions (core.chunk_cache plans the moves).

RoPE turns a key at position p into R(p) k, with R a rotation per pair of dimensions (the
neox halves: dimension i with i + head_dim / 2, angle p * inv_freq[i]), so a key moved by
d positions is R(d) applied to the stored key; any attention scaling already in the stored
key is kept. The rotation runs in float32 and rounds once into the cache's dtype. The
same torch ops run on CPU and CUDA: a move is a gather, a rotation and a scatter per layer.
"""

from __future__ import annotations

import torch

from pagedrag.core.chunk_cache import KVMove
from pagedrag.worker.transfer import host_to_device


def rotation(deltas: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, 1, head_dim / 2] of moving N keys by ``deltas`` positions."""
    angles = deltas.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """keys [N, heads, head_dim] (any float dtype) -> float32 keys rotated by (cos, sin)."""
    half = keys.shape[-1] // 2
    first, second = keys[..., :half].float(), keys[..., half:].float()
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def rotate_keys(keys: torch.Tensor, deltas: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """keys [N, heads, head_dim], deltas [N] -> float32 keys moved by deltas."""
    return rotate(keys, *rotation(deltas, inv_freq))


@torch.inference_mode()
def apply_kv_moves(layers: list[tuple[torch.Tensor, torch.Tensor]], inv_freq: torch.Tensor,
                   moves: list[KVMove]) -> None:
    """Run ``moves`` on every layer's (k_cache, v_cache) [blocks, block_size, heads, dim]."""
    if not moves:
        return
    device = layers[0][0].device
    src = host_to_device([slot for move in moves for slot in move.src_slots], torch.int64, device)
    dst = host_to_device([slot for move in moves for slot in move.dst_slots], torch.int64, device)
    deltas = host_to_device([move.delta for move in moves for _ in move.src_slots], torch.int64, device)
    cos, sin = rotation(deltas, inv_freq)
    for k_cache, v_cache in layers:
        keys = k_cache.view(-1, *k_cache.shape[2:])
        values = v_cache.view(-1, *v_cache.shape[2:])
        keys.index_copy_(0, dst, rotate(keys.index_select(0, src), cos, sin).to(keys.dtype))
        values.index_copy_(0, dst, values.index_select(0, src))
