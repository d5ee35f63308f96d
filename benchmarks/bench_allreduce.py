"""What tensor parallelism's all-reduces cost per engine step, alone.

    torchrun --nproc-per-node 2 benchmarks/bench_allreduce.py [--shape 8b|70b] [--batch 1 32]

A decode step of a Llama shape under tensor parallelism runs two all-reduces a layer (after
the attention's output projection and after the MLP's down projection) over [batch, hidden]
activations in the model dtype. This times one step's worth of them as the engine runs them:
eagerly, and (on CUDA, NCCL) replayed from one CUDA graph, as decode steps are. On CPU the
ranks use gloo and only the eager figure exists. Rank 0 prints a markdown table; the share of
a decode step is this time over bench_gpu.py's ms/token at the same size.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from bench_gpu import SHAPES

REPEATS = 50


def step_of_all_reduces(buffers: list[torch.Tensor]) -> None:
    for buffer in buffers:
        dist.all_reduce(buffer)


def timed_ms(fn, device: torch.device) -> float:
    """Mean wall time of ``fn`` over REPEATS runs (after one warm-up), ranks in step."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPEATS * 1e3


def figures(layers: int, hidden: int, batch: int, device: torch.device, dtype: torch.dtype) -> tuple:
    buffers = [torch.ones(batch, hidden, dtype=dtype, device=device) for _ in range(2 * layers)]
    eager = timed_ms(lambda: step_of_all_reduces(buffers), device)
    if device.type != "cuda":
        return eager, None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_of_all_reduces(buffers)
    return eager, timed_ms(graph.replay, device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    rank = int(os.environ["RANK"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    layers, hidden = SHAPES[args.shape][:2]
    rows = [(batch, *figures(layers, hidden, batch, device, dtype)) for batch in args.batch]
    if rank == 0:
        print(f"\n{dist.get_world_size()} ranks, {dist.get_backend()}, Llama-3-{args.shape} shape: "
              f"{2 * layers} all-reduces of [batch, {hidden}] {dtype} per step\n")
        print("| batch | eager, ms/step | CUDA graph, ms/step |")
        print("|---|---|---|")
        for batch, eager, graphed in rows:
            print(f"| {batch} | {eager:.3f} | {'n/a (CPU)' if graphed is None else f'{graphed:.3f}'} |")
    dist.barrier()
    os._exit(0)  # no teardown: NCCL's after graph-captured collectives has been seen to hang


if __name__ == "__main__":
    main()
