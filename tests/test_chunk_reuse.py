"""Chunk reuse (core.chunk_cache) and in-step prefix sharing, on the embedded model.

The exact path is the reference: with every token of a reused chunk recomputed the outputs
are the full prefill's token for token; with chunk reuse off prompt_segments change nothing.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pagedrag import LLM, SamplingParams
from pagedrag.core.chunk_cache import ChunkCache, Recompute
from pagedrag.kernels import reference
from pagedrag.rag.canonical import REUSABLE_CHUNK_TEMPLATE, PromptCanonicalizer
from pagedrag.rag.corpus import stdlib_chunks
from pagedrag.worker.chunk_moves import rotate_keys
from pagedrag.worker.recompute_selection import first_tokens

ENGINE = {"max_model_len": 2048, "kv_cache_memory_bytes": 192 << 20}
GREEDY = SamplingParams(temperature=0, max_tokens=6)
SYSTEM = "You answer from the documents below.\n"


def _prompts(count: int = 6, seed: int = 0) -> list[list[str]]:
    """RAG prompts as segments: the system prompt, 3 of 8 chunks in varied order, a question."""
    chunks = [c.text + "\n" for c in stdlib_chunks(max_chars=400, limit=8)]
    rng = random.Random(seed)
    return [[SYSTEM, *rng.sample(chunks, 3), f"Question {i}: what is described first?\nAnswer:"]
            for i in range(count)]


def _run(llm: LLM, prompts: list[list[str]]):
    return [llm.generate({"prompt_segments": p}, GREEDY, use_tqdm=False)[0] for p in prompts]


@pytest.fixture(scope="module")
def exact():
    llm = LLM(**ENGINE)
    return llm, _run(llm, _prompts())


@pytest.mark.parametrize("strategy", ["deviation", "first"])
def test_recomputing_every_token_matches_full_prefill(exact, strategy):
    _, reference_outputs = exact
    llm = LLM(**ENGINE, enable_chunk_reuse=True, chunk_recompute_fraction=1.0, chunk_recompute_strategy=strategy)
    outputs = _run(llm, _prompts())
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference_outputs]
    assert sum(o.num_recomputed_tokens for o in outputs) > 0  # chunks were imported, then recomputed
    assert llm.llm_engine.kv.pool.num_free == llm.llm_engine.kv.pool.num_blocks


def test_segments_without_chunk_reuse_are_the_whole_prompt(exact):
    llm, reference_outputs = exact
    whole = llm.generate([{"prompt_token_ids": o.prompt_token_ids} for o in reference_outputs], GREEDY,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in whole] == [o.outputs[0].token_ids for o in reference_outputs]
    assert all(o.num_chunk_hit_tokens == 0 for o in reference_outputs)


def test_chunks_without_chunk_reuse_are_named_once(exact, caplog):
    """Chunks given to an engine without chunk reuse change nothing, and the log says so once."""
    llm, _ = exact
    inputs = llm.llm_engine.inputs.copy()
    chunk = stdlib_chunks(max_chars=400, limit=1)[0].text
    with caplog.at_level("WARNING", logger="pagedrag.engine.inputs"):
        plain = inputs.process(f"{SYSTEM}{chunk}\nQuestion?")
        for _ in range(2):
            assert inputs.process(f"{SYSTEM}{chunk}\nQuestion?", chunks=[chunk]) == plain
        inputs.copy().render_chat([{"role": "user", "content": chunk}], chunks=[chunk])
    assert [r.message.count("chunk reuse is off") for r in caplog.records] == [1]


def test_reuse_counts_add_up_and_the_prefix_cache_stays_exact():
    llm = LLM(**ENGINE, enable_chunk_reuse=True, chunk_recompute_fraction=0.0, chunk_recompute_window=0)
    first, second = (c.text + "\n" for c in stdlib_chunks(max_chars=400, limit=2))
    outputs = _run(llm, [[SYSTEM, first, second, "Question: which module?\nAnswer:"],
                         [SYSTEM, second, first, "Question: which class?\nAnswer:"]])
    stats = llm.stats()
    assert outputs[0].num_chunk_hit_tokens == 0 and outputs[1].num_chunk_hit_tokens > 0
    assert stats["chunk_cache_hits"] == outputs[1].num_chunk_hit_tokens and stats["chunk_tokens_recomputed"] == 0
    assert stats["prompt_tokens_total"] == (stats["prefix_cache_hits"] + stats["chunk_cache_hits"]
                                            + stats["prompt_tokens_computed"])
    # The reordered prompt's KV is approximate from its first chunk on: none of it may serve
    # exact prefix hits.
    head = len(llm.get_tokenizer().encode(SYSTEM))
    assert llm.llm_engine.cached_prefix_len(outputs[1].prompt_token_ids) <= head


def test_a_prompt_that_ends_with_its_chunk_stores_it_for_reuse():
    """A warm-up's prompt is the system prompt and the chunk: the chunk is exported though it
    holds the prompt's last token (that segment is never imported: it must make logits)."""
    llm = LLM(**ENGINE, enable_chunk_reuse=True, chunk_recompute_fraction=0.0, chunk_recompute_window=0)
    first, second = (c.text + "\n" for c in stdlib_chunks(max_chars=400, limit=2))
    llm.warm([{"prompt_segments": [SYSTEM, first]}], use_tqdm=False)
    asked = _run(llm, [[SYSTEM, second, first, "Question: which module?\nAnswer:"]])[0]
    assert asked.num_chunk_hit_tokens == len(llm.get_tokenizer().encode(first, add_special_tokens=False))


def test_a_chunk_after_the_segment_it_was_computed_after_is_imported_whole():
    llm = LLM(**ENGINE, enable_chunk_reuse=True, chunk_recompute_fraction=0.5, chunk_recompute_window=0)
    first, second, third = (c.text + "\n" for c in stdlib_chunks(max_chars=400, limit=3))
    question = "Question: which module?\nAnswer:"
    _run(llm, [[SYSTEM, first, second, question]])
    # `first` now follows `third`, not the system prompt: half of it is computed again;
    # `second` follows `first` as when it was computed: imported whole.
    moved = _run(llm, [[SYSTEM, third, first, second, question]])[0]
    length = len(llm.get_tokenizer().encode(first, add_special_tokens=False))
    assert moved.num_recomputed_tokens == pytest.approx(length / 2, abs=2)
    assert moved.num_chunk_hit_tokens > length  # `second` came in too, none of it recomputed


def test_the_tokens_just_before_the_question_are_recomputed():
    llm = LLM(**ENGINE, enable_chunk_reuse=True, chunk_recompute_fraction=0.0, chunk_recompute_window=24)
    first, second = (c.text + "\n" for c in stdlib_chunks(max_chars=400, limit=2))
    _run(llm, [[SYSTEM, first, second, "Question: which module?\nAnswer:"]])
    moved = _run(llm, [[SYSTEM, second, first, "Question: which class?\nAnswer:"]])[0]
    assert moved.num_recomputed_tokens == 24  # the end of `first`, now just before the question
    assert moved.num_chunk_hit_tokens > 24


def test_the_question_window_reaches_back_over_short_chunks():
    """The window's tokens are counted from the question back, across chunk boundaries, on
    top of what the strategy picks and never twice."""
    cache = SimpleNamespace(question_window=10)
    marked = ChunkCache._with_question_window(cache, [Recompute(0, 8, 2), Recompute(8, 14, 0)])
    assert marked == [Recompute(0, 8, 2, 4), Recompute(8, 14, 0, 6)]
    assert first_tokens(marked) == [0, 1, 4, 5, 6, 7, *range(8, 14)]


def test_chunk_reuse_survives_preemption_and_aborts():
    llm = LLM(max_model_len=1024, num_gpu_blocks_override=120, enable_chunk_reuse=True, max_num_seqs=8)
    engine = llm.llm_engine
    prompts = _prompts(8, seed=1)
    for number, prompt in enumerate(prompts):
        engine.add_request(str(number), {"prompt_segments": prompt}, SamplingParams(temperature=0, max_tokens=24))
    engine.step()
    engine.abort_request("3")
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert all(output.error is None for output in finished.values())
    engine.kv.pool.check_invariants()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_requests_admitted_together_share_the_prefix_they_compute():
    llm = LLM(**ENGINE)
    shared = " ".join(c.text for c in stdlib_chunks(limit=3))
    prompts = [f"{shared}\nQuestion {i}: summarize." for i in range(4)]
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    llm.reset_prefix_cache()
    together = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert together[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= len(llm.get_tokenizer().encode(shared)) - 16 for o in together[1:])


def test_requests_admitted_together_import_the_chunks_another_computes():
    """A request whose chunk another request computes now waits a step and imports it: the
    batch computes no more than the same prompts run one at a time."""
    prompts = _prompts()
    one_by_one = LLM(**ENGINE, enable_chunk_reuse=True, chunk_recompute_window=0)
    _run(one_by_one, prompts)
    together = LLM(**ENGINE, enable_chunk_reuse=True, chunk_recompute_window=0)
    outputs = together.generate([{"prompt_segments": p} for p in prompts], GREEDY, use_tqdm=False)
    assert together.stats()["prompt_tokens_computed"] <= one_by_one.stats()["prompt_tokens_computed"]
    assert sum(o.num_chunk_hit_tokens > 0 for o in outputs) >= len(prompts) // 2


def test_rotating_a_key_moves_it_to_its_new_position():
    llm = LLM(max_model_len=512, kv_cache_memory_bytes=64 << 20)
    model = llm.llm_engine.runner.model
    rotary, head_dim = model.model.rotary, model.head_dim
    keys, queries = torch.randn(5, 2 * head_dim), torch.randn(5, 2 * head_dim)
    positions, deltas = torch.tensor([3, 10, 50, 100, 7]), torch.tensor([40, -5, 300, 1, 0])
    _, at_old = reference.rotary_embedding(queries, keys, positions, rotary.cos_sin_cache, head_dim)
    _, at_new = reference.rotary_embedding(queries, keys, positions + deltas, rotary.cos_sin_cache, head_dim)
    moved = rotate_keys(at_old.view(5, 2, head_dim), deltas, rotary.inv_freq)
    torch.testing.assert_close(moved, at_new.view(5, 2, head_dim), atol=1e-4, rtol=1e-4)


def test_canonical_segments_are_the_prompt_tokens(exact):
    llm, _ = exact
    canonicalizer = PromptCanonicalizer("Be brief.", tokenizer=llm.get_tokenizer(),
                                        chunk_template=REUSABLE_CHUNK_TEMPLATE)
    chunks = [(c.source_id, c.text) for c in stdlib_chunks(limit=4)]
    prompt = canonicalizer.build("What is argparse?", chunks, volatile={"date": "2026-12-01"})
    assert [t for segment in prompt.segments for t in segment["token_ids"]] == prompt.token_ids
    assert [segment["reusable"] for segment in prompt.segments] == [False, True, True, True, True, False]


@pytest.mark.parametrize("bad, message", [
    ([], "non-empty list"),
    ("text", "non-empty list"),
    ([{"token_ids": "abc"}], "token-id list"),
    ([{"text": "a", "token_ids": [1]}], "exactly one"),
    ([{"text": "a", "reusable": "yes"}], "true or false"),
    (["a", [1, "x"]], "prompt_segments\\[1\\]"),
    ([3.5], "prompt_segments\\[0\\]"),
])
def test_malformed_segments_are_refused_by_name(exact, bad, message):
    llm, _ = exact
    with pytest.raises((ValueError, TypeError), match=message):
        llm.generate({"prompt_segments": bad}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="not both"):
        llm.generate({"prompt_segments": ["a"], "prompt": "a"}, GREEDY, use_tqdm=False)
