"""vLLM's SamplingParams extras RAG users reach for: logit_bias, allowed_token_ids,
bad_words, truncate_prompt_tokens; and the model's generation_config defaults."""

from __future__ import annotations

import pytest
import torch

from pagedrag import LLM, SamplingParams
from pagedrag.worker.sampler import Sampler, SamplingBatch
from model_fixtures import make_tiny_model

PROMPT = {"prompt_token_ids": [5, 9, 13, 17, 21, 25, 29]}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")), max_model_len=128)


def _greedy(llm, **extra) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **extra)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def test_allowed_token_ids_are_the_only_ones_sampled(llm):
    allowed = [40, 41, 42]
    assert set(_greedy(llm, allowed_token_ids=allowed)) <= set(allowed)
    sampled = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True,
                                                  allowed_token_ids=allowed), use_tqdm=False)
    assert set(sampled[0].outputs[0].token_ids) <= set(allowed)


def test_a_large_logit_bias_forces_a_token_and_a_negative_one_bans_it(llm):
    free = _greedy(llm)
    assert _greedy(llm, logit_bias={77: 100.0}) == [77] * 8
    assert free[0] not in _greedy(llm, logit_bias={free[0]: -100.0})[:1]


def test_bad_words_are_never_completed():
    """Unit level: a two-token bad word bans its last token only after its first."""
    logits = torch.zeros(2, 10)
    logits[:, 7] = 5.0  # token 7 would win
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0)]
    batch = SamplingBatch.from_params(params, [None, None], [[1], [1]], [[3], [4]], "cpu", frozenset(),
                                      [[[3, 7]], [[3, 7]]])
    out = Sampler()(logits, batch).to_host()
    assert out[0].token_id != 7 and out[1].token_id == 7  # only row 0's output ends with 3


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=3)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT["prompt_token_ids"][-3:]
    alone = llm.generate({"prompt_token_ids": PROMPT["prompt_token_ids"][-3:]},
                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("bad", [dict(logit_bias={10**9: 1.0}), dict(allowed_token_ids=[-1]),
                                 dict(logit_bias={5: 500.0}), dict(truncate_prompt_tokens=0)])
def test_bad_extras_are_refused(llm, bad):
    with pytest.raises((ValueError, TypeError)):
        llm.generate(PROMPT, SamplingParams(**bad), use_tqdm=False)


def test_default_sampling_params_and_reset_prefix_cache(llm):
    assert llm.get_default_sampling_params() == SamplingParams()  # the tiny model has no generation_config values
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    llm.reset_prefix_cache()
    assert llm.stats()["num_cached_blocks"] == 0


def test_logprobs_are_vllm_logprob_objects(llm):
    from pagedrag.outputs import Logprob

    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs):
        assert all(isinstance(lp, Logprob) for lp in entry.values())
        assert entry[token].rank == 1  # greedy: the sampled token is the most likely
        ranks = sorted(lp.rank for t, lp in entry.items())
        assert ranks[:2] == [1, 2] and entry[token].decoded_token == llm.get_tokenizer().decode([token])
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_prompt_logprobs_match_hf_and_survive_chunking(tmp_path):
    """Each prompt token's logprob under the model (the first has none), as HF's
    log_softmax over its logits gives it, also when the prompt is prefilled in chunks
    and after the same prompt is cached."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path, "llama")
    prompt = [3 + (5 * i) % 200 for i in range(40)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    llm = LLM(str(path), max_model_len=128, block_size=8, max_num_batched_tokens=16, dtype="float32")  # 3 prefill chunks
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    for _ in range(2):  # the second run would hit the prefix cache; prompt logprobs bypass it
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for position, entry in enumerate(out.prompt_logprobs[1:], 1):
            token = prompt[position]
            assert entry[token].logprob == pytest.approx(expected[position - 1, token].item(), abs=1e-4)
            assert len([lp for lp in entry.values() if lp.rank <= 2]) >= 2


def _first_ranked(llm, rank: int) -> tuple[int, float]:
    """The token ranked ``rank`` for PROMPT's first output token, and its raw logprob."""
    entry = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False
                         )[0].outputs[0].logprobs[0]
    token = next(t for t, lp in entry.items() if lp.rank == rank)
    return token, entry[token].logprob


def test_logprobs_are_the_models_raw_ones_whatever_the_parameters(llm):
    """vLLM's default logprobs_mode, raw_logprobs: a bias that makes the second token win leaves
    its logprob (and rank) as the model gave them."""
    token, raw = _first_ranked(llm, 2)
    biased = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=1, logit_bias={token: 50.0},
                                                 repetition_penalty=1.5), use_tqdm=False)[0].outputs[0]
    assert biased.token_ids == [token]
    assert biased.logprobs[0][token].logprob == pytest.approx(raw, abs=1e-5) and biased.logprobs[0][token].rank == 2


def test_a_stop_token_is_left_out_of_the_text_unless_asked_for(llm):
    first = _first_ranked(llm, 1)[0]
    stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[first]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.text == "" and stopped.stop_reason == first
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[first],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == llm.get_tokenizer().decode([first])


def test_detokenize_false_gives_token_ids_only(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=1, ignore_eos=True,
                                              detokenize=False), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.text == ""
    assert all(lp.decoded_token is None for entry in out.logprobs for lp in entry.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_truncate_minus_one_keeps_the_longest_prompt_the_engine_takes(llm):
    long_prompt = {"prompt_token_ids": [5 + i % 200 for i in range(300)]}
    out = llm.generate(long_prompt, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == long_prompt["prompt_token_ids"][-127:]  # max_model_len 128


def test_beam_search_fills_the_context_as_generate_does(llm):
    from pagedrag import BeamSearchParams

    prompt = {"prompt_token_ids": [5 + i % 200 for i in range(124)]}  # 4 tokens of room in 128
    beams = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=16, ignore_eos=True))[0]
    assert all(len(seq.tokens) == 128 for seq in beams.sequences)


def test_a_bad_word_with_a_leading_space_bans_the_word_itself(llm):
    inputs = llm.llm_engine.inputs
    assert inputs.bad_words_token_ids(SamplingParams(bad_words=[" c"])) == [[66]]  # vLLM: the word, stripped


def test_min_tokens_holds_back_every_end_of_sequence_id_of_the_model(tmp_path):
    """A model whose generation_config names two EOS ids (as Llama-3-Instruct's <|eot_id|>):
    min_tokens keeps both from being sampled, not only the tokenizer's. The engine also reports
    processed logprobs on request (logprobs_mode)."""
    from transformers import GenerationConfig

    path = make_tiny_model(tmp_path, "llama")
    GenerationConfig(eos_token_id=[258, 256]).save_pretrained(path)
    llm = LLM(str(path), max_model_len=64, logprobs_mode="processed_logprobs")
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, min_tokens=4, logit_bias={256: 30.0},
                                              logprobs=0), use_tqdm=False)[0].outputs[0]
    assert 256 not in out.token_ids[:4] and out.token_ids[4:] == [256] and out.finish_reason == "stop"
    assert out.logprobs[4][256].logprob > -0.01  # processed: the bias is in it
