"""Chunk reuse against hostile input: the engine arguments, prompt_segments with empty
segments, prompt_chunks in any order, chunks with prompts that have no text to cut, the
server's pagedrag fields on the wrong route, and a tight pool under concurrent requests,
aborts and preemption (the pool comes back whole, the counters add up, and with every reused
token recomputed the outputs are a plain engine's), prompts cut by chunk reuse (tokenized as
without it), and a prefix hit that ends inside a cached chunk.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from model_fixtures import make_tiny_model, tiny_config
from pagedrag import LLM, SamplingParams
from pagedrag.client import connect
from pagedrag.config import EngineArgs
from pagedrag.engine.inputs import InputProcessor
from pagedrag.engine.segments import chunk_pieces, text_segments, token_segments
from pagedrag.rag.tokenizer import load_tokenizer
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
    empty head leaves the first chunk as the head). The reordered prompt reuses the chunks:
    imported, or, when an earlier layout built the same prompt, its blended blocks."""
    names = {"S": SYSTEM, "A": CHUNKS[0], "B": CHUNKS[1], "C": CHUNKS[2], "Q": "Question: which module?\nAnswer:"}
    segments = [names.get(item, item) if isinstance(item, str) else item for item in layout]
    blended_before = reuse.llm_engine.stats()["blended_prefix_hits"]
    for order in (segments, segments[:-3] + [segments[-2], segments[-3], segments[-1]]):  # then reordered: imported
        output = reuse.generate({"prompt_segments": order}, GREEDY, use_tqdm=False)[0]
        assert output.error is None and output.outputs[0].finish_reason == "length"
    blended = reuse.llm_engine.stats()["blended_prefix_hits"] - blended_before
    assert output.num_chunk_hit_tokens + output.num_recomputed_tokens + blended > 0
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


# ---- prompts cut by chunk reuse ------------------------------------------------------------
def test_cuts_move_to_the_next_token_boundary():
    """Offsets of "HHAAAABBQQ" tokenized as <bos> "HHA" "AAA" and a character split in two
    tokens ("B" "B", both at 6-7) then "BQQ": a cut moves forward to the first boundary at or
    after it, never between the halves of a character; a piece left without tokens merges
    into the one before it (reusable only if both are); an empty head leaves no segment."""
    offsets = [(0, 0), (0, 3), (3, 6), (6, 7), (6, 7), (7, 10)]
    def cut(*pieces):
        return token_segments(offsets, [{"text": text, "reusable": reusable} for text, reusable in pieces])
    assert cut(("HH", False), ("AAAA", True), ("BB", True), ("QQ", False)) == \
        [(0, 2, False), (2, 3, True), (3, 6, False)]
    assert cut(("HH", False), ("AAAAB", True), ("BQQ", False)) == [(0, 2, False), (2, 5, True), (5, 6, False)]
    assert cut(("HH", False), ("AAAAB", True), ("B", True), ("QQ", False)) == \
        [(0, 2, False), (2, 5, True), (5, 6, False)]
    assert cut(("", False), ("HHAAAA", True), ("BBQQ", False)) == [(0, 3, True), (3, 6, False)]


def _documents(count: int = 4) -> list[str]:
    return [c.text.strip() for c in stdlib_chunks(max_chars=300, limit=count)]


def _cut_prompts() -> tuple[list[str], list[list[dict]]]:
    """Text prompts and chats whose documents are separated by blank lines."""
    docs = _documents()
    texts = [f"Use the context to answer.\n\n{docs[i]}\n\n{docs[(i + 1) % 4]}\n\nQuestion {i}: which module?\nAnswer:"
             for i in range(2)] + ["Hi\n\n\n \n\n x\n\n\u00e9\t\n\n\U0001f642\n\nThere\n"]
    chats = [[{"role": "user", "content": f"{docs[i]}\n\n{docs[(i + 2) % 4]}\n\nWhich module is it?"}] for i in range(2)]
    chats.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  spaced\n\n\n\nx"}])
    return texts, chats


def test_chunk_reuse_tokenizes_a_prompt_as_the_exact_path_does():
    """Cut after each blank line and each piece tokenized alone, "x\\n\\n" became one token
    where the whole text has two, and the chat template's head merged differently with the
    content: other token ids, other answers. Now the token ids are the exact path's, the
    segments cover them at token boundaries, and each document is a reusable segment."""
    tokenizer = load_tokenizer()
    exact = InputProcessor(tokenizer, len(tokenizer), 4096, 8)
    cut = exact.copy()
    cut.segment_prompts = True
    texts, chats = _cut_prompts()
    rng = random.Random(0)
    pieces = ["word", " ", "\n", "\n\n", "\n\n\n", " \n\n ", "\t", "\u00e9", "e\u0301", "\U0001f642", "\u65e5\u672c"]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(150)]
    chats += [[{"role": "user", "content": text}] for text in texts[-150:]]
    prompts = [(exact.process(text), cut.process(text)) for text in texts]
    prompts += [(exact.render_chat(chat), cut.render_chat(chat)) for chat in chats]
    for whole, segmented in prompts:
        assert segmented.token_ids == whole.token_ids
        assert segmented.segments[0].start == 0 and segmented.segments[-1].end == len(whole.token_ids)
        assert all(a.end == b.start for a, b in zip(segmented.segments, segmented.segments[1:]))
        assert all(segment.start < segment.end for segment in segmented.segments)
    docs = _documents()
    reusable = [tokenizer.decode(prompts[0][1].token_ids[s.start:s.end]) for s in prompts[0][1].segments if s.reusable]
    assert reusable == [docs[0] + "\n\n", docs[1] + "\n\n"]
    chat = prompts[len(texts)][1]
    assert [tokenizer.decode(chat.token_ids[s.start:s.end]) for s in chat.segments if s.reusable] == \
        [docs[0] + "\n\n", docs[2] + "\n\n"]


@pytest.fixture(scope="module")
def tiny_smol(tmp_path_factory) -> str:
    """A tiny random Llama with the embedded model's tokenizer, whose merges (blank lines,
    spaces) are what a cut can split."""
    tokenizer = load_tokenizer()
    path = tmp_path_factory.mktemp("tiny-smol")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", len(tokenizer))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_chunk_reuse_with_nothing_cached_answers_as_the_exact_engine(tiny_smol):
    """Nothing to reuse (the cache emptied before each prompt): the prompt's token ids and the
    greedy answer are the exact engine's, for text prompts and chats."""
    texts, chats = _cut_prompts()
    params = SamplingParams(temperature=0, max_tokens=8)
    results = []
    for kwargs in ({}, {"enable_chunk_reuse": True}):
        llm = LLM(tiny_smol, max_model_len=512, num_gpu_blocks_override=64, dtype="float32", **kwargs)
        outputs = []
        for run, prompt in [(llm.generate, text) for text in texts] + [(llm.chat, chat) for chat in chats]:
            llm.reset_prefix_cache()
            outputs.append(run(prompt, params, use_tqdm=False)[0])
        assert all(o.num_chunk_hit_tokens == 0 and o.num_cached_tokens == 0 for o in outputs)
        results.append([(o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs])
    assert results[0] == results[1]


# ---- a prefix hit that ends inside a chunk -----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("llama"), "llama"))


@pytest.mark.parametrize("head_length, kept_prefix", [(15, 0), (20, 16)])
def test_a_prefix_hit_ending_inside_a_cached_chunk_is_cut_back(tiny_path, head_length, kept_prefix):
    """Every chunk begins with the same tag, so a later prompt that puts a cached chunk right
    after the head has a prefix hit that ends inside it: the chunk was skipped and computed
    again. The hit is now cut back to the block boundary at or before the chunk (one token per
    byte here, 16 per block), the chunk imported, and only the hits kept are counted."""
    llm = LLM(tiny_path, max_model_len=512, block_size=16, num_gpu_blocks_override=64, dtype="float32",
              enable_chunk_reuse=True, chunk_recompute_fraction=0.0, chunk_recompute_window=0)
    head = "h" * head_length
    docs = [f'<document source="{k}">Document {k} says {"abcd"[k] * 40}.</document>\n' for k in range(3)]
    run = lambda segments: llm.generate({"prompt_segments": segments}, GREEDY, use_tqdm=False)[0]
    run([head, *docs, "Question one?"])
    moved = run([head, docs[1], {"text": "Fresh filler text, not cached anywhere at all.\n", "reusable": False}, "Q?"])
    assert moved.num_cached_tokens == kept_prefix
    assert moved.num_chunk_hit_tokens == len(docs[1])
    stats = llm.stats()
    assert stats["prefix_cache_hits"] == kept_prefix
    assert stats["prompt_tokens_total"] == (stats["prefix_cache_hits"] + stats["chunk_cache_hits"]
                                            + stats["prompt_tokens_computed"])
    _pool_is_whole(llm)


def test_a_prefix_hit_is_kept_when_the_chunk_would_be_computed_anyway(tiny_path):
    """With every imported token recomputed, cutting the prefix hit back saves nothing: it stays."""
    llm = LLM(tiny_path, max_model_len=512, block_size=16, num_gpu_blocks_override=64, dtype="float32",
              enable_chunk_reuse=True, chunk_recompute_fraction=1.0)
    docs = [f'<document source="{k}">Document {k} says {"abcd"[k] * 40}.</document>\n' for k in range(2)]
    llm.generate({"prompt_segments": ["h" * 15, *docs, "Q1?"]}, GREEDY, use_tqdm=False)
    moved = llm.generate({"prompt_segments": ["h" * 15, docs[1], "Q2?"]}, GREEDY, use_tqdm=False)[0]
    # the head and the tag's first 17 bytes: two blocks, the second ending inside the chunk
    assert moved.num_cached_tokens == 32 and moved.num_chunk_hit_tokens == 0 and moved.num_recomputed_tokens == 0
