"""EngineArgs: every knob of the engine, with vLLM's names, validated up front."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

# On CPU there is no "device memory": unless kv_cache_memory_bytes is given, the
# pool takes this share of the memory the OS reports available at start.
DEFAULT_CPU_KV_FRACTION = 0.10
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
GIB_BYTES = 1 << 30
PREEMPTION_MODES = ("recompute", "swap")
DTYPES = {"auto": None, "float32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}


@dataclass
class EngineArgs:
    """Engine configuration.

    gpu_memory_utilization follows the seed article, not vLLM: it is the fraction
    of the device memory that remains *after the weights are loaded* which the KV
    block pool may take. On CPU the pool is DEFAULT_CPU_KV_FRACTION of available
    memory unless kv_cache_memory_bytes says otherwise.
    """

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when present, else cpu
    seed: int = 0
    load_format: str = "auto"  # auto | dummy (random weights, for benchmarks)
    gpu_memory_utilization: float = 0.90
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out blocks
    enforce_eager: bool = False  # True: no CUDA graphs
    async_scheduling: bool | None = None  # None: on for CUDA, off for CPU (see LLMEngine.step)

    def __post_init__(self) -> None:
        if self.model is not None:
            self.model = os.fspath(self.model)
        self._validate()

    def _validate(self) -> None:
        checks = [
            (0 < self.gpu_memory_utilization <= 1,
             f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"),
            (self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0 and self.block_size <= 256,
             f"block_size must be a power of two between 1 and 256, got {self.block_size}"),
            (self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}"),
            (self.max_model_len is None or self.max_model_len >= 1,
             f"max_model_len must be at least 1, got {self.max_model_len}"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"),
            (self.preemption_mode in PREEMPTION_MODES,
             f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"),
            (self.swap_space >= 0, f"swap_space must be non-negative GiB, got {self.swap_space}"),
            (self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
             f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}"),
            (self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
             f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"),
            (self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto, cpu or cuda[:N], got {self.device!r}"),
            (self.load_format in ("auto", "dummy"),
             f"load_format must be auto or dummy, got {self.load_format!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but no CUDA device is available")
        return device

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        dtype = DTYPES[self.dtype]
        if dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return dtype

    def resolved_async_scheduling(self, device: torch.device) -> bool:
        """Whether a step's tokens are read back during the next step: by default only on
        CUDA, where the device works while the host does the bookkeeping."""
        if self.async_scheduling is None:
            return device.type == "cuda"
        return self.async_scheduling

    def resolved_max_num_batched_tokens(self, max_model_len: int, device: torch.device) -> int:
        """The per-step token budget; without chunked prefill it must hold a whole prompt.

        Default with chunked prefill: DEFAULT_MAX_NUM_BATCHED_TOKENS on CPU, four times
        that on CUDA, where bigger prefill chunks keep the matrix units busy."""
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                    f"max_model_len ({max_model_len}) and chunked prefill is off: long prompts "
                    "could never be scheduled; raise it or enable_chunked_prefill=True")
            return self.max_num_batched_tokens
        default = DEFAULT_MAX_NUM_BATCHED_TOKENS * (4 if device.type == "cuda" else 1)
        if self.enable_chunked_prefill:
            return default
        return max(default, max_model_len)
