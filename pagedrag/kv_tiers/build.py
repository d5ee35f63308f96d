"""The engine's KV tiers from its arguments: a host tier (kv_offloading_size), a disk tier
(kv_disk_path, kv_disk_size), both keyed within the keyspace of the loaded model. Under tensor
parallelism the tiers are rank 0's and hold whole blocks (every rank's KV heads)."""

from __future__ import annotations

import hashlib
import logging

import torch

from pagedrag.config import GIB_BYTES, EngineArgs
from pagedrag.distributed.group import TensorParallelGroup
from pagedrag.kv_tiers import disk_format
from pagedrag.kv_tiers.cost_model import TierCostModel
from pagedrag.kv_tiers.disk_store import DiskStore
from pagedrag.kv_tiers.host_store import HostStore
from pagedrag.kv_tiers.keyspace import KeySpace, config_fingerprint, weights_fingerprint
from pagedrag.kv_tiers.tiers import KVTiers
from pagedrag.worker.kv_cache import available_cpu_memory

logger = logging.getLogger("pagedrag")


def build_tiers(args: EngineArgs, weights: str, config, shape, device: torch.device) -> KVTiers | None:
    """None when no tier is asked for. ``weights``: the fingerprint of every rank's weights
    (``model_fingerprint``); ``config``: the model's transformers config; ``shape``: this
    rank's worker.kv_cache.CacheShape."""
    if not args.uses_kv_tiers:
        return None
    tp_size = args.tensor_parallel_size
    keyspace = KeySpace(weights, config_fingerprint(config), str(shape.dtype), device.type, shape.block_size,
                        shape.num_layers, shape.num_kv_heads * tp_size, shape.head_dim, tp_size).fingerprint
    block = (shape.num_layers, 2, shape.block_size, shape.num_kv_heads * tp_size, shape.head_dim)
    block_bytes = shape.bytes_per_block * tp_size  # a stored block holds every rank's heads
    stores = []
    if args.kv_offloading_size:
        _check_holds_a_block("kv_offloading_size", args.kv_offloading_size, block_bytes)
        _check_fits_in_memory(args.kv_offloading_size)
        stores.append(HostStore(args.kv_offloading_size * GIB_BYTES, block, shape.dtype, pin_memory=device.type == "cuda"))
    if args.kv_disk_path is not None:
        _check_holds_a_block("kv_disk_size", args.resolved_kv_disk_size,
                             disk_format.max_file_bytes(block, shape.dtype, shape.block_size))
        stores.append(DiskStore(args.kv_disk_path, args.resolved_kv_disk_size * GIB_BYTES, keyspace, block, shape.dtype))
    for store in stores:
        logger.info("kv %s tier: %.2f GiB%s (keyspace %s)", store.name, store.capacity_bytes / GIB_BYTES,
                    f" at {args.kv_disk_path}" if isinstance(store, DiskStore) else "", keyspace[:16])
    return KVTiers(stores, keyspace, TierCostModel(shape.block_size))


def _check_holds_a_block(name: str, gib: float, block_bytes: int) -> None:
    if gib * GIB_BYTES < block_bytes:
        raise ValueError(f"{name}={gib!r} GiB holds no KV block: one block of this model takes {block_bytes} bytes "
                         f"({block_bytes / GIB_BYTES:.3g} GiB)")


def _check_fits_in_memory(gib: float) -> None:
    """The host tier is allocated up front (pinned on CUDA): more than the memory available
    now would be paged out, or end the process when it fills."""
    available = available_cpu_memory()
    if gib * GIB_BYTES > available:
        raise ValueError(f"kv_offloading_size={gib!r} GiB is more than the {available / GIB_BYTES:.1f} GiB of "
                         "memory available on this machine now")


def model_fingerprint(module: torch.nn.Module, group: TensorParallelGroup) -> str:
    """The weights' fingerprint over every rank's shard (a collective: every rank calls it)."""
    shards = group.all_gather_object(weights_fingerprint(module))
    if len(shards) == 1:
        return shards[0]
    return hashlib.sha256("|".join(shards).encode()).hexdigest()
