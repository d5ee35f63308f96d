"""EngineArgs: every knob of the engine, with vLLM's names, validated up front."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

import torch

from pagedrag.models.lowbit.methods import check_quantization
from pagedrag.spec_decode.config import SpeculativeConfig, loads as speculative_json
from pagedrag.text_checks import check_bool, check_float, check_int

# On CPU there is no "device memory": unless kv_cache_memory_bytes is given, the
# pool takes this share of the memory the OS reports available at start.
DEFAULT_CPU_KV_FRACTION = 0.10
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
GIB_BYTES = 1 << 30
DEFAULT_KV_DISK_SIZE = 16.0  # GiB
PREEMPTION_MODES = ("recompute", "swap")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
DTYPES = {"auto": None, "float32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}


def _arg(default, help_text: str):
    """A field with its --help text (the CLI's flags are generated from these)."""
    return field(default=default, metadata={"help": help_text})


def _check_text(name: str, value: object) -> str:
    """A string; a path (pathlib.Path, os.PathLike) becomes its string."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__} {value!r}")
    return value


def _check_mapping(name: str, value: object) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__} {value!r}")
    return value


def _check_whole(name: str, value: object) -> int:
    """An int; a float with no fraction (2e9 from a YAML or JSON config) is one too, as pydantic
    reads it for vLLM's arguments; 2.5 is not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return check_int(name, value)


def _check_names(name: str, value: object) -> list[str]:
    """A non-empty list of non-empty strings."""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"{name} must be a name or a non-empty list of names, got {value!r}")
    return list(value)


_TYPE_CHECKS = {"bool": check_bool, "int": _check_whole, "float": check_float, "str": _check_text,
                "dict": _check_mapping, "list": _check_names}


def _typed(name: str, annotation: str, value: object) -> object:
    """``value`` checked against its field's annotation ("int", "float | None", ...): a
    ValueError naming the field for any other type (as every configuration error, and as
    pydantic's ValidationError, vLLM's), so that a string "false" is never taken for True nor
    "128" compared with a number; numbers become the field's type (a numpy int an int), paths
    strings."""
    kinds = annotation.replace(" ", "").split("|")
    if value is None and "None" in kinds:
        return None
    errors = []
    for kind in kinds:
        if kind == "None":
            continue
        try:
            return _TYPE_CHECKS[kind](name, value)
        except TypeError as error:
            errors.append(error)
    raise ValueError(str(errors[-1])) from None


@dataclass
class EngineArgs:
    """Engine configuration.

    gpu_memory_utilization follows the seed article, not vLLM: it is the fraction
    of the device memory that remains *after the weights are loaded* which the KV
    block pool may take. On CPU the pool is DEFAULT_CPU_KV_FRACTION of available
    memory unless kv_cache_memory_bytes says otherwise.
    """

    model: str | None = _arg(None, "a model folder, a .gguf file, or a Hugging Face hub name (downloaded "
                                 "unless HF_HUB_OFFLINE is set); default: the embedded SmolLM2-135M-Instruct")
    served_model_name: str | list | None = _arg(None, "the name(s) clients use for the model (the server's "
                                                      "--served-model-name); the first labels the metrics, as "
                                                      "vLLM's; default: the model's own")
    tokenizer: str | None = _arg(None, "a tokenizer other than the model's own: a folder or hub name")
    revision: str | None = _arg(None, "the hub revision (branch, tag or commit) of the model; default: main")
    download_dir: str | None = _arg(None, "where hub downloads go (a Hugging Face cache folder); default: HF_HOME's")
    hf_token: bool | str | None = field(default=None, repr=False, metadata={  # a secret: never in a repr or log
        "help": "token for private or gated hub models (True: the saved login, as vLLM); default: HF_TOKEN "
                "or the saved login"})
    trust_remote_code: bool = _arg(False, "let the checkpoint's own Python code run when its config or "
                                          "tokenizer needs it (the model itself must be of the Llama family)")
    dtype: str = _arg("auto", "weights and KV cache dtype: auto (bfloat16 on CUDA, float32 on CPU), "
                              "float32, bfloat16 or float16")
    device: str = _arg("auto", "auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    seed: int | None = _arg(0, "seed of the engine's random state (requests without a seed of their own); "
                               "None: a random one")
    load_format: str = _arg("auto", "auto (the checkpoint's weights) or dummy (random weights, for benchmarks)")
    quantization: str | None = _arg(None, "low-bit weights on CPU: gguf (a GGUF file's own 4-bit blocks, e.g. "
                                          "the embedded model's), int4 or int8 (weight-only, quantized at "
                                          "load); default (None or none): float weights")
    gpu_memory_utilization: float = _arg(0.90, "share of the device memory left after the weights that the "
                                               "KV block pool takes")
    kv_cache_memory_bytes: int | None = _arg(None, "KV pool size in bytes (overrides gpu_memory_utilization; "
                                                   "on CPU the default is 10%% of available memory)")
    num_gpu_blocks_override: int | None = _arg(None, "KV pool size in blocks, ignoring every memory budget")
    block_size: int = _arg(16, "tokens per KV block: the unit of allocation and of prefix matching")
    max_model_len: int | None = _arg(None, "the longest sequence (prompt + output); default: the model's")
    max_num_seqs: int = _arg(256, "most sequences in one running batch (and the largest n per request)")
    max_num_batched_tokens: int | None = _arg(None, "token budget of one step (default 2048 on CPU, 8192 on CUDA)")
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of prompts that share a prefix")
    enable_chunk_reuse: bool = _arg(False, "reuse a retrieved chunk's KV wherever it lands in a prompt given as "
                                          "prompt_segments (approximate: see the README's tuning guide)")
    chunk_recompute_fraction: float = _arg(0.15, "with enable_chunk_reuse: share of each reused chunk's tokens "
                                                 "computed again with the full context (below 1, none of a chunk "
                                                 "that follows the segment it was computed after)")
    chunk_recompute_strategy: str = _arg("first", "which tokens of a reused chunk are computed again: "
                                                  "first (its first ones, as EPIC) or deviation (those whose KV "
                                                  "moves most at an early layer, as CacheBlend)")
    chunk_recompute_window: int = _arg(384, "with enable_chunk_reuse, below a recompute fraction of 1: the last "
                                            "imported tokens before the question computed again too (0: none)")
    enable_chunked_prefill: bool = _arg(True, "split long prompts over steps so decodes keep running")
    preemption_mode: str = _arg("recompute", "what a full pool does to the newest request: recompute "
                                             "(free its blocks) or swap (copy them to CPU memory)")
    swap_space: float = _arg(4.0, "GiB of CPU memory for swapped-out blocks (preemption_mode=swap)")
    kv_offloading_size: float = _arg(0.0, "GiB of host memory (pinned, on CUDA) for a KV tier under the pool "
                                          "that keeps blocks the pool lets go; 0: none (on CPU the pool is "
                                          "host memory already: a bigger pool does the same)")
    kv_disk_path: str | None = _arg(None, "a directory for a KV tier on disk: blocks kept across restarts "
                                          "and shared by every engine of the same model that uses it")
    kv_disk_size: float | None = _arg(None, "GiB the disk tier may take in kv_disk_path, over every engine "
                                            "sharing it (least recently used blocks go first, whichever "
                                            "engine wrote them); default: 16 with kv_disk_path")
    enforce_eager: bool = _arg(False, "no CUDA graphs (debugging)")
    async_scheduling: bool | None = _arg(None, "launch step N+1 before reading step N's tokens; default: "
                                               "on for CUDA, off for CPU")
    tensor_parallel_size: int = _arg(1, "ranks to shard the model over: one process per GPU on CUDA (NCCL), "
                                        "or per share of the cores on CPU (gloo); must divide the "
                                        "attention and KV heads")
    disable_log_stats: bool = _arg(False, "no periodic stats line in the log")
    metrics_prefix: str = _arg("pagedrag", "prefix of the Prometheus series: pagedrag, or vllm for dashboards "
                                           "made for vLLM")
    cpu_threads: int | None = _arg(None, "threads for CPU compute; default: up to the physical cores this "
                                         "process may use, as many as run each size of step fastest")
    tool_call_parser: str | None = _arg(None, "how tool calls are read from the model's text: hermes, "
                                              "llama3_json or smollm2; default: from the chat template")
    logprobs_mode: str = _arg("raw_logprobs", "what logprobs report, as vLLM: raw_logprobs (the model's, before "
                                              "any sampling parameter), raw_logits, or processed_logprobs / "
                                              "processed_logits (after every parameter the token was sampled "
                                              "under: bans, bias, penalties, temperature, min-p, top-k, top-p)")
    enable_auto_tool_choice: bool = _arg(True, "let the model decide whether to call a tool (tool_choice "
                                               "auto); off: only none, required or a named function")
    speculative_config: dict | None = _arg(None, "speculative decoding drafted from the context, as a dict or "
                                                 "JSON object with vLLM's keys: method ngram or suffix, "
                                                 "num_speculative_tokens, prompt_lookup_min/max, "
                                                 "suffix_decoding_*, disable_by_batch_size; default: off")

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, str):  # the JSON text of --speculative-config
            self.speculative_config = speculative_json(self.speculative_config)
        for arg in fields(self):
            setattr(self, arg.name, _typed(arg.name, arg.type, getattr(self, arg.name)))
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
            (self.logprobs_mode in LOGPROBS_MODES,
             f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"),
            (self.preemption_mode in PREEMPTION_MODES,
             f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"),
            (0 <= self.chunk_recompute_fraction <= 1,
             f"chunk_recompute_fraction must be a number in [0, 1], got {self.chunk_recompute_fraction!r}"),
            (self.chunk_recompute_strategy in ("deviation", "first"),
             f"chunk_recompute_strategy must be deviation or first, got {self.chunk_recompute_strategy!r}"),
            (self.chunk_recompute_window >= 0,
             f"chunk_recompute_window must be a whole number of tokens >= 0, got {self.chunk_recompute_window!r}"),
            (self.enable_prefix_caching or not self.enable_chunk_reuse,
             "enable_chunk_reuse needs enable_prefix_caching: reused chunks live in the prefix cache's pool"),
            (self.swap_space >= 0, f"swap_space must be non-negative GiB, got {self.swap_space}"),
            (self.kv_offloading_size >= 0,
             f"kv_offloading_size must be a finite, non-negative number of GiB, got {self.kv_offloading_size!r}"),
            (self.kv_disk_size is None or self.kv_disk_size > 0,
             f"kv_disk_size must be a finite, positive number of GiB, got {self.kv_disk_size!r}"),
            (self.kv_disk_path is None or self.kv_disk_path.strip() != "",
             f"kv_disk_path must be a directory path, got {self.kv_disk_path!r}"),
            (self.kv_disk_size is None or self.kv_disk_path is not None,
             f"kv_disk_size={self.kv_disk_size!r} is given without kv_disk_path: the disk tier needs a directory"),
            (self.kv_disk_path is None or not os.path.exists(self.kv_disk_path) or os.path.isdir(self.kv_disk_path),
             f"kv_disk_path {self.kv_disk_path!r} exists and is not a directory"),
            (self.enable_prefix_caching or not self.uses_kv_tiers,
             "kv_offloading_size / kv_disk_path need enable_prefix_caching: the tiers hold prefix-cache blocks"),
            (self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
             f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}"),
            (self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
             f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"),
            (self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto, cpu or cuda[:N], got {self.device!r}"),
            (self.load_format in ("auto", "dummy"),
             f"load_format must be auto or dummy, got {self.load_format!r}"),
            (self.tensor_parallel_size >= 1,
             f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}"),
            (self.tensor_parallel_size == 1 or self.quantization in (None, "none"),
             f"quantization={self.quantization!r} runs on one CPU process; it cannot be combined with "
             f"tensor_parallel_size={self.tensor_parallel_size}"),
            (self.tensor_parallel_size == 1 or self.chunk_recompute_strategy == "first",
             "chunk_recompute_strategy='deviation' probes the model on one rank; with "
             f"tensor_parallel_size={self.tensor_parallel_size} use 'first'"),
            (self.metrics_prefix in ("pagedrag", "vllm"),
             f"metrics_prefix must be pagedrag or vllm, got {self.metrics_prefix!r}"),
            (self.seed is None or -2 ** 63 <= self.seed < 2 ** 64,
             f"seed must be a 64-bit integer (or None: a random one), got {self.seed}"),
            (self.cpu_threads is None or self.cpu_threads >= 1,
             f"cpu_threads must be at least 1, got {self.cpu_threads}"),
            (self.tool_call_parser in (None, "hermes", "llama3_json", "smollm2"),
             f"tool_call_parser must be hermes, llama3_json or smollm2, got {self.tool_call_parser!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        check_quantization(self.quantization)
        self._validate_speculation()

    def _validate_speculation(self) -> None:
        """The speculative_config parses (any other method or key is refused by name). Under
        tensor parallelism rank 0 drafts and verifies; the other ranks run its verification
        steps like any other step."""
        if self.speculative_config is None:
            return
        self.speculative()

    def speculative(self) -> SpeculativeConfig | None:
        """The validated speculative_config (None: no speculative decoding)."""
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

    def metrics_model_name(self, model_name: str) -> str:
        """The metrics' model_name label: the first served name, else ``model_name`` (the model's own)."""
        if self.served_model_name is None:
            return model_name
        return self.served_model_name if isinstance(self.served_model_name, str) else self.served_model_name[0]

    @property
    def uses_kv_tiers(self) -> bool:
        return bool(self.kv_offloading_size) or self.kv_disk_path is not None

    @property
    def resolved_kv_disk_size(self) -> float:
        """GiB of the disk tier: kv_disk_size, or DEFAULT_KV_DISK_SIZE when not given."""
        return DEFAULT_KV_DISK_SIZE if self.kv_disk_size is None else self.kv_disk_size

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def model_source(self):
        """Where load_model finds the model and tokenizer (pagedrag.models.loader.ModelSource)."""
        from pagedrag.models.hub import HubOptions
        from pagedrag.models.loader import ModelSource

        return ModelSource(HubOptions(self.revision, self.download_dir, self.hf_token), self.tokenizer,
                           self.trust_remote_code)

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
        """Whether a step's tokens may be read back during the next step: by default only on
        CUDA, where the device works while the host does the bookkeeping. With speculative
        decoding only steps after which nothing can draft run so (LLMEngine._leaves_tokens_in_flight)."""
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
