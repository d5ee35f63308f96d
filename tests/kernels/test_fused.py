"""The fused elementwise kernels (RMSNorm + residual, rotary embedding, SiLU-and-mul)
against their torch references, and the references against the model and HF.

Inputs are random (never zeros), drawn fresh each run from a seed that failing
assertions print. Shapes are odd on purpose: 1 to 33 tokens, hidden sizes of real
models (64, 576 SmolLM2, 896 Qwen2-0.5B, 4096 Llama-3-8B, 5120) that leave the
last block partial, GQA heads that are not powers of two, row-strided views like a
fused projection's outputs.

Under Triton's interpreter (CPU) the kernels run in fp32 and fp16; bf16 runs on a
GPU only, as the interpreter truncates fp32 -> bf16 casts where GPUs round to
nearest even. fp32 must match to 1e-6; 16-bit results round where torch rounds, so
they may differ only where fp32 rsqrt/exp or a sum's order tip a rounding: by at
most 2 ulp, in at most 1% of the elements.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf_llama

pytest.importorskip("triton")

from pagedrag.kernels import reference, triton_ops  # noqa: E402
from pagedrag.models import llama  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
KERNEL_DTYPES = [pytest.param(FP32, id="fp32"), pytest.param(FP16, id="fp16"),
                 pytest.param(BF16, id="bf16", marks=pytest.mark.skipif(
                     DEVICE == "cpu", reason="the interpreter truncates fp32 -> bf16 casts"))]


@pytest.fixture
def seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=gen.device) * scale).to(dtype)


def _generator(seed: int, device: str = DEVICE) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _cos_sin_cache(inv_freq: torch.Tensor, scaling: float, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos | sin of p * inv_freq, times scaling (the model's formula)."""
    freqs = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, seed: int) -> None:
    """fp32: within 1e-6; 16-bit: within 2 ulp and, under the interpreter, at most 1% of the
    elements differ at all (that catches a misplaced cast). A GPU contracts a * b + c into
    one fused multiply-add, rounding once where torch rounds twice, so there many more
    elements differ by an ulp while all stay within 2."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"seed={seed}"
    if out.dtype == FP32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6, msg=lambda m: f"{m}\nseed={seed}")
        return
    ulp = torch.finfo(out.dtype).eps
    torch.testing.assert_close(out, ref, rtol=2 * ulp, atol=2 * ulp, msg=lambda m: f"{m}\nseed={seed}")
    if out.device.type == "cpu":
        differ = (out != ref).float().mean().item()
        assert differ <= 0.01, f"{differ:.2%} of the elements differ, seed={seed}"


def test_exports_match_reference_signatures():
    for name in ("rms_norm", "rotary_embedding", "silu_and_mul"):
        assert inspect.signature(getattr(triton_ops, name)) == inspect.signature(getattr(reference, name))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows,hidden,with_residual,strided", [
    (1, 4096, True, False),      # Llama-3-8B decode
    (7, 576, True, True),        # SmolLM2, x a strided view
    (33, 896, False, False),     # Qwen2-0.5B
    (3, 5120, True, False),
    (5, 64, False, True),
])
def test_rms_norm(rows, hidden, with_residual, strided, dtype, seed):
    gen = _generator(seed)
    x = _randn(rows, hidden + 5, dtype=dtype, gen=gen)[:, 2:hidden + 2] if strided \
        else _randn(rows, hidden, dtype=dtype, gen=gen)
    residual = _randn(rows, hidden, dtype=dtype, gen=gen, scale=4.0) if with_residual else None
    weight = (1 + _randn(hidden, dtype=FP32, gen=gen, scale=0.2)).to(dtype)
    out = triton_ops.rms_norm(x, weight, 1e-5, residual)
    ref = reference.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        assert torch.equal(out[1], ref[1]), f"the sum differs, seed={seed}"
        out, ref = out[0], ref[0]
    assert_matches(out, ref, seed)


def test_rms_norm_per_head_view(seed):
    """Qwen3's q/k norm: [T, heads, head_dim] strided out of a fused QKV output."""
    gen = _generator(seed)
    q = _randn(5, 12 * 128, dtype=FP16, gen=gen)[:, :8 * 128].view(5, 8, 128)
    weight = (1 + _randn(128, dtype=FP32, gen=gen, scale=0.2)).to(FP16)
    out = triton_ops.rms_norm(q, weight, 1e-6)
    assert out.shape == q.shape
    assert_matches(out, reference.rms_norm(q, weight, 1e-6), seed)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim,positions_dtype", [
    (1, 32, 8, 128, "int64"),  # Llama-3-8B decode
    (7, 9, 3, 64, "int64"),    # SmolLM2-135M
    (17, 14, 2, 64, "int32"),  # Qwen2-0.5B
    (3, 4, 4, 128, "int64"),   # MHA
    (5, 8, 1, 64, "int64"),    # one KV head
])
def test_rotary_embedding(tokens, q_heads, kv_heads, head_dim, positions_dtype, dtype, seed):
    gen = _generator(seed)
    cpu_gen = _generator(seed, "cpu")
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=FP32, device=DEVICE) / head_dim)
    cache = _cos_sin_cache(inv_freq, 1.0, 5000)
    positions = torch.randint(0, 5000, (tokens,), generator=cpu_gen).to(DEVICE, getattr(torch, positions_dtype))
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    qkv = _randn(tokens, q_size + 2 * kv_size, dtype=dtype, gen=gen)  # q | k | v, as the model's
    before = qkv.clone()
    q, k = reference.rotary_embedding(qkv[:, :q_size], qkv[:, q_size:q_size + kv_size],
                                      positions, cache, head_dim)
    assert torch.equal(qkv, before), "the reference leaves its inputs alone"
    out_q, out_k = triton_ops.rotary_embedding(qkv[:, :q_size], qkv[:, q_size:q_size + kv_size],
                                               positions, cache, head_dim)
    assert out_q.data_ptr() == qkv.data_ptr(), "the kernel rotates in place"
    assert_matches(out_q, q, seed)
    assert_matches(out_k, k, seed)
    assert torch.equal(qkv[:, q_size + kv_size:], before[:, q_size + kv_size:]), f"v written, seed={seed}"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("tokens,intermediate,strided", [
    (1, 14336, False),   # Llama-3-8B decode: 14 programs per row
    (7, 1536, True),     # SmolLM2, a strided view
    (33, 96, False),
    (3, 4864, False),    # Qwen2-0.5B
])
def test_silu_and_mul(tokens, intermediate, strided, dtype, seed):
    gen = _generator(seed)
    width = 2 * intermediate
    x = _randn(tokens, width + 8, dtype=dtype, gen=gen, scale=3.0)[:, 8:] if strided \
        else _randn(tokens, width, dtype=dtype, gen=gen, scale=3.0)
    assert_matches(triton_ops.silu_and_mul(x), reference.silu_and_mul(x), seed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fused_ops_replay_in_cuda_graph(seed):
    """Captured once, replayed on new values: nothing in the launches reads the device on the host."""
    gen = _generator(seed)
    hidden, q_size, kv_size, head_dim = 4096, 4096, 1024, 128
    x, residual = _randn(9, hidden, dtype=BF16, gen=gen), _randn(9, hidden, dtype=BF16, gen=gen)
    weight = (1 + _randn(hidden, dtype=FP32, gen=gen, scale=0.2)).to(BF16)
    qkv = _randn(9, q_size + 2 * kv_size, dtype=BF16, gen=gen)
    gate_up = _randn(9, 2 * 14336, dtype=BF16, gen=gen)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=FP32, device=DEVICE) / head_dim)
    cache = _cos_sin_cache(inv_freq, 1.0, 8192)
    positions = torch.randint(0, 8192, (9,), generator=gen, device=DEVICE)

    def step():
        q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
        return (*triton_ops.rms_norm(x, weight, 1e-5, residual),
                *triton_ops.rotary_embedding(q, k, positions, cache, head_dim),
                triton_ops.silu_and_mul(gate_up))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for tensor in (x, residual, qkv, gate_up):
        tensor.copy_(torch.randn(tensor.shape, generator=gen, device=DEVICE))
    positions.random_(0, 8192, generator=gen)
    q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
    refs = (*reference.rms_norm(x, weight, 1e-5, residual),
            *reference.rotary_embedding(q, k, positions, cache, head_dim),
            reference.silu_and_mul(gate_up))
    graph.replay()
    for out, ref in zip(outs, refs, strict=True):
        assert_matches(out, ref, seed)


# The references against HF's modules: on CPU the model runs these references.

@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
def test_rms_norm_reference_matches_hf(dtype, seed):
    gen = _generator(seed, "cpu")
    hf_norm = hf_llama.LlamaRMSNorm(576, eps=1e-5).to(dtype)
    hf_norm.weight.data = (1 + _randn(576, dtype=FP32, gen=gen, scale=0.2)).to(dtype)
    x, residual = _randn(7, 576, dtype=dtype, gen=gen), _randn(7, 576, dtype=dtype, gen=gen, scale=4.0)
    out, summed = reference.rms_norm(x, hf_norm.weight, 1e-5, residual)
    assert torch.equal(summed, x + residual), f"seed={seed}"
    torch.testing.assert_close(out, hf_norm(x + residual), msg=lambda m: f"{m}\nseed={seed}")


ROPES = [{"rope_type": "default"},
         {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 512},
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}]  # scales cos/sin


def _rope_case(rope: dict, dtype: torch.dtype, head_dim: int, gen: torch.Generator):
    """(config, positions, q [11, 4 heads], k [11, 2 heads]) drawn from gen."""
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=head_dim, max_position_embeddings=4096,
                         rope_parameters={"rope_theta": 500000.0, **rope})
    positions = torch.randint(0, config.max_position_embeddings, (11,), generator=gen)
    q, k = _randn(11, 4 * head_dim, dtype=dtype, gen=gen), _randn(11, 2 * head_dim, dtype=dtype, gen=gen)
    return config, positions, q, k


@pytest.mark.parametrize("rope", ROPES, ids=lambda rope: rope["rope_type"])
@pytest.mark.parametrize("dtype,head_dim", [(BF16, 64), (FP16, 128), (FP32, 128)], ids=str)
def test_rotary_reference_matches_hf(rope, dtype, head_dim, seed):
    """Bit for bit: the model's table of every position holds the cos/sin HF computes per step."""
    config, positions, q, k = _rope_case(rope, dtype, head_dim, _generator(seed, "cpu"))
    cache = llama.RotaryEmbedding(config).cos_sin_cache
    hf_cos, hf_sin = hf_llama.LlamaRotaryEmbedding(config)(q, positions[None])
    hf_q, hf_k = hf_llama.apply_rotary_pos_emb(q.view(1, 11, 4, head_dim), k.view(1, 11, 2, head_dim),
                                               hf_cos, hf_sin, unsqueeze_dim=2)
    out_q, out_k = reference.rotary_embedding(q, k, positions, cache, head_dim)
    assert torch.equal(out_q, hf_q.flatten(2)[0]) and torch.equal(out_k, hf_k.flatten(2)[0]), f"seed={seed}"


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
def test_silu_and_mul_reference_matches_hf(dtype, seed):
    torch.manual_seed(seed)
    hf_mlp = hf_llama.LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=96)).to(dtype)
    x = _randn(7, 64, dtype=dtype, gen=_generator(seed, "cpu"))
    gate_up = torch.cat((hf_mlp.gate_proj(x), hf_mlp.up_proj(x)), dim=-1)
    assert torch.equal(hf_mlp.down_proj(reference.silu_and_mul(gate_up)), hf_mlp(x)), f"seed={seed}"
