"""What a stored KV block's values depend on, beyond its chained block hash.

A block hash (core.block_hash) names the tokens (and the tenant's salt) a block holds. The
values in it also depend on the weights, the dtype, the block size, the KV layout, the
device's kernels and the tensor-parallel size (the order of its all-reduces' sums). A stored
block holds every rank's KV heads (under tensor parallelism rank 0 gathers them), so no rank
holds a part of a block another rank lacks. ``KeySpace`` digests all of them into one
fingerprint; a stored block's key is ``block_key(keyspace, block_hash)``.

Invariant: two engines give a block the same key only when every input its values depend
on is the same, so a changed checkpoint under the same model name misses (SGLang issue 24758)
and tenants stay apart (the salt is inside the block hash).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

FORMAT_VERSION = 1
_CHECKSUM_CHUNK = 1 << 24  # elements a checksum step reads at once (bounded extra memory)


@dataclass(frozen=True)
class KeySpace:
    """Everything a block's KV values depend on except its tokens."""

    weights: str  # weights_fingerprint of the loaded model (every rank's shard)
    dtype: str
    device_type: str  # cpu or cuda: kernels differ, and so do the last bits of the values
    block_size: int
    num_layers: int
    num_kv_heads: int  # every rank's: a stored block is whole
    head_dim: int
    tp_size: int = 1
    format_version: int = FORMAT_VERSION

    @property
    def fingerprint(self) -> str:
        """A hex digest of every field (stable across processes and runs)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def block_key(keyspace_fingerprint: str, block_hash: bytes) -> bytes:
    """The key of one stored block: its chained hash within the keyspace."""
    return hashlib.sha256(b"pagedrag/kv-tier/v1" + bytes.fromhex(keyspace_fingerprint) + block_hash).digest()


def weights_fingerprint(module: torch.nn.Module) -> str:
    """A digest of every parameter and buffer: names, dtypes, shapes and values.

    The values enter as a position-weighted integer checksum of their bits, computed on the
    weights' own device (no copy of the weights to the host). Integer sums wrap modulo 2^64
    whatever the order of the additions, so the result is the same for every thread count
    and run; one changed element changes it."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(_bits_checksum(tensor).to_bytes(16, "little", signed=False))
    return digest.hexdigest()


def _bits_checksum(tensor: torch.Tensor) -> int:
    """(sum of the element bits, sum of bits * (index + 1)) mod 2^64, as one 128-bit integer."""
    bits = _as_integers(tensor.detach().contiguous().view(-1))
    plain = weighted = 0
    for start in range(0, bits.numel(), _CHECKSUM_CHUNK):
        part = bits[start:start + _CHECKSUM_CHUNK].to(torch.int64)
        index = torch.arange(start + 1, start + 1 + part.numel(), dtype=torch.int64, device=part.device)
        plain = (plain + int(part.sum())) % (1 << 64)
        weighted = (weighted + int((part * index).sum())) % (1 << 64)
    return plain | (weighted << 64)


def _as_integers(flat: torch.Tensor) -> torch.Tensor:
    """The same bytes viewed as integers of the element's width (bytes for odd widths)."""
    width = flat.element_size()
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(width)
    if flat.dtype == torch.bool or integer is None:
        return flat.view(torch.uint8)
    return flat.view(integer)
