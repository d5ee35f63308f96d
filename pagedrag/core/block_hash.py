"""Chained, cryptographic hashes of full KV blocks.

hash(block i) = sha256(tag || hash(block i-1) || token ids of block i || extra keys)

The byte encoding is fixed and length-prefixed (never Python ``hash()`` or
pickle), so a hash means the same thing in every process and run. Extra keys
are domain-separated by a one-byte tag; the first block carries the request's
cache_salt (tenants with different salts never share blocks).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

BlockHash = bytes

_DOMAIN = b"pagedrag/kv-block/v1"
_TAG_CACHE_SALT = b"S"


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _extra_keys(cache_salt: str | None) -> bytes:
    if cache_salt is None:
        return b""
    return _TAG_CACHE_SALT + _length_prefixed(cache_salt.encode("utf-8"))


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """The hash of one full block, chained to its parent's hash (None for the first block)."""
    tokens = array("q", token_ids).tobytes()
    digest = hashlib.sha256(_DOMAIN)
    digest.update(_length_prefixed(parent or b""))
    digest.update(_length_prefixed(tokens))
    digest.update(_length_prefixed(extra))
    return digest.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None) -> None:
    """Append to ``hashes`` the hashes of every full block of token_ids not hashed yet."""
    num_full = len(token_ids) // block_size
    for index in range(len(hashes), num_full):
        parent = hashes[index - 1] if index else None
        extra = _extra_keys(cache_salt) if index == 0 else b""
        block_tokens = token_ids[index * block_size:(index + 1) * block_size]
        hashes.append(hash_block(parent, block_tokens, extra))
