"""Layers split over a tensor-parallel group (Megatron-style), and how each takes its part
of a full checkpoint tensor.

- ``MergedLinear`` (column-parallel): rank r holds rows r*out/N .. (r+1)*out/N of each
  stacked projection (q, k, v by heads; gate, up by intermediate features); its output is
  its slice of the full output, with no communication.
- ``RowParallelLinear``: rank r holds the matching input columns; the partial products are
  summed by one all-reduce, then the bias (held whole by every rank) is added.
- ``VocabParallelEmbedding`` / ``VocabParallelHead``: rank r holds ceil(vocab/N) rows of the
  vocabulary (the last rows zero where N does not divide it); lookups outside a rank's rows
  give zeros there and the all-reduce fills them in; the head's logits are all-gathered.

Invariant: at N = 1 each layer computes exactly what a plain nn.Linear / nn.Embedding does,
with the same kernels (no masking, no collective).

``split_dim(leaf)`` says along which dimension a parameter is split (None: held whole);
``load_weight`` copies a rank's part of the full tensor into the parameter.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from pagedrag.distributed.group import SINGLE, TensorParallelGroup


class Linear(nn.Linear):
    """nn.Linear whose product runs through ``ops.linear`` (oneDNN on CPU, cuBLAS on CUDA);
    held whole on every rank."""

    def forward(self, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)

    def split_dim(self, leaf: str) -> int | None:
        return None


class MergedLinear(Linear):
    """Several column-parallel projections of one input stacked along the output dim (one GEMM).

    ``shard_sizes`` are this rank's sizes (the full sizes / N); shard i owns output rows
    [sum(shard_sizes[:i]), sum(shard_sizes[:i+1])).
    """

    def __init__(self, in_features: int, full_sizes: list[int], bias: bool,
                 group: TensorParallelGroup = SINGLE):
        self.shard_sizes = [size // group.size for size in full_sizes]
        super().__init__(in_features, sum(self.shard_sizes), bias=bias)

    def shard(self, tensor_name: str, index: int) -> torch.Tensor:
        """A view of shard ``index`` of the 'weight' or 'bias' tensor (for loading)."""
        start = sum(self.shard_sizes[:index])
        return getattr(self, tensor_name).narrow(0, start, self.shard_sizes[index])

    def split_dim(self, leaf: str) -> int | None:
        return 0


class RowParallelLinear(Linear):
    """Input features split over the ranks; partial products summed by an all-reduce."""

    def __init__(self, full_in_features: int, out_features: int, bias: bool,
                 group: TensorParallelGroup = SINGLE):
        super().__init__(full_in_features // group.size, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        if self.group.size == 1:
            return ops.linear(x, self.weight, self.bias)
        out = self.group.all_reduce(ops.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def split_dim(self, leaf: str) -> int | None:
        return 1 if leaf == "weight" else None


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding with the vocabulary's rows split over the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup = SINGLE):
        self.vocab_start, _ = group.part(vocab_size)
        super().__init__(-(-vocab_size // group.size), hidden_size)
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = super().forward(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return self.group.all_reduce(hidden)

    def split_dim(self, leaf: str) -> int | None:
        return 0


class VocabParallelHead(nn.Linear):
    """The LM head (untied) with the vocabulary's rows split over the ranks."""

    def __init__(self, hidden_size: int, vocab_size: int, group: TensorParallelGroup = SINGLE):
        super().__init__(hidden_size, -(-vocab_size // group.size), bias=False)

    def split_dim(self, leaf: str) -> int | None:
        return 0


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, ops: ModuleType,
                 group: TensorParallelGroup) -> torch.Tensor:
    """float32 logits [N, vocab_size] from this rank's vocabulary rows ``weight``: every rank's
    slice gathered, the padding rows dropped."""
    logits = ops.linear(hidden, weight).float()
    return group.all_gather(logits, dim=-1)[:, :vocab_size]


def load_weight(module: nn.Module, leaf: str, view: torch.Tensor, full: torch.Tensor,
                group: TensorParallelGroup, name: str) -> None:
    """Copy this rank's part of the checkpoint tensor ``full`` into ``view`` (a parameter of
    ``module``, or one stacked shard of it); rows past the full tensor's end are zeroed.
    Raises ValueError naming ``name`` when the shapes do not fit."""
    dim = module.split_dim(leaf) if hasattr(module, "split_dim") else None
    if dim is not None and group.size > 1:
        start, length = group.part(full.shape[dim])
        expected = list(full.shape)
        expected[dim] = -(-full.shape[dim] // group.size)
        _check_shape(name, expected, view, full)
        view.narrow(dim, length, view.shape[dim] - length).zero_()
        view.narrow(dim, 0, length).copy_(full.narrow(dim, start, length))
        return
    _check_shape(name, list(full.shape), view, full)
    view.copy_(full)


def _check_shape(name: str, expected: list[int], view: torch.Tensor, full: torch.Tensor) -> None:
    if list(view.shape) != expected:
        raise ValueError(f"{name}: checkpoint shape {tuple(full.shape)}, model expects "
                         f"{tuple(view.shape)}")
