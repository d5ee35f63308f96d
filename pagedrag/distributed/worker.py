"""A tensor-parallel worker process: ``python -m pagedrag.distributed.worker``, started by
rank 0 (pagedrag.distributed.launch) with (rank, size, port, EngineArgs) pickled on its
standard input.

It builds what rank 0 builds on the device side (its share of the model, a KV pool of the
same number of blocks, CUDA graphs), then follows every order rank 0 broadcasts (a step plan,
or a gather of blocks for the KV tiers) until the None order. Any error ends the process with a traceback and a non-zero code; rank 0 then
stops with TensorParallelFailure naming this rank (the ranks cannot resynchronize).
"""

from __future__ import annotations

import os
import pickle
import sys
from datetime import timedelta

import torch.distributed as dist

from pagedrag.distributed.group import TensorParallelGroup


def serve(args, group: TensorParallelGroup) -> None:
    """Build this rank's device side, then follow rank 0's orders until it stops."""
    from pagedrag.worker.device_side import build_device_side

    runner = build_device_side(args, group).runner
    while (orders := group.broadcast_object()) is not None:
        runner.follow(orders)


def main() -> None:
    from pagedrag.distributed.launch import STARTUP_TIMEOUT_S, announce, join_group

    rank, size, port, args = pickle.load(sys.stdin.buffer)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                          timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    announce(store, rank)
    group = join_group(rank, size, args.resolved_device().type, store)
    serve(args, group)
    # The process ends here without tearing the groups down: rank 0 does not wait for it,
    # and NCCL teardown after graph-captured collectives can hang.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
