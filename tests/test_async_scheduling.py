"""Asynchronous scheduling (a step's tokens read back during the next step) changes
when outputs arrive, never what they are: every sampling feature gives the same
tokens, text and logprobs as synchronous scheduling, stops drop the extra token,
and aborting a request whose token is in flight loses nothing of the others."""

import pytest

from pagedrag import LLM, SamplingParams
from model_fixtures import make_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def engine(path, async_scheduling: bool) -> LLM:
    return LLM(path, max_model_len=256, block_size=8, num_gpu_blocks_override=64,
               dtype="float32", max_num_seqs=8, async_scheduling=async_scheduling)


PROMPTS = ["hello there", "the quick brown fox", "abc" * 9, "paged attention", "x"]


def mixed_params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, n=2, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=6, min_tokens=4, logprobs=2, stop=["a"]),
        SamplingParams(temperature=0, max_tokens=1),
    ]


def summary(outputs) -> list:
    """Tokens, text and finish reason exactly; logprobs to 4 places (the batches of the two
    modes differ in shape, so float sums may differ in the last bits)."""
    return [[(c.token_ids, c.text, c.finish_reason, round(c.cumulative_logprob, 4)) for c in o.outputs]
            for o in outputs]


def test_async_matches_sync_for_every_sampling_feature(tiny_path):
    sync, overlapped = engine(tiny_path, False), engine(tiny_path, True)
    greedy = sync.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=9), use_tqdm=False)
    params = mixed_params(stop_token=greedy[0].outputs[0].token_ids[4])
    expected = summary(sync.generate(PROMPTS, params, use_tqdm=False))
    got = summary(overlapped.generate(PROMPTS, params, use_tqdm=False))
    assert got == expected
    assert expected[0][0][2] == "stop" and len(expected[0][0][0]) < 9  # the stop token ended it early
    for llm in (sync, overlapped):
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def test_abort_with_a_token_in_flight_keeps_the_others(tiny_path):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = summary(engine(tiny_path, False).generate(PROMPTS[:3], params, use_tqdm=False))
    llm = engine(tiny_path, True)
    core = llm.llm_engine
    for i, prompt in enumerate(PROMPTS[:3]):
        core.add_request(str(i), prompt, params)
    finished = {}
    for _ in range(3):
        finished.update((o.request_id, o) for o in core.step() if o.finished)
    assert core._inflight is not None  # request "1" has a sampled token on its way back
    assert [r.num_inflight_tokens for r in core._inflight.requests] == [1, 1, 1]
    core.abort_request("1")
    while core.has_unfinished_requests():
        finished.update((o.request_id, o) for o in core.step() if o.finished)
    assert sorted(finished) == ["0", "2"]
    assert summary([finished["0"], finished["2"]]) == [expected[0], expected[2]]
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    core.kv.pool.check_invariants()


def test_no_step_is_spent_past_a_known_last_token(tiny_path):
    """max_tokens (and max_model_len) are known before the token is read back: the request
    is not scheduled again, so one prefill is the whole work of a one-token request."""
    llm = engine(tiny_path, True)
    runner = llm.llm_engine.runner
    launched = []
    execute = runner.execute
    runner.execute = lambda step, *rest: launched.append(step.num_tokens) or execute(step, *rest)
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1
    assert [n for n in launched if n] == [len(out.prompt_token_ids)]
    launched.clear()
    llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [n for n in launched if n] == [len(out.prompt_token_ids), 1, 1, 1]  # prefill, 3 decodes
