"""Kernel tests run on a GPU when there is one, else under Triton's interpreter on CPU.

The interpreter must be switched on before triton decorates the kernels, so this
sets TRITON_INTERPRET=1 (on a machine without CUDA) before any test module imports
them. It also makes ``pagedrag.kernels`` importable from a plain source checkout
(the kernels/ folder is mapped to that name by the package's install).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[2]


def _ensure_kernels_importable() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if importlib.util.find_spec("pagedrag.kernels") is not None:
        return
    import pagedrag
    spec = importlib.util.spec_from_file_location(
        "pagedrag.kernels", ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["pagedrag.kernels"] = module
    pagedrag.kernels = module
    spec.loader.exec_module(module)


_ensure_kernels_importable()
