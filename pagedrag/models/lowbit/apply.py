"""Swapping a loaded model's float projections for :class:`LowBitLinear` modules.

Invariants: after ``quantize_model`` with a method other than "none", every decoder
projection is a LowBitLinear whose decode products read the low-bit layout; its float
projection stays for prefill (LowBitLinear's docstring says why), so the low-bit path
holds the float weights plus the packed ones. The embedding stays float; the LM head is
low-bit under "gguf" only.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from pagedrag.models.llama import Linear, LlamaForCausalLM
from pagedrag.models.lowbit.cache import cached_layouts
from pagedrag.models.lowbit.gguf_groups import LLAMA_PROJECTIONS, GGUFGroups
from pagedrag.models.lowbit.groups import Groups, join_columns
from pagedrag.models.lowbit.layouts import Int4Layout
from pagedrag.models.lowbit.linear import LowBitLinear
from pagedrag.models.lowbit.quantize import int4_groups, int8_layout

logger = logging.getLogger("pagedrag")
HEAD = "low_bit_head"


def quantize_model(module: LlamaForCausalLM, method: str, gguf: Path | None, cache: Path) -> None:
    """Apply ``method`` (a resolved QUANTIZATION_METHODS value) to ``module`` in place;
    "gguf" reads the blocks from the file ``gguf`` (packed once, then kept under ``cache``)."""
    if method == "gguf":
        layouts = cached_layouts(gguf, cache, lambda: _gguf_layouts(module, GGUFGroups(gguf)))
        _install(module, layouts)
    elif method in ("int4", "int8"):
        _from_float(module, method)
    if method != "none":
        logger.info("weights: %s low-bit projections on torch's CPU kernels (bfloat16 activations)", method)


def int4_layout(groups: Groups) -> Int4Layout:
    """4-bit groups as they are; 8-bit ones (Q8_0) as their two nibble planes side by side,
    one int4 product that sums both (exact: see Groups.nibble_planes)."""
    if groups.bits == 8:
        return Int4Layout.from_groups(join_columns(*groups.nibble_planes()), input_copies=2)
    return Int4Layout.from_groups(groups)


def _gguf_layouts(module: LlamaForCausalLM, gguf: GGUFGroups) -> dict[str, Int4Layout]:
    """Every decoder projection (by module path) and the LM head (HEAD) from the file's blocks."""
    if gguf.architecture != "llama":
        raise ValueError(f"quantization='gguf' reads Llama-architecture GGUF files, "
                         f"{gguf.path.name} is {gguf.architecture!r}")
    layouts = {f"model.layers.{index}.{projection}": int4_layout(gguf.llama_projection(index, projection))
               for index in range(len(module.model.layers)) for projection in LLAMA_PROJECTIONS}
    layouts[HEAD] = int4_layout(gguf.output_head())
    return layouts


def _install(module: LlamaForCausalLM, layouts: dict) -> None:
    for name, layout in layouts.items():
        if name != HEAD:
            _replace(module, name, layout)
    module.low_bit_head = LowBitLinear(layouts[HEAD], _float_head(module))


def _float_head(module: LlamaForCausalLM) -> Linear:
    """The float LM head as a Linear sharing its weight (the tied embedding's, if tied)."""
    head = Linear(module.config.hidden_size, module.config.vocab_size, bias=False, device="meta")
    head.weight = module.model.embed_tokens.weight if module.tie_word_embeddings else module.lm_head.weight
    return head


def _from_float(module: LlamaForCausalLM, method: str) -> None:
    for index in range(len(module.model.layers)):
        for projection in LLAMA_PROJECTIONS:
            name = f"model.layers.{index}.{projection}"
            weight = module.get_submodule(name).weight
            _replace(module, name, int8_layout(weight) if method == "int8" else _int4_of_float(weight, name))


def _int4_of_float(weight, projection: str) -> Int4Layout:
    try:
        return Int4Layout.from_groups(int4_groups(weight))
    except ValueError as error:
        raise ValueError(f"{projection} {tuple(weight.shape)} does not fit the int4 CPU layout ({error}); "
                         "use quantization='int8'") from None


def _replace(module: nn.Module, projection: str, layout) -> None:
    """Put a LowBitLinear over ``layout`` where the float projection ``projection`` (a module
    path) was."""
    parent_name, _, child = projection.rpartition(".")
    parent = module.get_submodule(parent_name)
    old: Linear = getattr(parent, child)
    if (layout.out_features, layout.in_features) != (old.out_features, old.in_features):
        raise ValueError(f"{projection}: low-bit weight {layout.out_features}x{layout.in_features}, "
                         f"model expects {old.out_features}x{old.in_features}")
    setattr(parent, child, LowBitLinear(layout, old, getattr(old, "shard_sizes", None)))
