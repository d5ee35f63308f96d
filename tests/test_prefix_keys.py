"""Blended keys (core.prefix_keys): the KV chunk reuse made for a prompt is found again by the
same tokens, in the pool (this module) and through the KV tiers (test_kv_tiers.py), on a tiny
random Llama (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from model_fixtures import make_tiny_model
from pagedrag import LLM, SamplingParams
from pagedrag.core.block_hash import blended_block_key, hash_block

GREEDY = SamplingParams(temperature=0, max_tokens=8)
BLOCK = 16


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("blended"), "llama")
    generator = torch.Generator().manual_seed(11)
    return path, torch.randint(3, 250, (200,), generator=generator).tolist()


def _engine(path, **extra) -> LLM:
    return LLM(str(path), max_model_len=512, num_gpu_blocks_override=128, block_size=BLOCK, dtype="float32",
               enable_chunk_reuse=True, **extra)


def _segments(*segments, salt=None):
    return {"prompt_segments": [{"token_ids": list(s)} for s in segments], "cache_salt": salt}


def _build(llm: LLM, head, chunk, other, tail, salt=None):
    """Cache ``chunk`` (computed right after the head), then build head + other + chunk + tail
    with it imported; returns that output."""
    llm.generate(_segments(head, chunk, [5, 6, 7], salt=salt), GREEDY, use_tqdm=False)
    built = llm.generate(_segments(head, other, chunk, tail, salt=salt), GREEDY, use_tqdm=False)[0]
    assert built.num_chunk_hit_tokens + built.num_recomputed_tokens > 0  # the chunk was imported
    return built


def test_the_same_prompt_again_computes_only_its_last_block(tokens):
    """With the default question window, the prompt built from an imported chunk comes back from
    its blended blocks whole (the window's blocks were computed by the model, so they are whole
    blocks): only the last partial block is computed, and the answer is the first one's."""
    path, ids = tokens
    llm = _engine(path)
    head, other, chunk, tail = ids[:32], ids[32:64], ids[64:160], [9, 10, 11, 12, 13]
    built = _build(llm, head, chunk, other, tail)
    again = llm.generate(_segments(head, other, chunk, tail), GREEDY, use_tqdm=False)[0]
    num_full = (len(again.prompt_token_ids) - 1) // BLOCK * BLOCK
    assert again.num_cached_tokens == num_full and again.num_chunk_hit_tokens == again.num_recomputed_tokens == 0
    assert again.outputs[0].token_ids == built.outputs[0].token_ids
    assert llm.stats()["blended_prefix_hits"] == num_full - 64


def test_blocks_holding_copied_kv_are_not_taken_inside_the_question_window(tokens):
    """A prompt that stops earlier in the same tokens has its question window over blocks that
    held copied chunk KV in the first prompt: those are not taken (chunk reuse would recompute
    them there), so its hits end at the first block that starts in its window."""
    path, ids = tokens
    llm = _engine(path, chunk_recompute_window=48)
    head, other, chunk, tail = ids[:32], ids[32:64], ids[64:160], [9, 10, 11, 12, 13]
    _build(llm, head, chunk, other, tail)  # chunk's blocks 79-112 copied, 112-160 recomputed
    shorter = llm.generate(_segments(head, other, chunk[:48], tail), GREEDY, use_tqdm=False)[0]
    assert shorter.num_cached_tokens == 80  # the window starts at 117 - 48 = 69: block 64-80 crosses it
    longer = llm.generate(_segments(head, other, chunk, list(range(20, 60))), GREEDY, use_tqdm=False)[0]
    assert longer.num_cached_tokens == 160  # its window lies past the copied blocks


def test_blended_blocks_stay_with_their_tenant_and_their_settings(tokens):
    path, ids = tokens
    llm = _engine(path)
    head, other, chunk, tail = ids[:32], ids[32:64], ids[64:160], [9, 10, 11, 12, 13]
    _build(llm, head, chunk, other, tail, salt="tenant-a")
    stranger = llm.generate(_segments(head, other, chunk, tail, salt="tenant-b"), GREEDY, use_tqdm=False)[0]
    assert stranger.num_cached_tokens == 0
    exact = hash_block(None, ids[:BLOCK])
    keys = {blended_block_key(exact, settings, whole) for settings in (b"0.15/384/first", b"0.15/0/first")
            for whole in (True, False)}
    assert len(keys) == 4 and exact not in keys
