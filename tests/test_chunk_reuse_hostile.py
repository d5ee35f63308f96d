"""Chunk reuse against hostile input: the engine arguments, prompt_segments with empty
segments, prompt_chunks in any order, chunks with prompts that have no text to cut, the
server's pagedrag fields on the wrong route, and a tight pool under concurrent requests,
aborts and preemption (the pool comes back whole, the counters add up, and with every reused
token recomputed the outputs are a plain engine's).
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from pagedrag import LLM, SamplingParams
from pagedrag.client import connect
from pagedrag.config import EngineArgs
from pagedrag.engine.segments import chunk_pieces, text_segments
from pagedrag.rag.corpus import stdlib_chunks
from pagedrag.server.app import build_app
from pagedrag.server.background import BackgroundServer
from pagedrag.server.serving import ServerConfig

TIGHT = {"max_model_len": 512, "num_gpu_blocks_override": 33, "max_num_seqs": 8}  # 32 blocks hold one sequence
GREEDY = SamplingParams(temperature=0, max_tokens=4)
SYSTEM = "You answer from the documents below.\n"
CHUNKS = [c.text + "\n" for c in stdlib_chunks(max_chars=300, limit=4)]  # each well over one block


@pytest.fixture(scope="module")
def reuse() -> LLM:
    return LLM(max_model_len=512, num_gpu_blocks_override=96, max_num_seqs=8, enable_chunk_reuse=True)


def _pool_is_whole(llm: LLM) -> None:
    pool = llm.llm_engine.kv.pool
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks


# ---- engine arguments ------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    {"chunk_recompute_fraction": -0.1}, {"chunk_recompute_fraction": 1.5},
    {"chunk_recompute_fraction": float("nan")}, {"chunk_recompute_fraction": "0.5"},
    {"chunk_recompute_fraction": True}, {"chunk_recompute_fraction": None},
    {"chunk_recompute_strategy": "FIRST"}, {"chunk_recompute_strategy": None},
    {"chunk_recompute_window": -1}, {"chunk_recompute_window": 1.5}, {"chunk_recompute_window": True},
    {"enable_chunk_reuse": "no"}, {"enable_chunk_reuse": 1},
])
def test_bad_chunk_reuse_arguments_are_refused_by_name(bad):
    """A string or a bool is no fraction, and "no" must not switch chunk reuse on."""
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineArgs(**{"enable_chunk_reuse": True, **bad})


# ---- where the chunks are ----------------------------------------------------------------
def test_chunks_are_found_in_any_order():
    """Chunks given out of the prompt's order, twice, overlapping, empty or absent: each
    found one is a reusable piece, in the prompt's order, and the pieces are the text."""
    text = "H|AAA|BBB|AAA|Q"
    assert chunk_pieces(text, ["BBB", "AAA", "AAA", "AAA"]) == [
        ("H|", False), ("AAA", True), ("|", False), ("BBB", True), ("|", False), ("AAA", True), ("|Q", False)]
    assert chunk_pieces(text, ["AA|B", "A|BB", "", "zzz"]) == [("H|A", False), ("AA|B", True), ("BB|AAA|Q", False)]
    segments = text_segments(text, ["BBB", "AAA"])
    assert "".join(s["text"] for s in segments) == text
    assert [s["text"] for s in segments if s["reusable"]] == ["AAA", "BBB"]
    big = "a" * 100_000
    assert len(chunk_pieces(big, [big[5:]] + ["a"] * 255)) == 6  # one scan of the text per chunk


# ---- prompt_segments ----------------------------------------------------------------------
@pytest.mark.parametrize("layout", [
    ["", "A", "B", "C", "Q"], ["S", "", "A", "B", "C", "Q"], ["S", [], "A", "B", "C", "Q"],
    [{"text": ""}, "A", "B", "C", "Q"]])
def test_empty_segments_are_left_out(reuse, layout):
    """An empty segment before a reusable chunk failed the request in a step (IndexError in
    the chunk cache) and leaked the chunk's export blocks; it adds nothing to the prompt (an
    empty head leaves the first chunk as the head)."""
    names = {"S": SYSTEM, "A": CHUNKS[0], "B": CHUNKS[1], "C": CHUNKS[2], "Q": "Question: which module?\nAnswer:"}
    segments = [names.get(item, item) if isinstance(item, str) else item for item in layout]
    for order in (segments, segments[:-3] + [segments[-2], segments[-3], segments[-1]]):  # then reordered: imported
        output = reuse.generate({"prompt_segments": order}, GREEDY, use_tqdm=False)[0]
        assert output.error is None and output.outputs[0].finish_reason == "length"
    assert output.num_chunk_hit_tokens + output.num_recomputed_tokens > 0
    _pool_is_whole(reuse)


def test_chunks_need_a_text_prompt(reuse):
    inputs = reuse.llm_engine.inputs
    with pytest.raises(ValueError, match="prompt_chunks"):
        inputs.process([1, 2, 3], chunks=["x"])
    with pytest.raises(ValueError, match="prompt_chunks"):
        inputs.process({"prompt_segments": ["a", "x"]}, chunks=["x"])
    assert inputs.process("a x", chunks=["x"]).segments  # a text prompt is cut


def test_a_text_prompt_dict_keeps_its_key_check(reuse):
    """With chunk reuse a text prompt dict is cut into segments: its unknown keys were dropped
    unseen, where an engine without chunk reuse refuses them."""
    with pytest.raises(ValueError, match="unknown prompt keys"):
        reuse.generate({"prompt": "Hi", "multi_modal_data": {"image": None}}, GREEDY, use_tqdm=False)
    salted = reuse.llm_engine.inputs.process({"prompt": "Hi\n\nthere", "cache_salt": "s"})
    assert salted.cache_salt == "s" and len(salted.segments) == 2


@pytest.mark.parametrize("bad, message", [
    ([""], "empty"), ([[], ""], "empty"), ([{"token_ids": []}], "empty"),
    ([[49152]], "outside the vocabulary"), ([[-1]], "outside the vocabulary"), ([[True]], "integer"),
    ([[1.0]], "integer"), ([{"text": "a", "reusable": None}], "true or false"), ([{"reusable": True}], "exactly one"),
    ([b"abc"], "prompt_segments\\[0\\]"), ([{"text": "a\udfff"}], "surrogate"), (["x"] * 4097, "at most 4096"),
    (["word " * 200] * 4, "max_model_len"),
])
def test_hostile_segments_fail_alone(reuse, bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        reuse.generate({"prompt_segments": bad}, GREEDY, use_tqdm=False)


# ---- the server ----------------------------------------------------------------------------
def test_server_refuses_what_it_would_ignore():
    """prompt_segments on a chat, and prompt_chunks with a token-id prompt or a chat template
    sent with the request, were ignored with a 200; now a 400 names them. An empty segment
    before a chunk is a 200."""
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.base_url + path, timeout=600, headers={"Content-Type": "application/json"},
                          content=json.dumps({"model": "smol", "max_tokens": 2, "temperature": 0, **body}))

    chat = [{"role": "user", "content": CHUNKS[0] + "Which module?"}]
    engine = connect(engine_kwargs={**TIGHT, "enable_chunk_reuse": True}).shared.engine
    config = ServerConfig(served_model_names=["smol"], trust_request_chat_template=True)
    with BackgroundServer(build_app(engine, config)) as server:
        refused = [post("/v1/chat/completions", {"messages": chat, "prompt_segments": [CHUNKS[0]]}),
                   post("/v1/chat/completions", {"messages": chat, "prompt_chunks": [CHUNKS[0]],
                                                 "chat_template": "{{ messages[0]['content'] }}"}),
                   post("/v1/completions", {"prompt": [1, 2, 3], "prompt_chunks": ["x"]}),
                   post("/v1/completions", {"prompt": [[1, 2], [3]], "prompt_chunks": ["x"]})]
        empty_head = post("/v1/completions", {"prompt_segments": ["", CHUNKS[2], CHUNKS[3], "Which?"]})
    for response in refused:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "prompt_" in error["message"]
    assert [r.json()["error"]["param"] for r in refused[:2]] == ["prompt_segments", "prompt_chunks"]
    assert empty_head.status_code == 200, empty_head.text


# ---- a tight pool -------------------------------------------------------------------------
def _stream_of_prompts(count: int, seed: int) -> list[list]:
    rng = random.Random(seed)
    return [[SYSTEM, *rng.sample(CHUNKS, rng.randint(2, 4)), "", f"Question {i}?\nAnswer:"] for i in range(count)]


def _drive(llm: LLM, prompts: list[list], abort: tuple[str, ...] = ()) -> dict:
    engine, params = llm.llm_engine, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for number, prompt in enumerate(prompts):
        engine.add_request(str(number), {"prompt_segments": prompt}, params)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
        if steps == 3:
            for request_id in abort:
                engine.abort_request(request_id)
    return finished


def test_tight_pool_with_aborts_recomputing_everything_is_exact():
    """Shared chunks in varied order, two aborts, a pool of one sequence's blocks: every other
    request finishes with the plain engine's tokens, the counters add up, the pool is whole."""
    prompts = _stream_of_prompts(10, seed=3)
    plain = _drive(LLM(**TIGHT), prompts)
    llm = LLM(**TIGHT, enable_chunk_reuse=True, chunk_recompute_fraction=1.0)
    reused = _drive(llm, prompts, abort=("4", "7"))
    assert set(reused) == set(plain) - {"4", "7"}
    assert all(o.error is None for o in reused.values())
    assert {k: o.outputs[0].token_ids for k, o in reused.items()} == \
        {k: plain[k].outputs[0].token_ids for k in reused}
    stats = llm.stats()
    assert stats["chunk_tokens_recomputed"] > 0
    assert stats["prompt_tokens_total"] == (stats["prefix_cache_hits"] + stats["chunk_cache_hits"]
                                            + stats["prompt_tokens_computed"])
    _pool_is_whole(llm)
