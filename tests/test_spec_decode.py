"""Speculative decoding drafted from the context (ngram and suffix): lossless against decoding
without it and against HF's greedy generate, token for token, on a tiny model; stops inside an
accepted run; prefix caching, n > 1 and a tight pool that preempts (recompute and swap);
seeded requests emit what they emit without speculation; the sampled distribution of
unseeded requests is unchanged; the gates; the proposers; the figures; bad configs refused."""

import argparse

import pytest
import torch
from prometheus_client import generate_latest
from pydantic import ValidationError
from scipy.stats import chi2_contingency

from model_fixtures import hf_greedy, make_tiny_model
from pagedrag import LLM, SamplingParams
from pagedrag.worker.cuda_graphs import MAX_VERIFICATION_TOKENS, GraphShape, StepGraphs, verification_shapes
from pagedrag.config import EngineArgs
from pagedrag.core.request import Request
from pagedrag.server.cli import add_arguments, engine_args_from
from pagedrag.server.protocol import CompletionRequest
from pagedrag.spec_decode.config import SpeculativeConfig
from pagedrag.spec_decode.drafter import Drafter
from pagedrag.spec_decode.ngram import NgramIndex
from pagedrag.spec_decode.suffix import ContinuationCounts, GlobalIndex, SuffixProposer
from pagedrag.models.loader import load_tokenizer
from pagedrag.structured import StructuredOutputsParams
from pagedrag.structured.compiler import GrammarCompiler
from pagedrag.structured.masks import grammar_prefix

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}
MAX_NEW = 32


def repeating_prompts() -> list[list[int]]:
    """Prompts that repeat themselves (so drafts exist from the first decode) and one that does not."""
    generator = torch.Generator().manual_seed(7)
    phrase = torch.randint(3, 250, (11,), generator=generator).tolist()
    other = torch.randint(3, 250, (6,), generator=generator).tolist()
    return [phrase * 4, (other + phrase) * 3 + other, torch.randint(3, 250, (37,), generator=generator).tolist()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("spec"), "llama")
    references = hf_greedy(path, repeating_prompts(), MAX_NEW)
    return path, references


def make_llm(path, speculative_config=None, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 128)
    return LLM(str(path), dtype="float32", speculative_config=speculative_config, **kwargs)


def generate(llm: LLM, prompts, **params):
    sampling = SamplingParams(**{"temperature": 0, "max_tokens": MAX_NEW, **params})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)


def token_ids(outputs) -> list[list[int]]:
    return [completion.token_ids for output in outputs for completion in output.outputs]


def assert_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    llm.llm_engine.kv.pool.check_invariants()


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_hf_and_no_speculation_with_prefix_caching(tiny, method):
    path, references = tiny
    llm = make_llm(path, METHODS[method])
    for _ in range(2):  # the second pass hits the prefix cache (and, for suffix, its global index)
        outputs = generate(llm, repeating_prompts())
        assert token_ids(outputs) == references
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_mean_acceptance_length"] > 1
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    assert outputs[0].spec_decode.num_accepted_tokens > 0
    assert_all_free(llm)


def test_asynchronous_steps_above_the_gate_drafting_below_it(tiny):
    """With asynchronous scheduling, steps leave their tokens on the device while more requests
    run than drafting allows; once the batch is at the gate the tokens are read each step and
    the requests draft: greedy output is still HF's."""
    path, references = tiny
    llm = make_llm(path, {**NGRAM, "disable_by_batch_size": 1}, async_scheduling=True)
    engine = llm.llm_engine
    in_flight = []
    real = engine.runner.execute
    def spy(step, inflight=None):
        in_flight.append(inflight is not None)
        return real(step, inflight)
    engine.runner.execute = spy
    prompts = [{"prompt_token_ids": p} for p in repeating_prompts()]
    lengths = [MAX_NEW, 8, 8]  # three requests run together, then the first alone
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lengths], use_tqdm=False)
    assert token_ids(outputs) == [reference[:n] for reference, n in zip(references, lengths)]
    assert any(in_flight) and not all(in_flight)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_all_free(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_tight_pool_preempts_and_stays_exact(tiny, preemption_mode):
    path, references = tiny
    llm = make_llm(path, {**NGRAM, "disable_by_batch_size": 8}, num_gpu_blocks_override=14, block_size=8, max_model_len=96,
                   preemption_mode=preemption_mode, enable_prefix_caching=False)
    assert token_ids(generate(llm, repeating_prompts())) == references
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert_all_free(llm)


def test_stops_inside_an_accepted_run(tiny):
    """A stop token, EOS and a stop string that land among several tokens verified in one
    step end the output where decoding without speculation ends it; the rest is dropped."""
    path, references = tiny
    prompts = repeating_prompts()[:2]
    plain, spec = make_llm(path), make_llm(path, NGRAM)
    stop_token = references[0][9]
    stop_text = plain.get_tokenizer().decode(references[1][12:14])
    cases = [{"stop_token_ids": [stop_token]}, {"stop": [stop_text], "logprobs": 2},
             *({"max_tokens": n} for n in (1, 5, 13))]
    for params in cases:
        expected, actual = generate(plain, prompts, **params), generate(spec, prompts, **params)
        for want, got in zip(expected, actual):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, params
            assert got.outputs[0].text == want.outputs[0].text
            assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
    for engine in (plain, spec):  # EOS: what the stop policy reads as the end of text
        engine.llm_engine.stop_policy.eos_token_ids = {stop_token}
    assert token_ids(generate(spec, prompts)) == token_ids(generate(plain, prompts))
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_all_free(spec)


def test_logprobs_of_every_emitted_token(tiny):
    path, references = tiny
    plain, spec = make_llm(path), make_llm(path, NGRAM)
    expected, actual = generate(plain, repeating_prompts(), logprobs=3), generate(spec, repeating_prompts(), logprobs=3)
    for want, got in zip(expected, actual):
        want, got = want.outputs[0], got.outputs[0]
        assert len(got.logprobs) == len(got.token_ids)
        for want_step, got_step in zip(want.logprobs, got.logprobs):
            assert want_step.keys() == got_step.keys()
            for token, logprob in want_step.items():
                assert got_step[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)
                assert got_step[token].rank == logprob.rank
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_emits_what_it_emits_without_speculation(tiny, method):
    """Shaped (temperature, top-k, top-p, min-p, penalties, bias, allowed tokens) seeded
    requests, n = 2, in a batch and alone: the same tokens as without speculation. Five allowed
    tokens make the random model's samples repeat, so that drafts get accepted."""
    path, _ = tiny
    prompts = repeating_prompts()
    params = dict(temperature=0.8, top_k=3, top_p=0.95, min_p=0.02, repetition_penalty=1.05,
                  presence_penalty=0.1, logit_bias={prompts[0][0]: 1.0}, allowed_token_ids=prompts[0][:5],
                  seed=1234, n=2)
    config = {**METHODS[method], "disable_by_batch_size": 16}
    expected = token_ids(generate(make_llm(path), prompts, **params))
    spec = make_llm(path, config)
    assert token_ids(generate(spec, prompts, **params)) == expected
    assert token_ids(generate(spec, prompts[:1], **params)) == expected[:2]
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_all_free(spec)


def test_siblings_fork_when_the_prompt_ends_in_a_one_token_chunk(tiny):
    """n > 1 whose last prefill chunk is one token (33 tokens over a 16-token budget): that step
    drafts nothing, so the siblings fork off the first token's row as without speculation (a
    draft there once made them fork a step late, copying the parent's first token)."""
    path, _ = tiny
    prompt = repeating_prompts()[0][:33]
    params = dict(temperature=1.0, seed=5, n=3, max_tokens=6)
    engine = dict(max_num_batched_tokens=16, enable_prefix_caching=False)
    expected = token_ids(generate(make_llm(path, **engine), [prompt], **params))
    assert len({tokens[0] for tokens in expected}) > 1  # siblings that start apart: the check bites
    assert token_ids(generate(make_llm(path, NGRAM, **engine), [prompt], **params)) == expected


def test_sampled_distribution_unchanged(tiny):
    """Unseeded requests sampling from six allowed tokens (a tiny vocabulary): the tokens at
    every output position are distributed alike with and without speculation (chi-squared
    over 300 samples each). Every token of the prompt recurs, so every decode drafts."""
    path, _ = tiny
    alphabet = [40, 41, 42, 43, 44, 45]
    prompt = alphabet * 2
    counts = []
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
              "disable_by_batch_size": 1000}
    for speculative in (None, config):
        llm = make_llm(path, speculative, max_num_seqs=300, seed=5, num_gpu_blocks_override=1024)
        outputs = generate(llm, [prompt] * 300, temperature=1.0, max_tokens=4, allowed_token_ids=alphabet)
        counts.append(torch.tensor(token_ids(outputs)))
        if speculative:
            assert llm.stats()["spec_decode_num_drafts"] > 400 and llm.stats()["spec_decode_num_accepted_tokens"] > 100
    for position in range(1, 4):
        table = torch.stack([torch.bincount(c[:, position], minlength=max(alphabet) + 1) for c in counts])
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table.numpy()).pvalue > 1e-3, (position, table)


def test_gates_batch_size_and_opt_out(tiny):
    path, _ = tiny
    prompts = repeating_prompts()
    llm = make_llm(path, {**NGRAM, "disable_by_batch_size": 2})
    generate(llm, prompts)  # three requests run together to the end: above the gate throughout
    assert llm.stats()["spec_decode_num_drafts"] == 0
    outputs = generate(llm, prompts[:1], speculative_decoding=False)
    assert outputs[0].spec_decode is None and llm.stats()["spec_decode_num_drafts"] == 0
    assert generate(llm, prompts[:1])[0].spec_decode.num_drafts > 0


@pytest.mark.parametrize("method", METHODS)
def test_structured_rows_draft_within_their_grammar(tiny, method):
    """A constrained request's draft is cut where its grammar refuses it, and each verification
    row is masked by the grammar's state after the drafted tokens before it: greedy and seeded
    outputs are those without speculation, and the drafts that fit were verified."""
    path, _ = tiny
    prompts = repeating_prompts()
    plain, speculative = make_llm(path), make_llm(path, METHODS[method])
    constraints = [{"regex": "(ab){6}"}, {"regex": "(xyz|abc)+"},
                   {"json": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True}}]
    for constraint in constraints:
        outputs = generate(speculative, prompts, structured_outputs=constraint)
        assert token_ids(outputs) == token_ids(generate(plain, prompts, structured_outputs=constraint))
        assert sum(o.spec_decode.num_accepted_tokens for o in outputs if o.spec_decode) > 0, constraint
    seeded = {"structured_outputs": constraints[1], "temperature": 1.0, "seed": 3}
    assert token_ids(generate(speculative, prompts, **seeded)) == token_ids(generate(plain, prompts, **seeded))
    assert generate(speculative, prompts[:1], structured_outputs=constraints[0])[0].outputs[0].text == "ab" * 6
    assert_all_free(speculative)


def test_drafts_are_cut_before_special_tokens_without_asking_the_grammar(capfd):
    """A suffix draft copied from an earlier chat holds special tokens (<|im_end|>): they are
    cut as refused, and xgrammar is not asked (it writes a warning to stderr at each one)."""
    tokenizer = load_tokenizer()
    grammars = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    matcher = grammars.matcher(StructuredOutputsParams(json={"type": "object"}))
    special = sorted(grammars.special_token_ids)
    assert special  # SmolLM2's chat markers
    brace = tokenizer.encode("{")
    assert grammar_prefix(matcher, brace + special[:1] + brace, grammars.special_token_ids) == brace
    assert matcher.accept_token(brace[0])  # left as it was found
    assert "cannot accept special token" not in capfd.readouterr().err


def test_metrics_and_stats_agree(tiny):
    path, _ = tiny
    llm = make_llm(path, SUFFIX)
    generate(llm, repeating_prompts())
    stats = llm.stats()
    text = generate_latest(llm.llm_engine.metrics.registry).decode()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f'pagedrag:spec_decode_{name}_total{{model_name="' in text
        line = next(line for line in text.splitlines() if line.startswith(f"pagedrag:spec_decode_{name}_total"))
        assert float(line.split()[-1]) == stats[f"spec_decode_{name}"]
    assert 'pagedrag:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in text


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_rejected_drafts_cost_the_prefix_cache_nothing(tiny, async_scheduling):
    """A block that held only rejected drafted tokens is reused before any cached block is
    evicted: after a long drafted answer in a tight pool, an earlier prompt finds as much of its
    prefix cached, at as many evictions, as it does without speculative decoding. Asynchronous
    scheduling (CUDA's default) too: there the answer's last full block, whose last token is read
    after the step, is cached when the request ends, as a synchronous step caches it; pipelined
    ngram (engine.pipelined_drafting) reserves its lookahead slots one step ahead, which costs
    at most that many least recently used cached blocks in a full pool."""
    path, _ = tiny
    first = list(range(10, 50))
    long_answer = repeating_prompts()[2][:21]
    cached = {}
    for name, config in (("off", None), *METHODS.items()):
        llm = make_llm(path, config, block_size=2, num_gpu_blocks_override=60, max_model_len=120,
                       async_scheduling=async_scheduling)
        generate(llm, [first], max_tokens=1)
        generate(llm, [long_answer], max_tokens=60, ignore_eos=True)
        cached[name] = (generate(llm, [first], max_tokens=1)[0].num_cached_tokens, llm.stats()["num_evicted_blocks"])
        if llm.llm_engine.pipeline is not None:
            lookahead = -(-llm.llm_engine.pipeline.reach // 2)  # in blocks of 2 tokens
    assert cached["suffix"] == cached["off"], cached
    if not async_scheduling:
        assert cached["ngram"] == cached["off"], cached
    else:  # pipelined ngram reserves its lookahead slots a step early: at most that many evictions
        assert cached["off"][1] <= cached["ngram"][1] <= cached["off"][1] + lookahead, cached
        assert cached["ngram"][0] >= cached["off"][0] - 2 * lookahead, cached


@pytest.mark.parametrize("config, name", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "draft"}, "'model'"),
    ({"method": "suffix", "prompt_lookup_max": 3}, "'prompt_lookup_max'"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": "8"}, "suffix_decoding_max_tree_depth"),
    ("[1, 2]", "dict"),
    ("ngram", "speculative_config is not valid JSON"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": float("inf")}, "suffix_decoding_max_spec_factor"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 10**9}, "prompt_lookup_max"),
])
def test_bad_config_refused_by_name(config, name):
    with pytest.raises(ValueError, match=name):
        EngineArgs(speculative_config=config)


def test_config_through_the_cli_with_asynchronous_scheduling():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = engine_args_from(parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']))
    assert args.speculative().num_speculative_tokens == 3
    assert args.resolved_async_scheduling(torch.device("cuda"))  # steps above the drafting gate
    assert EngineArgs(speculative_config=NGRAM, tensor_parallel_size=2).speculative().method == "ngram"
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{'method': 'ngram'}"])  # not JSON: argparse's error


def test_the_opt_out_over_http_is_a_strict_boolean():
    request = CompletionRequest.model_validate({"prompt": "hi", "speculative_decoding": False})
    assert request.sampling_params().speculative_decoding is False
    assert CompletionRequest.model_validate({"prompt": "hi"}).sampling_params().speculative_decoding is True
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "hi", "speculative_decoding": "no"})


def test_ngram_index_is_incremental_and_finds_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 8, 2, 3]
    index = NgramIndex(2, 3)
    for token in tokens:  # one at a time, as a request grows
        index.extend([token])
    whole = NgramIndex(2, 3)
    whole.extend(tokens)
    assert index.last_end == whole.last_end
    assert index.continuation(3) == [4, 5, 8]  # (2, 3) last ended at position 6
    index.extend([7])
    assert index.continuation(3) == []
    repeat = NgramIndex(2, 2)
    repeat.extend([5, 6, 5, 6])
    assert repeat.continuation(5) == [5, 6, 5, 6, 5]  # a period repeats past the end


def test_suffix_drafts_from_earlier_requests_wherever_the_text_sat():
    proposer = SuffixProposer(max_tree_depth=24, max_cached_requests=1, max_spec_factor=1.0, min_token_prob=0.3)
    chunk = [40, 41, 42, 43, 44, 45, 46, 47]
    earlier = Request("earlier", [1, 2, 3] + chunk, SamplingParams(), 16)
    proposer.finish(earlier)
    now = Request("now", [9, 9, 9, 9, 9, 40, 41, 42], SamplingParams(), 16)
    assert proposer.propose(now, 10) == [43, 44, 45]  # a 3-token match drafts up to 3 (factor 1)
    assert proposer.propose(now, 2) == [43, 44]
    proposer.finish(Request("other", [7, 7], SamplingParams(), 16))  # evicts "earlier" (one cached)
    assert proposer.propose(Request("later", [40, 41, 42], SamplingParams(), 16), 10) == []


def test_suffix_global_index_is_bounded_in_tokens_and_forgets_exactly():
    index = GlobalIndex(max_match=3, max_requests=10, max_tokens=6)
    index.add([1, 2, 3, 4])
    index.add([5, 6, 7])  # 7 tokens: the first request goes
    assert list(index.documents) == [[5, 6, 7]] and index.num_tokens == 3
    fresh = ContinuationCounts(3)
    fresh.add([5, 6, 7])
    assert index.counts.counts == fresh.counts  # uncounting left no trace of the first


def test_draft_limit_follows_recent_acceptance():
    drafter = Drafter(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 8}))
    request = Request("r", [1, 2, 3], SamplingParams(), 16)
    limits = []
    for drafted, accepted in [(8, 2), (3, 3), (6, 6), (1, 1), (8, 0)]:
        drafter.record(request, drafted, accepted)
        limits.append(drafter.limits["r"])
    assert limits == [3, 6, 8, 8, 1]
    assert request.spec_decode.num_drafts == 5 and request.spec_decode.num_accepted_tokens == 12
    assert request.spec_decode.num_accepted_tokens_per_pos == [4, 3, 2, 1, 1, 1]
    drafter.finish(request)
    assert "r" not in drafter.limits


def test_verification_steps_replay_graphs_of_their_own():
    """On CUDA a step of drafting rows (1 + k tokens each) replays a graph of its shape, up
    to the drafting gate; above it drafting stops, so no such step comes."""
    graphs = StepGraphs(torch.nn.Identity(), [], None, max_batch=32, max_blocks_per_seq=4,
                        device=torch.device("cpu"), verification=verification_shapes(8, 4))
    assert verification_shapes(0, 4) == []
    assert {s.num_tokens for s in verification_shapes(1, 8)} == {2, 3, 5, 9}
    huge = verification_shapes(8, 10 ** 12)  # vLLM bounds no num_speculative_tokens; the graphs are bounded
    assert huge and max(s.num_tokens for s in huge) <= MAX_VERIFICATION_TOKENS
    assert graphs.shape_for(1, 5, decode=False) == GraphShape(1, 5)
    shorter_drafts = graphs.shape_for(3, 13, decode=False)  # the smallest that holds it
    assert shorter_drafts.num_seqs >= 3 and 13 <= shorter_drafts.num_tokens <= 20
    assert graphs.shape_for(8, 40, decode=False) == GraphShape(8, 40)
    assert graphs.shape_for(3, 3, decode=True) == GraphShape(4, 4)
