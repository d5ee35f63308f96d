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
