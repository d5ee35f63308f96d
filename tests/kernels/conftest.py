"""Kernel tests run on a GPU when there is one, else under Triton's interpreter on CPU.

The interpreter must be switched on before triton decorates the kernels, so this
sets TRITON_INTERPRET=1 (on a machine without CUDA) before any test module imports
them.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
