"""Group-quantized weights as plain tensors, before any kernel packs them.

A :class:`Groups` holds a matrix [N, K] as integer codes with one scale and one offset
per row and group of ``group_size`` consecutive input columns:

    w[n, k] = scales[n, k // group_size] * codes[n, k] + offsets[n, k // group_size]

This is GGUF's own arithmetic for its block types (Q4_0, Q4_1, Q8_0, computed in
float32), so a GGUF tensor becomes a Groups without rounding anything, and
``dequantize`` gives back, bit for bit, what GGUF's dequantization gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Groups:
    """codes uint8 [N, K] (values below 2 ** bits); scales and offsets float32 [N, K / group_size].

    Invariants: K is a multiple of group_size; every code is below 2 ** bits.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group_size: int
    bits: int

    def __post_init__(self) -> None:
        rows, columns = self.codes.shape
        if columns % self.group_size or self.scales.shape != (rows, columns // self.group_size):
            raise ValueError(f"codes {tuple(self.codes.shape)} do not split into groups of {self.group_size} "
                             f"matching scales {tuple(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix [N, K] the groups stand for (GGUF's arithmetic, see the module)."""
        expand = lambda per_group: per_group.repeat_interleave(self.group_size, dim=1)
        return expand(self.scales) * self.codes.float() + expand(self.offsets)

    def rows(self, index: torch.Tensor) -> Groups:
        """The same groups with rows taken in ``index``'s order (a permutation of output rows
        moves whole groups: a group runs along one row)."""
        return Groups(self.codes[index], self.scales[index], self.offsets[index], self.group_size, self.bits)

    def nibble_planes(self) -> tuple[Groups, Groups]:
        """An 8-bit Groups as two 4-bit ones whose matrices add up to it exactly:
        code = 16 * high + low, so w = (16 * scale) * high + (scale * low + offset)."""
        if self.bits != 8:
            raise ValueError(f"nibble_planes splits 8-bit codes, not {self.bits}-bit ones")
        high = Groups(self.codes >> 4, self.scales * 16, self.offsets, self.group_size, 4)
        low = Groups(self.codes & 15, self.scales, torch.zeros_like(self.offsets), self.group_size, 4)
        return high, low


def stack_rows(parts: list[Groups]) -> Groups:
    """Several matrices of the same K and grouping, one under the other (merged projections)."""
    first = parts[0]
    if any((p.group_size, p.bits, p.shape[1]) != (first.group_size, first.bits, first.shape[1]) for p in parts):
        raise ValueError("stacked groups must share K, group size and bits")
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])
    return Groups(cat("codes"), cat("scales"), cat("offsets"), first.group_size, first.bits)


def join_columns(left: Groups, right: Groups) -> Groups:
    """[left | right] along K: x @ [A | B].T over [x | x] is x @ (A + B).T, one product for two."""
    if (left.group_size, left.bits, left.shape[0]) != (right.group_size, right.bits, right.shape[0]):
        raise ValueError("joined groups must share N, group size and bits")
    cat = lambda name: torch.cat([getattr(left, name), getattr(right, name)], dim=1)
    return Groups(cat("codes"), cat("scales"), cat("offsets"), left.group_size, left.bits)
