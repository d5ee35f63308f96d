"""The Llama family of causal LMs, written for the paged KV cache.

One module covers Llama 2/3/3.1, Mistral, Qwen2, Qwen3 and SmolLM2; they differ
only in the switches collected by :class:`Variant` (projection biases, per-head
q/k RMSNorm) and in config values (rope type, head_dim, tied embeddings).

Invariants:
- ``forward`` works on a flat batch of T tokens (sequences packed one after the
  other, as :class:`AttentionMetadata` describes); there is no Python loop over
  tokens or sequences and no host synchronisation (.item(), .tolist()), so it
  can be captured in a CUDA graph.
- Rotary frequencies are float32 and static: they are computed once, by
  transformers' own ``ROPE_INIT_FUNCTIONS``, from the config. For the
  "dynamic" and "longrope" types this is the state HF starts in (the original
  context length); the per-length switching HF does at run time is left out
  because a graph needs static frequencies, so pagedrag.models.context_limit keeps
  sequences where that state is HF's.
- Every token attends to its whole context: a sliding window (Mistral, Qwen2/3 configs
  with ``use_sliding_window``) is not applied, so pagedrag.models.context_limit keeps
  sequences within the window, where the two are the same.
- Norms, rotary embedding and the MLP activation run through ``meta.ops``, like
  attention: the torch references on CPU, fused Triton kernels on CUDA.
- Under tensor parallelism (``group.size`` N > 1) each rank holds 1/N of the heads, KV
  heads, intermediate features and vocabulary (pagedrag.models.parallel_layers): one
  all-reduce after each attention and MLP block, one in the embedding, an all-gather of
  the logits. At N = 1 the model is exactly the single-device one.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedrag.distributed.group import SINGLE, TensorParallelGroup
from pagedrag.models.attention import AttentionMetadata, PagedAttention
from pagedrag.models.parallel_layers import (Linear, MergedLinear, RowParallelLinear, VocabParallelEmbedding,
                                             VocabParallelHead, vocab_logits)

KVCache = tuple[torch.Tensor, torch.Tensor]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def architecture_of(config: PretrainedConfig) -> str:
    """The supported architecture a config describes, or ValueError naming what was found.

    Configs built in code often have no ``architectures``; their model_type decides.
    """
    names = list(getattr(config, "architectures", None) or [])
    if not names and config.model_type in _ARCHITECTURE_OF_MODEL_TYPE:
        names = [_ARCHITECTURE_OF_MODEL_TYPE[config.model_type]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = ", ".join(names) or f"model_type={config.model_type!r}"
    raise ValueError(f"unsupported model architecture {found}; pagedrag supports "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")


@dataclass(frozen=True)
class Variant:
    """The switches that tell the family members apart."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def of(cls, config: PretrainedConfig) -> Variant:
        """Qwen2 always has q/k/v biases; Qwen3 normalizes q and k per head; Mistral has no
        bias whatever its config says (as HF builds it); Llama follows ``attention_bias`` /
        ``mlp_bias`` (absent means False)."""
        arch = architecture_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        if arch == "Qwen2ForCausalLM":
            return cls(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
        if arch == "MistralForCausalLM":
            return cls(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
        if arch == "Qwen3ForCausalLM":
            return cls(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
        return cls(qkv_bias=bias, o_bias=bias,
                   mlp_bias=bool(getattr(config, "mlp_bias", False)), qk_norm=False)


def head_dim_of(config: PretrainedConfig) -> int:
    """config.head_dim when the config sets it, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_splittable(config: PretrainedConfig, tensor_parallel_size: int) -> None:
    """ValueError unless ``tensor_parallel_size`` divides the attention heads, the KV heads and
    the MLP's intermediate size (each rank holds an equal share of each)."""
    counts = {"attention heads": config.num_attention_heads, "KV heads": config.num_key_value_heads,
              "intermediate size": config.intermediate_size}
    uneven = [f"{count} {what}" for what, count in counts.items() if count % tensor_parallel_size]
    if uneven:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide the model's "
                         f"{', '.join(uneven)}: each rank holds an equal share of them")


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, optionally fused with the residual add.

    ``norm(x, residual, ops=ops)`` returns (normed(x + residual), x + residual):
    the sum is the next residual. Numerics follow HF: add in the model dtype,
    normalize in float32, cast back, then scale by the weight.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, ops: ModuleType):
        return ops.rms_norm(x, self.weight, self.eps, residual)


def rope_frequencies(config: PretrainedConfig,
                     device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [head_dim / 2], attention_scaling) for the config's rope type.

    Reads transformers 5's ``rope_parameters`` or the older ``rope_scaling``;
    every scaled type comes from ``ROPE_INIT_FUNCTIONS``. Plain rope is computed
    here only where transformers no longer registers a "default" function.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    elif rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = head_dim_of(config)
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        scaling = 1.0
    else:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    if 2 * inv_freq.numel() != head_dim_of(config):
        raise ValueError("partial rotary embeddings (rotary dim < head_dim) are not supported")
    return inv_freq.to(device=device, dtype=torch.float32), float(scaling)


class RotaryEmbedding(nn.Module):
    """The cos/sin table of every position, for ``ops.rotary_embedding`` (neox layout).

    ``cos_sin_cache`` [max_position_embeddings, head_dim] float32: row p holds
    cos(p * inv_freq) then sin(p * inv_freq), times the attention scaling (the
    values HF computes per step). Both buffers must stay float32:
    ``Module.to(dtype)`` rounds them and ``Module.to_empty`` drops their values,
    so call ``reset_frequencies`` after either.
    """

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = config
        inv_freq, self.scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos_sin_cache", self._table(inv_freq), persistent=False)

    def reset_frequencies(self) -> None:
        """Recompute the float32 frequencies and table on the buffers' device."""
        self.inv_freq = rope_frequencies(self.config, self.inv_freq.device)[0]
        self.cos_sin_cache = self._table(self.inv_freq)

    def _table(self, inv_freq: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32,
                                 device=inv_freq.device)
        freqs = positions[:, None] * inv_freq[None, :]
        return torch.cat((freqs.cos() * self.scaling, freqs.sin() * self.scaling), dim=-1)


class LlamaAttention(nn.Module):
    """qkv projection, optional per-head q/k norm, rope, paged attention, output projection."""

    def __init__(self, config: PretrainedConfig, variant: Variant, group: TensorParallelGroup):
        super().__init__()
        self.num_heads = config.num_attention_heads // group.size  # this rank's heads
        self.num_kv_heads = config.num_key_value_heads // group.size
        self.head_dim = head_dim_of(config)
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], variant.qkv_bias, group)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, variant.o_bias, group)
        if variant.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = variant.qk_norm
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden, meta.ops).split(self.qkv_proj.shard_sizes, dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim), ops=meta.ops).flatten(1)
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim), ops=meta.ops).flatten(1)
        q, k = meta.ops.rotary_embedding(q, k, positions, cos_sin_cache, self.head_dim)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out, meta.ops)


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up as one merged GEMM."""

    def __init__(self, config: PretrainedConfig, variant: Variant, group: TensorParallelGroup):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; pagedrag supports 'silu'")
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], variant.mlp_bias, group)
        self.down_proj = RowParallelLinear(size, config.hidden_size, variant.mlp_bias, group)

    def forward(self, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x, ops)), ops)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; carries the residual stream separately so norms fuse the add."""

    def __init__(self, config: PretrainedConfig, variant: Variant, group: TensorParallelGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, variant, group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, variant, group)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata):
        """Returns (this layer's output, residual); their sum is the layer's true output."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden, ops=meta.ops), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual, ops=meta.ops)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual, ops=meta.ops)
        return self.mlp(hidden, meta.ops), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: PretrainedConfig, variant: Variant, group: TensorParallelGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, variant, group) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.forward_layers(input_ids, positions, kv_caches, meta, len(self.layers))
        hidden, _ = self.norm(hidden, residual, ops=meta.ops)
        return hidden

    def forward_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                       meta: AttentionMetadata, num_layers: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first ``num_layers`` decoder layers (storing their K/V): (hidden, residual)."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers[:num_layers], kv_caches[:num_layers], strict=True):
            hidden, residual = layer(hidden, residual, positions, self.rotary.cos_sin_cache,
                                     kv_cache, meta)
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """The engine-facing model: ``forward`` to hidden states, ``compute_logits`` to logits.

    Parameter names match HF checkpoints except the merged projections
    (``qkv_proj`` = q|k|v, ``gate_up_proj`` = gate|up) and, with tied embeddings,
    the absent ``lm_head`` (logits then use ``model.embed_tokens.weight``).
    pagedrag.models.lowbit may replace the projections by low-bit modules after loading.
    """

    def __init__(self, config: PretrainedConfig, group: TensorParallelGroup = SINGLE):
        super().__init__()
        check_splittable(config, group.size)
        self.config = config
        self.group = group
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads // group.size  # this rank's share
        self.head_dim = head_dim_of(config)
        self.model = LlamaModel(config, Variant.of(config), group)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, group)
        self.low_bit_head: nn.Module | None = None  # set by pagedrag.models.lowbit under "gguf"

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]; stores this step's K/V."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (through the low-bit head when set)."""
        if self.low_bit_head is not None:
            return self.low_bit_head(hidden, ops).float()
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return vocab_logits(hidden, weight, self.config.vocab_size, ops, self.group)
