"""Sampler: greedy, filtering, seeded reproducibility, penalties, logprobs."""

import gc

import pytest
import torch

from pagedrag.sampling_params import SamplingParams
from pagedrag.worker.token_tables import TokenTableCache
from pagedrag.worker.sampler import Sampler, SamplingBatch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 1000


def make_batch(params, device="cpu", generators=None, prompts=None, outputs=None, eos_token_ids=frozenset()):
    n = len(params)
    return SamplingBatch.from_params(
        params,
        generators or [None] * n,
        prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)],
        device,
        eos_token_ids,
    )


def random_logits(n, vocab=VOCAB, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=gen) * 3).to(device)


def sample(logits, params, mode="raw_logprobs", **kwargs):
    return Sampler(mode)(logits, make_batch(params, device=logits.device, **kwargs))


@pytest.mark.parametrize("device", DEVICES)
def test_all_greedy_is_argmax(device):
    logits = random_logits(8, device=device)
    out = sample(logits, [SamplingParams(temperature=0)] * 8)
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_exact_in_mixed_batch(device):
    logits = random_logits(6, device=device)
    params = [SamplingParams(temperature=0 if i % 2 else 1.5, top_k=5, top_p=0.5) for i in range(6)]
    out = sample(logits, params)
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=5.0, top_p=1e-6),
    SamplingParams(temperature=1.0, top_k=50, top_p=1e-9),
    SamplingParams(temperature=1.0, min_p=1.0),
], ids=["top_k=1", "tiny_top_p", "top_k_and_tiny_top_p", "min_p=1"])
def test_filters_that_leave_one_token_equal_greedy(device, params):
    logits = random_logits(16, device=device)
    out = sample(logits, [params] * 16)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_keeps_only_k_best():
    logits = random_logits(1).expand(4000, VOCAB)
    out = sample(logits, [SamplingParams(top_k=3)] * 4000)
    top3 = set(logits[0].topk(3).indices.tolist())
    assert set(out.token_ids.tolist()) == top3


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4000, 4)
    assert set(sample(logits, [SamplingParams(top_p=0.7)] * 4000).token_ids.tolist()) == {0, 1}
    assert set(sample(logits, [SamplingParams(top_p=0.85)] * 4000).token_ids.tolist()) == {0, 1, 2}


def test_top_p_applies_to_the_top_k_renormalised():
    # Top-2 renormalised: 0.625 / 0.375; p = 0.6 keeps only the best token.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(2000, 4)
    out = sample(logits, [SamplingParams(top_k=2, top_p=0.6)] * 2000)
    assert set(out.token_ids.tolist()) == {0}


def test_min_p_drops_tokens_below_fraction_of_max():
    logits = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log().expand(4000, 5)
    out = sample(logits, [SamplingParams(min_p=0.5)] * 4000)  # threshold 0.2
    assert set(out.token_ids.tolist()) == {0, 1}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sample_frequencies_follow_tempered_softmax(temperature):
    torch.manual_seed(1)
    raw = torch.tensor([1.0, 0.0, -0.5, -2.0])
    out = sample(raw.expand(20000, 4), [SamplingParams(temperature=temperature)] * 20000)
    freqs = torch.bincount(out.token_ids, minlength=4).float() / 20000
    assert torch.allclose(freqs, (raw / temperature).softmax(-1), atol=0.015)


def seeded_run(seed, neighbours, steps=5, position=0, device="cpu"):
    """Tokens a seeded row draws over several steps with the given batch neighbours."""
    gen = torch.Generator(device).manual_seed(seed)
    row = SamplingParams(temperature=1.3, top_k=200, top_p=0.95, seed=seed)
    params = neighbours[:position] + [row] + neighbours[position:]
    generators = [None] * len(params)
    generators[position] = gen
    tokens = []
    for step in range(steps):
        logits = random_logits(len(params), device=device, seed=100 + step)
        logits[position] = random_logits(1, device=device, seed=step)[0]
        outputs = [[1, 2, 3]] * len(params)
        out = sample(logits, params, generators=generators, prompts=[[4, 5]] * len(params), outputs=outputs)
        tokens.append(out.token_ids[position].item())
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_independent_of_batch(device):
    alone = seeded_run(7, [], device=device)
    crowds = [
        [SamplingParams(temperature=0)] * 3,
        [SamplingParams(temperature=0.7, min_p=0.1),
         SamplingParams(repetition_penalty=1.5, presence_penalty=1)],
        [SamplingParams(top_k=1, frequency_penalty=2, min_tokens=3, stop_token_ids=[9])] * 5,
    ]
    for i, crowd in enumerate(crowds):
        assert seeded_run(7, crowd, position=i % (len(crowd) + 1), device=device) == alone
    assert seeded_run(8, [], device=device) != alone


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25, logprobs=5)
    out = sample(logits, [params], "processed_logprobs", prompts=[[0]], outputs=[[1, 3, 3]])
    # token 0: in prompt, positive -> 2 / 2; token 1: output once -> -1 * 2 - 0.5 - 0.25;
    # token 3: output twice -> 3 / 2 - 2 * 0.5 - 0.25; tokens 2 and 4 untouched.
    expected = torch.tensor([1.0, -2.75, 0.5, 0.25, -2.0])
    assert out.token_ids.item() == 0
    got = dict(zip(out.top_token_ids[0].tolist(), out.top_logprobs[0].tolist()))
    want = expected.log_softmax(-1)
    assert all(abs(got[t] - want[t].item()) < 1e-6 for t in range(5))
    processed_logits = sample(logits, [params], "processed_logits", prompts=[[0]], outputs=[[1, 3, 3]])
    assert torch.allclose(processed_logits.top_logprobs[0], expected.sort(descending=True).values)
    raw = sample(logits, [params], prompts=[[0]], outputs=[[1, 3, 3]])  # the default: vLLM's raw_logprobs
    assert raw.token_ids.item() == 0 and torch.allclose(raw.top_logprobs[0], logits[0].log_softmax(-1).sort(
        descending=True).values)
    assert torch.equal(sample(logits, [params], "raw_logits").top_logprobs[0], logits[0].sort(descending=True).values)


def test_bias_comes_before_the_penalties_and_min_p_before_top_p():
    """vLLM's order: logit_bias, then the repetition penalty (which divides the biased logit);
    min-p filters before top-p's nucleus is taken."""
    logits = torch.tensor([[1.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={1: 2.0})
    # token 1 is in the prompt: (0 + 2) / 2 = 1.0 ties token 0 (penalised first, it would be 0 + 2)
    out = sample(logits, [params], "processed_logits", prompts=[[1]])
    assert out.logprobs.item() == pytest.approx(1.0)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = Sampler("processed_logprobs")(probs, make_batch([SamplingParams(top_p=0.83, min_p=0.2, logprobs=4)]))
    assert torch.isfinite(kept.top_logprobs[0]).sum().item() == 2  # min-p keeps 3, then top-p 2 of them


def test_penalties_leave_other_rows_bit_identical():
    logits = random_logits(2)
    params = [SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=1)]
    out = sample(logits, params, prompts=[[1, 2], [3]], outputs=[[4, 4], [5]])
    alone = sample(logits[:1], params[:1], prompts=[[1, 2]], outputs=[[4, 4]])
    assert torch.equal(out.top_logprobs[0], alone.top_logprobs[0])
    assert torch.equal(out.logprobs[0], alone.logprobs[0])
    processed = sample(logits, params, "processed_logprobs", prompts=[[1, 2], [3]], outputs=[[4, 4], [5]])
    assert not torch.equal(processed.logprobs[1], sample(logits[1:], params[:1], "processed_logprobs").logprobs[0])


def test_min_tokens_bans_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]] * 3)
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]),
              SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)]
    out = sample(logits, params, outputs=[[1], [1, 1], []], eos_token_ids=frozenset({2}))
    assert out.token_ids.tolist() == [1, 2, 2]
    assert out.logprobs[0].item() == pytest.approx(logits[0].log_softmax(-1)[1].item())  # raw: the bans aside


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_shapes_and_values(device):
    logits = random_logits(4, device=device)
    params = [SamplingParams(temperature=t, logprobs=k) for t, k in [(0, 2), (1.0, None), (3.0, 5), (0.5, 0)]]
    out = sample(logits, params)
    expected = logits.log_softmax(-1)  # before temperature, whatever the row's temperature
    assert out.token_ids.shape == out.logprobs.shape == (4,)
    assert out.top_token_ids.shape == out.top_logprobs.shape == (4, 5)
    assert torch.allclose(out.logprobs, expected.gather(1, out.token_ids[:, None])[:, 0], atol=1e-5)
    top = expected.topk(5)
    assert torch.equal(out.top_token_ids, top.indices)
    assert torch.allclose(out.top_logprobs, top.values, atol=1e-5)


def test_no_top_logprobs_when_none_asked():
    out = sample(random_logits(3), [SamplingParams(logprobs=0)] * 3)
    assert out.top_token_ids is None and out.top_logprobs is None
    assert out.logprobs.shape == (3,)


def test_to_host_gives_each_row_its_own_count():
    logits = random_logits(3)
    out = sample(logits, [SamplingParams(temperature=0, logprobs=k) for k in (2, 0, 4)])
    rows = out.to_host()
    expected = logits.log_softmax(-1)
    assert [r.token_id for r in rows] == logits.argmax(-1).tolist()
    assert [len(r.top_logprobs) for r in rows] == [2, 0, 4]
    for i, r in enumerate(rows):
        assert r.logprob == pytest.approx(expected[i, r.token_id].item(), abs=1e-5)
        assert list(r.top_logprobs) == expected[i].topk(len(r.top_logprobs)).indices.tolist()


def test_caller_logits_untouched():
    logits = random_logits(4)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                             frequency_penalty=0.5, presence_penalty=0.5,
                             min_tokens=5, stop_token_ids=[1])] * 4
    sample(logits, params, prompts=[[1, 2]] * 4, outputs=[[3]] * 4)
    assert torch.equal(logits, before)


def test_token_tables_are_made_once_per_params_object_and_dropped_with_it():
    cache = TokenTableCache()
    params = SamplingParams(logit_bias={5: 2.0, 7: -1.0}, allowed_token_ids=[5, 7, 9])
    tables = cache.get(params)
    assert cache.get(params) is tables
    assert tables.bias_ids.tolist() == [5, 7] and tables.bias_values.tolist() == [2.0, -1.0]
    assert tables.allowed_ids.tolist() == [5, 7, 9]
    assert cache.get(SamplingParams(logit_bias={5: 2.0})) is not tables  # equal or not, another object
    del params, tables
    gc.collect()
    assert not cache._by_id  # noqa: SLF001 - nothing kept for objects that are gone
