"""What a stored KV block's values depend on, beyond its chained block hash.

A block hash (core.block_hash) names the tokens (and the tenant's salt) a block holds. The
values in it also depend on the weights and the model's configuration, the dtype, the block
size, the KV layout, the device's kernels and the tensor-parallel size (the order of its
all-reduces' sums). A stored
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
    config: str  # config_fingerprint of its configuration
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


def config_fingerprint(config) -> str:
    """A digest of the model's configuration (a transformers PretrainedConfig or a dict), less
    where it was loaded from and which transformers wrote it. Values that shape the KV but live
    in no weight (rope scaling and theta, the norm's epsilon, ...) are only here."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    kept = {key: value for key, value in values.items()
            if not key.startswith("_") and key not in ("transformers_version", "name_or_path")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=repr).encode()).hexdigest()


def weights_fingerprint(module: torch.nn.Module) -> str:
    """A digest of every parameter and buffer (those left out of the state dict too, such as
    rotary tables): names, dtypes, shapes and values.

    Values on the CPU enter as their bytes (sha256). Values on an accelerator enter as a
    checksum computed where they lie (no copy of the weights to the host): the sum, modulo
    2^64, of a bijective mix of each element's bits with its index. Sums wrap whatever the
    order of the additions, so the result is the same for every thread count and run; one
    changed element always changes it, and a changed checkpoint collides only by chance
    (about 2^-64), not by any regular pattern of changes."""
    digest = hashlib.sha256()
    tensors = {**dict(module.named_buffers()), **module.state_dict()}
    for name, tensor in sorted(tensors.items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        bits = _as_integers(tensor.detach().contiguous().view(-1))
        if bits.device.type == "cpu":
            digest.update(bits.view(torch.uint8).numpy())
        else:
            digest.update(mixed_checksum(bits).to_bytes(8, "little", signed=False))
    return digest.hexdigest()


# splitmix64's constants as signed 64-bit integers (torch has no unsigned 64-bit arithmetic)
_GOLDEN, _MUL1, _MUL2 = -7046029254386353131, -4658895280553007687, -7723592293110705685


def mixed_checksum(bits: torch.Tensor) -> int:
    """sum(mix(bits[i] ^ mix(i * golden))) mod 2^64 over a 1-D integer tensor, on its device,
    in steps of bounded extra memory. ``mix`` is splitmix64's finalizer: a bijection, so a
    change to one element changes its term."""
    total = 0
    for start in range(0, bits.numel(), _CHECKSUM_CHUNK):
        part = bits[start:start + _CHECKSUM_CHUNK].to(torch.int64)
        index = torch.arange(start, start + part.numel(), dtype=torch.int64, device=part.device)
        total = (total + int(_mix(part ^ _mix(index * _GOLDEN)).sum())) % (1 << 64)
    return total


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shift_right(x, 30)
    x = x * _MUL1
    x = x ^ _shift_right(x, 27)
    x = x * _MUL2
    return x ^ _shift_right(x, 31)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical (unsigned) right shift of int64 values: torch's >> copies the sign bit."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _as_integers(flat: torch.Tensor) -> torch.Tensor:
    """The same bytes viewed as integers of the element's width (bytes for odd widths)."""
    width = flat.element_size()
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(width)
    if flat.dtype == torch.bool or integer is None:
        return flat.view(torch.uint8)
    return flat.view(integer)
