"""What every rank builds at start-up: its device, its share of the model, a KV pool of the
same number of blocks on every rank, and a model runner over them (with CUDA graphs).

Rank 0 (the engine) and each tensor-parallel worker call ``build_device_side`` in the same
order, so their collectives (loading agrees on the pool size; graph capture records the
same all-reduces) line up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedrag import kernels
from pagedrag.config import DEFAULT_CPU_KV_FRACTION, GIB_BYTES, EngineArgs
from pagedrag.core.block_pool import blocks_for
from pagedrag.distributed.group import SINGLE, TensorParallelGroup
from pagedrag.kv_tiers.build import model_fingerprint
from pagedrag.models.loader import LoadedModel, load_model
from pagedrag.worker.cpu_threads import configure_cpu_threads
from pagedrag.worker.cuda_graphs import GraphShape, verification_shapes
from pagedrag.worker.kv_cache import CacheShape, KVCacheTensors, available_cpu_memory
from pagedrag.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedrag")


@dataclass
class DeviceSide:
    loaded: LoadedModel
    shape: CacheShape  # this rank's: its share of the KV heads
    weights: str  # the fingerprint of every rank's weights (KV tiers' keyspace); "" without tiers
    num_blocks: int
    num_cpu_blocks: int
    runner: ModelRunner


def rank_device(args: EngineArgs, group: TensorParallelGroup) -> torch.device:
    """The device of this rank: cuda:(index + rank) under tensor parallelism on CUDA."""
    device = args.resolved_device()
    if device.type == "cuda" and group.size > 1:
        return torch.device("cuda", (device.index or 0) + group.rank)
    return device


def build_device_side(args: EngineArgs, group: TensorParallelGroup = SINGLE) -> DeviceSide:
    device = rank_device(args, group)
    if device.type == "cuda" and group.size > 1:
        torch.cuda.set_device(device)  # NCCL's communicator and the graphs' stream live there
    dtype = args.resolved_dtype(device)
    torch.manual_seed(args.seed)
    threads = configure_cpu_threads(args.cpu_threads, processes=group.size) if device.type == "cpu" else None
    loaded = load_model(args.model, dtype=dtype, device=device, load_format=args.load_format,
                        max_model_len=args.max_model_len, source=args.model_source(),
                        quantization=args.quantization, group=group)
    module = loaded.module
    weights = model_fingerprint(module, group) if args.uses_kv_tiers else ""
    shape = CacheShape(module.num_layers, args.block_size, module.num_kv_heads, module.head_dim, dtype)
    num_blocks = group.agree_min(_pool_blocks(args, shape, device, group.size))
    _check_fits(args, num_blocks, loaded.max_model_len)
    num_cpu_blocks = shape.blocks_in(args.swap_space * GIB_BYTES) if args.preemption_mode == "swap" else 0
    cache = KVCacheTensors(shape, num_blocks, num_cpu_blocks, device, kernels.ops_for(device), group)
    runner = ModelRunner(module, cache, args.block_size, device, frozenset(loaded.eos_token_ids),
                         args.chunk_recompute_strategy, group, threads, args.logprobs_mode)
    if device.type == "cuda" and not args.enforce_eager:
        runner.capture_graphs(args.max_num_seqs, loaded.max_model_len, _verification_graphs(args))
    return DeviceSide(loaded, shape, weights, num_blocks, num_cpu_blocks, runner)


def _verification_graphs(args: EngineArgs) -> list[GraphShape]:
    """The verification steps worth a graph: up to the drafting gate's rows (drafting stops
    above it), each checking 1 + up to num_speculative_tokens tokens; none without drafting."""
    speculative = args.speculative()
    if speculative is None:
        return []
    return verification_shapes(min(args.max_num_seqs, speculative.disable_by_batch_size),
                               speculative.num_speculative_tokens)


def _pool_blocks(args: EngineArgs, shape: CacheShape, device: torch.device, num_ranks: int) -> int:
    """The KV blocks this rank's memory budget holds (each rank holds 1/num_ranks of a block:
    its KV heads). On CPU the ranks share one memory, so each takes its share of the budget."""
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    available = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_cpu_memory() / num_ranks
    if args.kv_cache_memory_bytes is not None:
        share = args.kv_cache_memory_bytes / num_ranks
        if share > available:
            raise ValueError(f"kv_cache_memory_bytes={args.kv_cache_memory_bytes} is more than the "
                             f"{available / GIB_BYTES:.1f} GiB of {device.type} memory available"
                             f"{' per rank' if num_ranks > 1 else ''} after the weights")
        return shape.blocks_in(share)
    if device.type == "cuda":
        return shape.blocks_in(available * args.gpu_memory_utilization)
    if args.gpu_memory_utilization != EngineArgs.gpu_memory_utilization:
        logger.warning("gpu_memory_utilization=%s is a share of GPU memory and does not apply on CPU: the "
                       "pool takes %d%% of available memory; kv_cache_memory_bytes sets its size",
                       args.gpu_memory_utilization, round(DEFAULT_CPU_KV_FRACTION * 100))
    return shape.blocks_in(available * DEFAULT_CPU_KV_FRACTION)


def _check_fits(args: EngineArgs, num_blocks: int, max_model_len: int) -> None:
    needed = blocks_for(max_model_len, args.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV pool holds {num_blocks} blocks of {args.block_size} tokens "
            f"({num_blocks * args.block_size} tokens), fewer than one sequence of "
            f"max_model_len={max_model_len} needs ({needed} blocks): give the pool more "
            "memory (gpu_memory_utilization / kv_cache_memory_bytes / num_gpu_blocks_override) "
            "or lower max_model_len")
