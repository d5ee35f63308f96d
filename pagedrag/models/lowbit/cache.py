"""A GGUF model's low-bit projections, packed once and cached as one safetensors file.

Opening a GGUF with the gguf package parses its whole vocabulary (seconds for SmolLM2's
49,152 tokens), and unpacking and repacking 211 tensors takes seconds more; the packed
buffers read back from safetensors in well under a second. The file's name carries the
GGUF's identity and what the packing depends on (torch's version, the CPU capability its
kernels dispatch on). It is written under a temporary name and renamed into place, so a
file that exists is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedrag.models.lowbit.layouts import Int4Layout

_FORMAT = "v1"  # bump when the saved layout changes


def cached_layouts(gguf: Path, cache: Path, build: Callable[[], dict[str, Int4Layout]]) -> dict[str, Int4Layout]:
    """The layouts ``build`` makes for ``gguf`` (module name -> layout), from the cache when
    an earlier load saved them."""
    target = cache / f"lowbit-{gguf.stem.lower()}-{_key(gguf)}.safetensors"
    if target.is_file():
        return _read(target)
    layouts = build()
    _write(target, layouts)
    return layouts


def _key(gguf: Path) -> str:
    stat = gguf.stat()
    identity = (f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{torch.__version__}|"
                f"{torch.backends.cpu.get_cpu_capability()}|{_FORMAT}")
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def _write(target: Path, layouts: dict[str, Int4Layout]) -> None:
    tensors = {f"{name}.{buffer}": getattr(layout, buffer).contiguous()
               for name, layout in layouts.items() for buffer in ("packed", "scales_and_zeros")}
    shapes = {name: [layout.group_size, layout.input_copies] for name, layout in layouts.items()}
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    try:
        save_file(tensors, tmp, metadata={"layouts": json.dumps(shapes)})
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _read(path: Path) -> dict[str, Int4Layout]:
    with safe_open(path, framework="pt") as tensors:
        shapes = json.loads(tensors.metadata()["layouts"])
        return {name: Int4Layout(tensors.get_tensor(f"{name}.packed"), tensors.get_tensor(f"{name}.scales_and_zeros"),
                                 group_size, input_copies)
                for name, (group_size, input_copies) in shapes.items()}
