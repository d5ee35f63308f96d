"""The byte layout of one stored block on disk.

    magic (8 bytes) | header length (u32, little-endian) | header (UTF-8 JSON, space-padded)
    | payload | sha256 (32 bytes)

The header names the key (hex), the keyspace fingerprint, the block's token ids, the key of
the segment a chunk's first block was computed after (hex, empty for other blocks), and the
payload's dtype and shape; its padding puts the payload at an offset that is a multiple of
ALIGNMENT, so that a payload read into an aligned buffer (``aligned_buffer``) is viewed as
bf16/fp32 in place at an aligned address. The trailing sha256 covers everything before it.
The magic names the layout's version. ``decode`` returns None for anything that is not
exactly such a file for the key asked for (wrong magic, such as a file of an older layout,
truncated, checksum mismatch, another key or keyspace, unknown dtype, a shape or dtype other
than the engine's, unaligned payload): a bad file is a miss, never an error or a wrong token.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from pagedrag.kv_tiers.store import StoredBlock

MAGIC = b"PDRAGKV2"  # 2: the payload aligned (files of layout 1 are misses, dropped as foreign)
ALIGNMENT = 64  # bytes: the payload's offset in a file, and the address of decode's tensors
_FIXED = len(MAGIC) + 4  # magic and header length
_DIGEST_BYTES = 32
_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16)}


def encode(key: bytes, keyspace: str, block: StoredBlock) -> bytes:
    kv = block.kv.detach().contiguous().cpu()
    header = json.dumps({"key": key.hex(), "keyspace": keyspace, "token_ids": list(block.token_ids),
                         "computed_after": block.computed_after.hex(), "dtype": str(kv.dtype), "shape": list(kv.shape)}).encode()
    header += b" " * (-(_FIXED + len(header)) % ALIGNMENT)
    body = MAGIC + struct.pack("<I", len(header)) + header + _tensor_bytes(kv)
    return body + hashlib.sha256(body).digest()


def max_file_bytes(shape: tuple[int, ...], dtype: torch.dtype, num_tokens: int) -> int:
    """The most bytes a file of a block of ``shape`` and ``dtype`` holding ``num_tokens`` takes
    (header at its longest: every token id of ten digits)."""
    header = json.dumps({"key": "0" * 64, "keyspace": "0" * 64, "token_ids": [10**10 - 1] * num_tokens,
                         "computed_after": "0" * 64, "dtype": str(dtype), "shape": list(shape)}).encode()
    return _FIXED + len(header) + ALIGNMENT + _num_bytes(shape, dtype) + _DIGEST_BYTES


def decode(data, key: bytes, keyspace: str, shape: tuple[int, ...] | None = None,
           dtype: torch.dtype | None = None) -> StoredBlock | None:
    """The block in ``data`` (any bytes-like object) if it is a whole, intact file of ``key`` in
    ``keyspace`` (and of ``shape`` and ``dtype`` where given); else None. The block's tensor
    starts at an ALIGNMENT-aligned address: it shares ``data``'s memory where ``data`` is
    writable and aligned (an ``aligned_buffer``: no copy), else it is a copy."""
    view = memoryview(data)
    if len(view) < _FIXED + _DIGEST_BYTES or bytes(view[:len(MAGIC)]) != MAGIC:
        return None
    body, digest = view[:-_DIGEST_BYTES], view[-_DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        return None
    (header_len,) = struct.unpack_from("<I", body, len(MAGIC))
    try:
        header = json.loads(bytes(body[_FIXED:_FIXED + header_len]))
        stored_dtype, stored_shape = _DTYPES[header["dtype"]], tuple(header["shape"])
        matches = (header["key"] == key.hex() and header["keyspace"] == keyspace
                   and all(type(size) is int and size >= 0 for size in stored_shape)
                   and shape in (None, stored_shape) and dtype in (None, stored_dtype))
        token_ids = tuple(int(t) for t in header["token_ids"])
        computed_after = bytes.fromhex(header["computed_after"])
    except (ValueError, KeyError, TypeError):
        return None
    payload = body[_FIXED + header_len:]
    if not matches or (_FIXED + header_len) % ALIGNMENT or len(payload) != _num_bytes(stored_shape, stored_dtype):
        return None
    return StoredBlock(token_ids, _aligned_bytes(payload).view(stored_dtype).reshape(stored_shape), computed_after)


def aligned_buffer(num_bytes: int) -> memoryview:
    """A writable buffer of ``num_bytes`` at an ALIGNMENT-aligned address (torch's CPU allocator
    aligns every allocation to 64 bytes), to read a file into for ``decode``."""
    return memoryview(torch.empty(num_bytes, dtype=torch.uint8).numpy())


def _aligned_bytes(payload: memoryview) -> torch.Tensor:
    """``payload`` as a uint8 tensor at an aligned address: itself, or a copy where it is
    read-only or unaligned."""
    if not payload.readonly:
        raw = torch.frombuffer(payload, dtype=torch.uint8)
        if raw.data_ptr() % ALIGNMENT == 0:
            return raw
    copy = aligned_buffer(len(payload))
    copy[:] = payload
    return torch.frombuffer(copy, dtype=torch.uint8)


def _tensor_bytes(kv: torch.Tensor) -> bytes:
    return kv.view(torch.uint8).numpy().tobytes()


def _num_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.tensor([], dtype=dtype).element_size()
