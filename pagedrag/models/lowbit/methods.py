"""The ``quantization=`` values (vLLM's argument name) and which one a model gets.

- None or "none": float weights in the engine's dtype (the embedded model: its GGUF
  dequantized to float32; what the HF-equality tests use). The embedded model stays on
  this path by default: the low-bit path missed the issue's batch-1 target against
  llama.cpp on the 2-core AVX2 machine it was measured on (benchmarks/RESULTS.md, "Low-bit
  weights on CPU"), which was the condition for making it the default.
- "gguf": a GGUF model's own Q4_0 / Q4_1 / Q8_0 blocks, unchanged, for every decoder
  projection and the LM head (the embedded model, or a ``.gguf`` file of the Llama
  architecture).
- "int4" / "int8": weight-only round-to-nearest quantization of a float checkpoint's
  decoder projections at load (int4: groups of 32, int8: per row); the LM head stays float.

Every low-bit method runs on torch's CPU kernels; on CUDA only None and "none" are served.
This module imports nothing heavy, so EngineArgs can check a value up front.
"""

from __future__ import annotations

QUANTIZATION_METHODS = ("none", "gguf", "int4", "int8")


def check_quantization(requested: str | None) -> None:
    """ValueError unless ``requested`` is None or one of QUANTIZATION_METHODS."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None: the "
                         f"checkpoint decides), got {requested!r}")


def resolve_quantization(requested: str | None, *, is_gguf: bool, device_type: str) -> str:
    """The method a model loads with (see the module docstring); ValueError for a method this
    model or device cannot serve."""
    check_quantization(requested)
    if requested is None:
        return "none"
    if requested != "none" and device_type != "cpu":
        raise ValueError(f"quantization={requested!r} runs on CPU only (torch's CPU int4/int8 kernels); "
                         f"on {device_type} use quantization=None or 'none'")
    if requested == "gguf" and not is_gguf:
        raise ValueError("quantization='gguf' reads a GGUF file's own blocks: give model= a .gguf file "
                         "(or the embedded default); for a float checkpoint use 'int4' or 'int8'")
    return requested
