"""Tiny random Llama-family checkpoints for tests, saved like a user's model folder.

``make_tiny_model(tmp_path, arch)`` writes config.json, generation_config.json,
model.safetensors and a byte-level tokenizer (ChatML template), so both
``pagedrag.models.load_model(path)`` and HF ``AutoModelForCausalLM`` /
``AutoTokenizer`` / ``generate`` work on the folder. Weights are seeded, hence
identical on every call; biases and norm weights are perturbed away from their
0/1 init so that loading them wrongly shows in the logits.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen3Config)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# arch -> (config class, what that family member adds to the common shape)
_ARCHS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama": (LlamaConfig, {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": (MistralConfig, {"sliding_window": 4096,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, {"tie_word_embeddings": True}),
}
ARCHS = tuple(_ARCHS)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per byte (ids 0-255) plus SPECIAL_TOKENS (256-258)."""
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_config(arch: str, vocab_size: int, **overrides) -> PretrainedConfig:
    """2 layers, hidden 64, 4 heads / 2 KV heads of head_dim 16, plus the arch's extras."""
    config_class, extras = _ARCHS[arch]
    shape = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=None,
        eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 3)
    return config_class(**{**shape, **extras, **overrides})


def make_tiny_model(tmp_path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``arch`` model ("llama", "mistral", "qwen2", "qwen3") and
    its tokenizer into a new folder under ``tmp_path``; returns that folder.

    ``overrides`` replace config fields (e.g. head_dim=32, tie_word_embeddings=True).
    """
    tokenizer = make_tokenizer()
    config = tiny_config(arch, len(tokenizer), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_vectors(model)
    suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    if len(suffix) > 80:  # nested overrides (rope parameters) make names past the file system's limit
        suffix = hashlib.sha256(suffix.encode()).hexdigest()[:16]
    path = Path(tmp_path) / f"tiny-{arch}{'-' + suffix if suffix else ''}-{seed}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _perturb_vectors(model: torch.nn.Module) -> None:
    """Add N(0, 0.1) noise to every 1-D parameter (norm weights, biases)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)


def hf_greedy(path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """HF transformers' greedy ``generate`` of each prompt (fp32): the reference the engine's
    greedy output must equal token for token."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs
