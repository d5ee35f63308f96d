"""A request fails alone: what a step raises is traced to its request, the others go on
with exactly the tokens they would have had, and only a broken device kills the engine."""

from __future__ import annotations

import pytest

from pagedrag import LLM, SamplingParams
from pagedrag.engine.recovery import MAX_CONSECUTIVE_FAILED_STEPS, EngineDeadError
from model_fixtures import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[3 + (7 * i + j) % 200 for j in range(20 + 9 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def llm(request, path):
    return LLM(path, max_model_len=256, block_size=8, async_scheduling=request.param, seed=0)


def _tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def _poison_when(attribute: str, owner, is_poisoned) -> None:
    """Make ``owner.attribute`` raise whenever its call involves a poisoned request."""
    real = getattr(owner, attribute)

    def poisoned(*args, **kwargs):
        if is_poisoned(*args):
            raise RuntimeError("poisoned")
        return real(*args, **kwargs)

    setattr(owner, attribute, poisoned)


def _is_salted(request) -> bool:
    return request.cache_salt == "poison"


def _run(llm, poisoned_index: int | None):
    prompts = [{"prompt_token_ids": p, **({"cache_salt": "poison"} if i == poisoned_index else {})}
               for i, p in enumerate(PROMPTS)]
    return llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("poisoned_index", [0, 2])
def test_forward_failure_fails_only_the_traced_request(llm, poisoned_index):
    """The batched forward pass raises while the poisoned request is in it: the others run
    solo once (probation), then on together, with unchanged tokens."""
    expected = _tokens(_run(llm, None))
    engine = llm.llm_engine
    _poison_when("execute", engine.runner,
                 lambda step, *rest: any(_is_salted(item.request) for item in step.scheduled))
    outputs = _run(llm, poisoned_index)
    for index, output in enumerate(outputs):
        if index == poisoned_index:
            assert output.finished and "poisoned" in output.error
            assert output.outputs[0].finish_reason == "abort"
        else:
            assert output.error is None and output.outputs[0].token_ids == expected[index]
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    assert not engine.probation


def test_per_request_failure_is_traced_without_probation(llm):
    """An error in one request's own bookkeeping (its block hashes) fails it at once."""
    expected = _tokens(_run(llm, None))
    engine = llm.llm_engine
    _poison_when("cache_blocks", engine.kv, _is_salted)
    outputs = _run(llm, 1)
    assert "poisoned" in outputs[1].error
    assert [t for i, t in enumerate(_tokens(outputs)) if i != 1] == [t for i, t in enumerate(expected) if i != 1]


def test_device_failure_kills_the_engine(llm):
    engine = llm.llm_engine

    def broken(*args):
        raise RuntimeError("CUDA error: device-side assert triggered")

    engine.runner.execute = broken
    with pytest.raises(EngineDeadError, match="device failed"):
        _run(llm, None)


def test_model_that_always_fails_is_dead_after_a_bounded_number_of_steps(llm):
    engine = llm.llm_engine

    def broken(*args):
        raise RuntimeError("the model is broken")

    engine.runner.execute = broken
    prompts = [{"prompt_token_ids": [5 + i]} for i in range(MAX_CONSECUTIVE_FAILED_STEPS + 4)]
    with pytest.raises(EngineDeadError, match="in a row failed"):
        llm.generate(prompts, GREEDY, use_tqdm=False)


def test_bad_input_is_refused_before_any_step(llm):
    """Each of these used to fail a whole step (or the server); now add_request refuses it."""
    engine = llm.llm_engine
    cases = [
        ({"prompt_token_ids": [5]}, SamplingParams(min_tokens=3, max_tokens=5, stop_token_ids=[10**9])),
        ({"prompt_token_ids": [5]}, SamplingParams(stop_token_ids=[-1])),
        ({"prompt_token_ids": [5]}, SamplingParams(n=10**5)),
        ({"prompt_token_ids": [5], "cache_salt": "\ud800"}, GREEDY),
        ({"prompt_token_ids": [True, False]}, GREEDY),
        ("x" * (engine.inputs.max_prompt_chars + 1), GREEDY),
    ]
    for prompt, params in cases:
        with pytest.raises((ValueError, TypeError)):
            engine.add_request(None, prompt, params)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("bad", [
    dict(n=2, seed=2**64 - 1), dict(temperature=float("nan")), dict(max_tokens="10"), dict(ignore_eos="yes"),
    dict(n=True), dict(stop=["x"] * 65), dict(stop=["x" * 1025]), dict(stop=["\udc80"]),
    dict(min_tokens=5, max_tokens=2), dict(logprobs=21), dict(stop_token_ids=[1.5]),
])
def test_sampling_params_refuse_bad_values(bad):
    with pytest.raises((ValueError, TypeError)):
        SamplingParams(**bad)


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-40).temperature == 0
    assert SamplingParams(temperature=1e-3).temperature == pytest.approx(1e-2)
