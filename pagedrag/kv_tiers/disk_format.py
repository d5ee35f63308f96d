"""The byte layout of one stored block on disk.

    magic (8 bytes) | header length (u32, little-endian) | header (UTF-8 JSON) | payload | sha256 (32 bytes)

The header names the key (hex), the keyspace fingerprint, the block's token ids, and the
payload's dtype and shape; the trailing sha256 covers everything before it. ``decode``
returns None for anything that is not exactly such a file for the key asked for (wrong
magic, truncated, checksum mismatch, another key or keyspace, unknown dtype): a bad file is a
miss, never an error or a wrong token.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from pagedrag.kv_tiers.store import StoredBlock

MAGIC = b"PDRAGKV1"
_DIGEST_BYTES = 32
_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16)}


def encode(key: bytes, keyspace: str, block: StoredBlock) -> bytes:
    kv = block.kv.detach().contiguous().cpu()
    header = json.dumps({"key": key.hex(), "keyspace": keyspace, "token_ids": list(block.token_ids),
                         "dtype": str(kv.dtype), "shape": list(kv.shape)}).encode()
    body = MAGIC + struct.pack("<I", len(header)) + header + _tensor_bytes(kv)
    return body + hashlib.sha256(body).digest()


def decode(data: bytes | bytearray, key: bytes, keyspace: str) -> StoredBlock | None:
    """The block in ``data`` if it is a whole, intact file of ``key`` in ``keyspace``; else None.
    The block's tensor shares a writable ``data``'s memory (a bytearray: no copy)."""
    fixed = len(MAGIC) + 4
    if len(data) < fixed + _DIGEST_BYTES or not data.startswith(MAGIC):
        return None
    view = memoryview(data)
    body, digest = view[:-_DIGEST_BYTES], view[-_DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        return None
    (header_len,) = struct.unpack_from("<I", body, len(MAGIC))
    try:
        header = json.loads(bytes(body[fixed:fixed + header_len]))
        dtype, shape = _DTYPES[header["dtype"]], tuple(header["shape"])
        matches = header["key"] == key.hex() and header["keyspace"] == keyspace
        token_ids = tuple(int(t) for t in header["token_ids"])
    except (ValueError, KeyError, TypeError):
        return None
    payload = body[fixed + header_len:]
    if not matches or len(payload) != _num_bytes(shape, dtype):
        return None
    buffer = bytearray(payload) if payload.readonly else payload
    kv = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)
    return StoredBlock(token_ids, kv)


def _tensor_bytes(kv: torch.Tensor) -> bytes:
    return kv.view(torch.uint8).numpy().tobytes()


def _num_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.tensor([], dtype=dtype).element_size()
