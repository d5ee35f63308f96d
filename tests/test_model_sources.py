"""Models as users name them: hub names through huggingface_hub's cache (offline here:
no hub is reachable from CI), PyTorch .bin checkpoints, and generation_config defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from transformers import AutoModelForCausalLM

from pagedrag.models.hub import HubOptions, hub_snapshot
from pagedrag.models.loader import ModelSource, load_model, sampling_defaults
from model_fixtures import make_tiny_model

REPO = "acme/tiny-llama"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def _fake_hub_cache(cache: Path, source: Path, revision: str = "main", commit: str = "a" * 40) -> Path:
    """Lay ``source`` out as huggingface_hub caches a download of REPO at ``revision``."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


@pytest.fixture()
def offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_cached_hub_name_loads_offline(tiny, tmp_path, offline):
    snapshot = _fake_hub_cache(tmp_path, tiny)
    assert hub_snapshot(REPO, HubOptions(download_dir=str(tmp_path))) == snapshot
    loaded = load_model(REPO, dtype=torch.float32, device="cpu",
                        source=ModelSource(hub=HubOptions(download_dir=str(tmp_path))))
    assert loaded.name == REPO and loaded.tokenizer is not None


def test_a_revision_resolves_through_its_ref(tiny, tmp_path, offline):
    snapshot = _fake_hub_cache(tmp_path, tiny, revision="v1", commit="b" * 40)
    assert hub_snapshot(REPO, HubOptions(revision="v1", download_dir=str(tmp_path))) == snapshot


def test_offline_and_not_cached_is_one_clear_error(tmp_path, offline):
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set"):
        hub_snapshot("acme/never-downloaded", HubOptions(download_dir=str(tmp_path)))


def test_a_pytorch_bin_checkpoint_gives_hf_greedy_tokens(tiny, tmp_path):
    from pagedrag import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    folder = tmp_path / "bin"
    folder.mkdir()
    hf.config.save_pretrained(folder)
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")  # as older transformers saved checkpoints
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny / name).is_file():
            shutil.copy(tiny / name, folder / name)
    assert not list(folder.glob("*.safetensors")) and list(folder.glob("*.bin"))
    prompt = [5, 9, 13, 17, 21, 25]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    llm = LLM(str(folder), max_model_len=128)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected


def test_generation_config_sets_the_default_sampling_params(tiny, tmp_path):
    folder = tmp_path / "with-defaults"
    shutil.copytree(tiny, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64, "do_sample": True}))
    assert sampling_defaults(str(folder), folder) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                      "max_tokens": 64}
    assert sampling_defaults(None, None) == {"temperature": 0.2, "top_p": 0.9}  # the embedded model's card


def _greedy_pair(folder: Path, prompt: list[int], max_tokens: int, **engine_kwargs) -> tuple[list[int], list[int]]:
    """(HF generate's greedy tokens, pagedrag's) for ``prompt`` on the checkpoint in ``folder``."""
    from pagedrag import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                           min_new_tokens=max_tokens)[0, len(prompt):].tolist()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=16 << 20, **engine_kwargs)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return expected, out[0].outputs[0].token_ids


@pytest.mark.parametrize("arch,window_config", [
    ("mistral", {"sliding_window": 24}),
    ("qwen2", {"sliding_window": 24, "use_sliding_window": True, "max_window_layers": 1}),
    ("qwen3", {"sliding_window": 24, "use_sliding_window": True, "max_window_layers": 0}),
])
def test_a_sliding_window_bounds_max_model_len_and_within_it_outputs_are_hfs(tmp_path, caplog, arch,
                                                                               window_config):
    """pagedrag attends over the whole context, HF over the window: sequences stay within it."""
    folder = make_tiny_model(tmp_path, arch, **window_config)
    with caplog.at_level("WARNING", logger="pagedrag.models.context_limit"):
        loaded = load_model(str(folder), dtype=torch.float32, device="cpu")
    assert loaded.max_model_len == 24 and "sliding_window 24" in caplog.text
    with pytest.raises(ValueError, match="max_model_len 25 exceeds the model's sliding_window 24"):
        load_model(str(folder), dtype=torch.float32, device="cpu", max_model_len=25)
    expected, ours = _greedy_pair(folder, list(range(40, 56)), max_tokens=8)  # 16 + 8 = the window
    assert ours == expected


def test_a_window_no_layer_applies_leaves_the_length_alone(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen2", sliding_window=8, use_sliding_window=False)
    assert load_model(str(folder), dtype=torch.float32, device="cpu").max_model_len == 512


def test_longrope_keeps_sequences_where_hf_uses_the_short_factors(tmp_path):
    factors = [1.0] * 8
    folder = make_tiny_model(tmp_path, "llama", max_position_embeddings=128, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": factors,
        "long_factor": [4.0] * 8, "original_max_position_embeddings": 32})
    assert load_model(str(folder), dtype=torch.float32, device="cpu").max_model_len == 32
    with pytest.raises(ValueError, match="longrope's original_max_position_embeddings 32"):
        load_model(str(folder), dtype=torch.float32, device="cpu", max_model_len=64)
    expected, ours = _greedy_pair(folder, list(range(40, 60)), max_tokens=12)
    assert ours == expected


def test_mistral_ignores_bias_flags_as_hf_does(tmp_path):
    folder = make_tiny_model(tmp_path, "mistral", attention_bias=True, mlp_bias=True)
    expected, ours = _greedy_pair(folder, [5, 9, 13, 17, 21, 25], max_tokens=8)
    assert ours == expected


def test_generation_configs_eos_replaces_the_configs(tiny, tmp_path):
    """HF's generate stops where generation_config.json says, not at config.json's eos."""
    folder = tmp_path / "other-eos"
    shutil.copytree(tiny, folder)
    config_eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    loaded = load_model(str(folder), dtype=torch.float32, device="cpu")
    assert 7 in loaded.eos_token_ids
    assert config_eos not in loaded.eos_token_ids or config_eos == loaded.tokenizer.eos_token_id


def test_a_trainers_training_args_bin_is_not_read_as_weights(tiny, tmp_path):
    import argparse

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    folder = tmp_path / "trainer-output"
    shutil.copytree(tiny, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    torch.save(argparse.Namespace(learning_rate=1e-4), folder / "training_args.bin")  # not weights_only-loadable
    loaded = load_model(str(folder), dtype=torch.float32, device="cpu")
    torch.testing.assert_close(loaded.module.model.embed_tokens.weight, hf.model.embed_tokens.weight)


def test_an_unreadable_weights_file_is_named(tiny, tmp_path):
    folder = tmp_path / "truncated"
    shutil.copytree(tiny, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"cannot read the weights file .*model\.safetensors"):
        load_model(str(folder), dtype=torch.float32, device="cpu")


def test_a_checkpoint_quantized_by_transformers_is_refused_by_name(tiny, tmp_path):
    folder = tmp_path / "fp8"
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='fp8' are not supported"):
        load_model(str(folder), dtype=torch.float32, device="cpu")
