"""Swapping a loaded model's float projections for :class:`LowBitLinear` modules.

Invariants: after ``quantize_model`` with a method other than "none", every decoder
projection is a LowBitLinear whose decode products read the low-bit layout; its float
projection stays for prefill (LowBitLinear's docstring says why), so the low-bit path
holds the float weights plus the packed ones. The embedding stays float; the LM head is
low-bit under "gguf" only. A projection whose shape the CPU kernels cannot take (an LM head
of 49,153 rows, a pruned MLP) keeps its float weights, named in one logged warning.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from pagedrag.models.llama import Linear, LlamaForCausalLM
from pagedrag.models.lowbit.cache import cached_layouts
from pagedrag.models.lowbit.gguf_groups import LLAMA_PROJECTIONS, GGUFGroups
from pagedrag.models.lowbit.groups import Groups, join_columns
from pagedrag.models.lowbit.layouts import INT4_ROW_MULTIPLE, INT8_COLUMN_MULTIPLE, Int4Layout, LayoutShapeError
from pagedrag.models.lowbit.linear import LowBitLinear
from pagedrag.models.lowbit.quantize import INT4_GROUP_SIZE, int4_groups, int8_layout

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
    """Every decoder projection (by module path) and the LM head (HEAD) from the file's blocks,
    each whose shape the int4 kernel takes."""
    if gguf.architecture != "llama":
        raise ValueError(f"quantization='gguf' reads Llama-architecture GGUF files, "
                         f"{gguf.path.name} is {gguf.architecture!r}")
    builders = {name: (lambda index=index, projection=projection: gguf.llama_projection(index, projection))
                for name, index, projection in _projections(module)}
    builders[HEAD] = gguf.output_head
    layouts = {}
    for name, groups_of in builders.items():
        try:
            layouts[name] = int4_layout(groups_of())
        except LayoutShapeError:
            pass  # kept float: _install names it
    return layouts


def _install(module: LlamaForCausalLM, layouts: dict) -> None:
    """Every layout in place of its float projection; projections without one stay float."""
    for name, layout in layouts.items():
        if name != HEAD:
            _replace(module, name, layout)
    if HEAD in layouts:
        module.low_bit_head = LowBitLinear(layouts[HEAD], _float_head(module))
    expected = [name for name, _, _ in _projections(module)] + [HEAD]
    _warn_kept_float(module, "gguf", [name for name in expected if name not in layouts])


def _float_head(module: LlamaForCausalLM) -> Linear:
    """The float LM head as a Linear sharing its weight (the tied embedding's, if tied)."""
    head = Linear(module.config.hidden_size, module.config.vocab_size, bias=False, device="meta")
    head.weight = module.model.embed_tokens.weight if module.tie_word_embeddings else module.lm_head.weight
    return head


def _from_float(module: LlamaForCausalLM, method: str) -> None:
    kept_float = []
    for name, _, _ in _projections(module):
        weight = module.get_submodule(name).weight
        try:
            layout = int8_layout(weight) if method == "int8" else Int4Layout.from_groups(int4_groups(weight))
        except LayoutShapeError:
            kept_float.append(name)
            continue
        _replace(module, name, layout)
    _warn_kept_float(module, method, kept_float)


def _projections(module: LlamaForCausalLM) -> list[tuple[str, int, str]]:
    """(module path, layer index, projection) of every decoder projection."""
    return [(f"model.layers.{index}.{projection}", index, projection)
            for index in range(len(module.model.layers)) for projection in LLAMA_PROJECTIONS]


def _warn_kept_float(module: LlamaForCausalLM, method: str, names: list[str]) -> None:
    """One warning naming the projections (with their shapes) that keep float weights."""
    if not names:
        return
    shapes = [f"{'lm_head' if name == HEAD else name} {_shape(module, name)}" for name in names]
    logger.warning("quantization=%r: %d of %d projections keep float weights, their shapes do not fit "
                   "torch's CPU low-bit kernels (int4: out_features divisible by %d and, from float, "
                   "in_features by %d; int8: in_features by %d): %s", method, len(names),
                   len(_projections(module)) + (method == "gguf"), INT4_ROW_MULTIPLE, INT4_GROUP_SIZE,
                   INT8_COLUMN_MULTIPLE, ", ".join(shapes))


def _shape(module: LlamaForCausalLM, name: str) -> str:
    """out x in features of a float projection (HEAD: the LM head)."""
    if name == HEAD:
        return f"{module.config.vocab_size}x{module.config.hidden_size}"
    layer = module.get_submodule(name)
    return f"{layer.out_features}x{layer.in_features}"


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
