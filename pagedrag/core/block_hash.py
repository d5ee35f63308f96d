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


_CHUNK_DOMAIN = b"pagedrag/kv-chunk/v1"
_TAG_CHUNK_BLOCK = b"C"


def head_digest(head_token_ids: Sequence[int]) -> bytes:
    """The hash of a prompt's head (the tokens its chunks were computed after)."""
    return hashlib.sha256(array("q", head_token_ids).tobytes()).digest()


def chunk_key(model_id: str, cache_salt: str | None, head: bytes, chunk_token_ids: Sequence[int]) -> BlockHash:
    """What a reusable chunk's KV depends on, independent of where the chunk lands: the model,
    the tenant's salt, the head it was computed after (``head_digest``), and its own tokens."""
    digest = hashlib.sha256(_CHUNK_DOMAIN)
    salt = b"" if cache_salt is None else _TAG_CACHE_SALT + cache_salt.encode("utf-8")
    for part in (model_id.encode("utf-8"), salt, head, array("q", chunk_token_ids).tobytes()):
        digest.update(_length_prefixed(part))
    return digest.digest()


def chunk_block_hashes(key: BlockHash, chunk_token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hashes of a chunk's blocks (its KV laid out from position 0), the last one possibly
    partial, chained from ``key``; tagged so they never equal a prefix block's hash."""
    hashes: list[BlockHash] = []
    for start in range(0, len(chunk_token_ids), block_size):
        parent = hashes[-1] if hashes else key
        hashes.append(hash_block(parent, chunk_token_ids[start:start + block_size], _TAG_CHUNK_BLOCK))
    return hashes


_BLENDED_DOMAIN = b"pagedrag/kv-blended/v1"


def blended_block_key(block_hash: BlockHash, settings: bytes, whole: bool) -> BlockHash:
    """The key of a block whose KV chunk reuse made (core.prefix_keys): its exact chained hash
    (every token up to the block's end, the tenant's salt), the chunk-reuse ``settings`` that
    shaped the approximation, and whether the model computed all of the block (``whole``) or
    some of it was copied from an imported chunk. Never equal to an exact or a chunk block hash."""
    digest = hashlib.sha256(_BLENDED_DOMAIN)
    for part in (block_hash, settings, b"W" if whole else b"C"):
        digest.update(_length_prefixed(part))
    return digest.digest()
