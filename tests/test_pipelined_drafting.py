"""Pipelined drafting (engine.pipelined_drafting): with asynchronous scheduling and ngram, a
batch of greedy requests drafts and verifies on the device, each step launched before the
previous one's results are read. Greedy output stays HF's token for token through stops,
max_tokens, aborts, arrivals, a short pool, max_model_len and a batch that cannot pipeline; the
device lookup finds what the host's NgramIndex finds."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from model_fixtures import hf_greedy, make_tiny_model
from pagedrag import LLM, SamplingParams
from pagedrag.spec_decode.device_ngram import ngram_drafts
from pagedrag.spec_decode.ngram import NgramIndex
from pagedrag.worker.pipelined_verification import DeviceDraftRows

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
MAX_NEW = 40


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    phrase = torch.randint(3, 250, (9,), generator=generator).tolist()
    other = torch.randint(3, 250, (5,), generator=generator).tolist()
    return [phrase * 4, (other + phrase) * 3, torch.randint(3, 250, (30,), generator=generator).tolist()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("pipelined"), "llama")
    references = hf_greedy(path, prompts(), MAX_NEW)
    return path, references


@pytest.fixture(scope="module")
def engines(tiny):
    """(pipelined engine, the same engine without speculation) and a count of pipelined launches."""
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", speculative_config=NGRAM, async_scheduling=True,
              num_gpu_blocks_override=256)
    launches = []
    real = llm.llm_engine.pipeline.launch
    def counted(scheduler):
        results = real(scheduler)
        launches.append(results is not None)
        return results
    llm.llm_engine.pipeline.launch = counted
    return llm, LLM(str(path), dtype="float32", num_gpu_blocks_override=256), launches


def generate(llm, prompt_list, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompt_list], params, use_tqdm=False)


def assert_all_free(llm) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    llm.llm_engine.kv.pool.check_invariants()


def test_greedy_equals_hf_alone_and_in_a_batch(tiny, engines):
    _, references = tiny
    llm, _, launches = engines
    launches.clear()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = generate(llm, prompts(), params)
    assert [o.outputs[0].token_ids for o in outputs] == references
    assert [o.outputs[0].token_ids for o in generate(llm, prompts()[:1], params)] == references[:1]
    assert sum(launches) > MAX_NEW // 2  # most steps ran pipelined
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["spec_decode_mean_acceptance_length"] > 1
    assert outputs[0].spec_decode.num_accepted_tokens > 0
    assert_all_free(llm)


def test_stops_and_lengths_end_where_decoding_ends(engines):
    """A stop token, a stop string and max_tokens inside a pipelined run: the step computed past
    them is dropped; text, tokens and finish reasons are those of decoding without speculation."""
    llm, plain, launches = engines
    reference = generate(plain, prompts()[:2], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    stop_token = reference[0].outputs[0].token_ids[17]
    stop_text = plain.get_tokenizer().decode(reference[1].outputs[0].token_ids[20:22])
    cases = [dict(stop_token_ids=[stop_token]), dict(stop=[stop_text]), dict(max_tokens=1), dict(max_tokens=13)]
    launches.clear()
    for case in cases:
        params = SamplingParams(**{"temperature": 0, "max_tokens": MAX_NEW, **case})
        for want, got in zip(generate(plain, prompts()[:2], params), generate(llm, prompts()[:2], params)):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, case
            assert got.outputs[0].text == want.outputs[0].text
            assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
            assert got.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-3)
    assert any(launches)
    assert_all_free(llm)


def test_abort_and_arrival_mid_pipeline(tiny, engines):
    """An abort, then a new request, while the pipeline runs: each drains it, and every
    remaining request still emits HF's tokens."""
    _, references = tiny
    llm, _, launches = engines
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first, second, third = prompts()
    launches.clear()
    for request_id, prompt in (("a", first), ("b", second)):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finals = {}
    for _ in range(6):
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.pipeline.active  # pipelined when the abort comes
    aborted = engine.abort_request("b")
    engine.add_request("c", {"prompt_token_ids": third}, params)
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finals["a"].outputs[0].token_ids == references[0]
    assert finals["c"].outputs[0].token_ids == references[2]
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort" and "b" not in finals
    assert any(launches)
    assert_all_free(llm)


def test_a_batch_that_cannot_pipeline_runs_as_before(engines):
    """A seeded sampled request beside greedy ones (and logprobs asked for): nothing pipelines,
    and the outputs are those of the engine without speculation."""
    llm, plain, launches = engines
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0.8, seed=3, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24, logprobs=2)]
    launches.clear()
    expected = generate(plain, prompts(), params)
    actual = generate(llm, prompts(), params)
    assert [o.outputs[0].token_ids for o in actual] == [o.outputs[0].token_ids for o in expected]
    assert not launches[:3] or not launches[0]  # the first steps run as ordinary ones
    assert_all_free(llm)


@pytest.mark.parametrize("n", [2, 3])
def test_greedy_siblings_share_the_prompt_block_and_stay_exact(engines, n):
    """n > 1 greedy siblings share the prompt's partly filled last block: the reservation's
    copy-on-write runs before the first pipelined step, and each sibling emits what decoding
    without speculation emits (also what a later prompt then finds in the prefix cache)."""
    llm, plain, launches = engines
    prompt = prompts()[0][:33]  # not a multiple of the block size
    params = SamplingParams(temperature=0, n=n, max_tokens=MAX_NEW, ignore_eos=True)
    launches.clear()
    want = [c.token_ids for c in generate(plain, [prompt], params)[0].outputs]
    assert [c.token_ids for c in generate(llm, [prompt], params)[0].outputs] == want
    assert any(launches)
    follow_up = SamplingParams(temperature=0, max_tokens=8, speculative_decoding=False)
    longer = [prompt + want[0][:30]]
    assert generate(llm, longer, follow_up)[0].outputs[0].cumulative_logprob == \
        pytest.approx(generate(plain, longer, follow_up)[0].outputs[0].cumulative_logprob, abs=1e-4)
    assert_all_free(llm)


def test_rows_that_find_no_draft_run_plain_decode_steps(engines, monkeypatch):
    """A prompt that never repeats: once its lookups found nothing MISSES_TO_STOP times in a
    row, its steps check no drafted positions (width 0), so a request that copies nothing pays
    for none."""
    llm, plain, _ = engines
    widths = []
    real = DeviceDraftRows.launch
    def spy(self, limits, width, bound):
        widths.append(width)
        return real(self, limits, width, bound)
    monkeypatch.setattr(DeviceDraftRows, "launch", spy)
    prompt = torch.randperm(240, generator=torch.Generator().manual_seed(5))[:40].add(3).tolist()
    outputs = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert widths and 0 in widths
    assert outputs[0].outputs[0].token_ids == generate(plain, [prompt], SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].token_ids


@pytest.mark.parametrize("pool", [dict(num_gpu_blocks_override=14, block_size=8, max_model_len=96),
                                  dict(max_model_len=64, block_size=8)])
def test_a_short_pool_and_max_model_len_stay_exact(tiny, pool):
    """Where the pool lacks slots for two steps of drafts (the engine preempts as usual) or
    the context nears max_model_len, the pipeline drains and ordinary steps go on exactly."""
    path, references = tiny
    llm = LLM(str(path), dtype="float32", speculative_config=NGRAM, async_scheduling=True,
              enable_prefix_caching=False, **pool)
    limit = pool.get("max_model_len", 1 << 20)
    lengths = [min(MAX_NEW, limit - len(p)) for p in prompts()]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = generate(llm, prompts(), params)
    assert [o.outputs[0].token_ids for o in outputs] == [r[:n] for r, n in zip(references, lengths)]
    assert_all_free(llm)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=40), min_size=1, max_size=4),
       min_n=st.integers(1, 3), extra=st.integers(0, 3), k=st.integers(1, 8), padding=st.integers(0, 4))
def test_device_lookup_finds_what_the_index_finds(rows, min_n, extra, k, padding):
    width = max(map(len, rows)) + padding
    history = torch.full((len(rows), width), 3, dtype=torch.long)
    for row, tokens in enumerate(rows):
        history[row, :len(tokens)] = torch.tensor(tokens)
    drafts, lengths = ngram_drafts(history, torch.tensor([len(t) for t in rows]), min_n, min_n + extra, k)
    for row, tokens in enumerate(rows):
        index = NgramIndex(min_n, min_n + extra)
        index.extend(tokens)
        assert drafts[row, :lengths[row]].tolist() == index.continuation(k)
