"""Paged KV kernels (imported as ``pagedrag.kernels``).

``ops_for(device)`` picks the implementation: Triton kernels on CUDA, the torch
references on CPU. Both expose, with one signature each, the paged KV ops
(store_kv, paged_decode_attention, prefix_prefill_attention, copy_blocks,
swap_blocks), the model's fused elementwise ops (rms_norm, rotary_embedding,
silu_and_mul) and its projections (linear).
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import reference


def ops_for(device: torch.device | str) -> ModuleType:
    """The kernel module to use for tensors on ``device``."""
    if torch.device(device).type == "cuda":
        from . import triton_ops  # imported lazily: triton is only needed on GPU
        return triton_ops
    return reference


__all__ = ["ops_for", "reference"]
