"""A GGUF file's quantized tensors as :class:`Groups`, read from its raw blocks.

Nothing is dequantized or quantized again: each 32-weight block's float16 scale (and
minimum) and its codes are copied as they are, so the model computes with the weights
the file ships. Block formats (ggml's, all of 32 weights):

- Q4_0: d (f16), 16 bytes of nibbles; w = d * (q - 8).
- Q4_1: d (f16), m (f16), 16 bytes of nibbles; w = d * q + m.
- Q8_0: d (f16), 32 int8; w = d * q (kept as 8-bit codes q + 128 with offset -128 d).

Nibbles: byte j holds weight j in its low half and weight j + 16 in its high half.

llama.cpp's converter permutes the rows of a Llama model's q and k projections (it
stores rotary pairs interleaved); transformers undoes that when it loads the file, and
so does ``llama_projection`` here, so rows line up with the converted checkpoint.
"""

from __future__ import annotations

import contextlib
import struct
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from pagedrag.models.lowbit.groups import Groups, stack_rows

BLOCK = 32
# ggml type name -> bytes per 32-weight block
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
# our projection -> the GGUF tensors stacked into it, per layer
LLAMA_PROJECTIONS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


@contextlib.contextmanager
def reading_gguf(gguf: Path):
    """Errors of a GGUF file that does not parse (truncated, empty, not a GGUF) name the file."""
    try:
        yield
    except (ValueError, OSError, KeyError, IndexError, struct.error) as error:
        raise ValueError(f"cannot read GGUF file {str(gguf)!r} (truncated, empty or not a GGUF file?): "
                         f"{error}") from error


class GGUFGroups:
    """The quantized tensors of one GGUF file (memory-mapped by the ``gguf`` package)."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.path = path
        with reading_gguf(path):
            self._reader = GGUFReader(str(path))
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}

    @cached_property
    def architecture(self) -> str:
        return self._field("general.architecture")

    def _field(self, key: str):
        return self._reader.get_field(key).contents()

    def tensor(self, name: str) -> Groups:
        """The named tensor's blocks as Groups; ValueError for block types other than
        Q4_0, Q4_1 and Q8_0."""
        tensor = self._tensors[name]
        kind = tensor.tensor_type.name
        if kind not in _BLOCK_BYTES:
            raise ValueError(f"{self.path.name}: tensor {name} is {kind}; quantization='gguf' reads "
                             f"{', '.join(_BLOCK_BYTES)} blocks")
        blocks = torch.from_numpy(np.array(tensor.data)).view(tensor.data.shape[0], -1, _BLOCK_BYTES[kind])
        return _DECODERS[kind](blocks)

    def llama_projection(self, layer: int, projection: str) -> Groups:
        """Our merged ``projection`` (a LLAMA_PROJECTIONS key) of decoder ``layer``."""
        parts = []
        for short in LLAMA_PROJECTIONS[projection]:
            groups = self.tensor(f"blk.{layer}.{short}.weight")
            if short in ("attn_q", "attn_k"):
                heads = self._field("llama.attention.head_count" + ("_kv" if short == "attn_k" else ""))
                groups = groups.rows(_rotary_rows(groups.shape[0], heads))
            parts.append(groups)
        return stack_rows(parts)

    def output_head(self) -> Groups:
        """The LM head: ``output.weight``, else the tied ``token_embd.weight``."""
        return self.tensor("output.weight" if "output.weight" in self._tensors else "token_embd.weight")


def _rotary_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation: within each head it stored rows
    (0, half, 1, half + 1, ...); HF order is (0, 1, ..., half - 1, half, ...)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of each block, as float32 [N, blocks]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """16 bytes of nibbles from byte ``start`` -> codes [N, blocks * 32] (low halves first)."""
    packed = blocks[..., start:start + 16].contiguous()
    return torch.stack((packed & 15, packed >> 4), dim=-2).flatten(1)


def _q4_0(blocks: torch.Tensor) -> Groups:
    scales = _f16(blocks, 0)
    return Groups(_nibbles(blocks, 2), scales, -8 * scales, BLOCK, 4)


def _q4_1(blocks: torch.Tensor) -> Groups:
    return Groups(_nibbles(blocks, 4), _f16(blocks, 0), _f16(blocks, 2), BLOCK, 4)


def _q8_0(blocks: torch.Tensor) -> Groups:
    scales = _f16(blocks, 0)
    codes = (blocks[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8).flatten(1)
    return Groups(codes, scales, -128 * scales, BLOCK, 8)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0}
