"""The offline API's accounting and its answers to bad input."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from pagedrag import LLM, EngineArgs, SamplingParams
from model_fixtures import make_tiny_model
from pagedrag.worker.fork_trial import exit_code_in_a_fork

BLOCK = 16


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture()
def llm(path):
    return LLM(path, max_model_len=256, block_size=BLOCK, dtype="float32")  # HF's and greedy's ties alike on CUDA too


def ids(start: int, count: int) -> list[int]:
    return [3 + (start + i) % 200 for i in range(count)]


def gen(llm, prompt, salt=None, max_tokens=2):
    item = {"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}
    return llm.generate(item, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]


def test_same_prompt_twice_hits_all_full_blocks_but_the_last_token(llm):
    prompt = ids(0, 40)
    assert gen(llm, prompt).num_cached_tokens == 0
    second = gen(llm, prompt)
    assert second.num_cached_tokens == 32  # (40 - 1) // 16 full blocks
    stats = llm.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (80, 32)
    assert stats["prefix_cache_hit_rate"] == pytest.approx(32 / 80)


def test_shared_system_prompt_hits_its_full_blocks(llm):
    system = ids(0, 20)
    gen(llm, system + ids(100, 15))
    out = gen(llm, system + ids(150, 30))
    assert out.num_cached_tokens == 16


def test_shared_prefix_shorter_than_a_block_gets_nothing(llm):
    gen(llm, ids(0, 10) + ids(100, 30))
    assert gen(llm, ids(0, 10) + ids(150, 30)).num_cached_tokens == 0


def test_cache_salt_separates_tenants(llm):
    prompt = ids(7, 50)
    gen(llm, prompt, salt="tenant-a")
    assert gen(llm, prompt, salt="tenant-b").num_cached_tokens == 0
    assert gen(llm, prompt, salt="tenant-a").num_cached_tokens == 48
    assert gen(llm, prompt).num_cached_tokens == 0  # unsalted is its own tenant


def test_stop_token_ids_and_max_tokens(llm):
    first = gen(llm, ids(0, 12), max_tokens=6).outputs[0]
    assert first.finish_reason == "length" and len(first.token_ids) == 6
    stop_at = first.token_ids[2]
    out = llm.generate({"prompt_token_ids": ids(0, 12)},
                       SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == first.token_ids[:first.token_ids.index(stop_at) + 1]


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n must"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 12}, "power of two"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"preemption_mode": "drop"}, "preemption_mode"),
    # a value of another type is refused by name, never read as truthy or compared with a number
    ({"trust_remote_code": "false"}, "trust_remote_code must be true or false, got str 'false'"),
    ({"enable_prefix_caching": "false"}, "enable_prefix_caching must be true or false"),
    ({"max_model_len": "128"}, "max_model_len must be an integer"),
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization must be a number"),
    ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer"),
    ({"seed": "1"}, "seed must be an integer"),
    ({"model": 3}, "model must be a string"),
])
def test_invalid_engine_args(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_engine_args_take_paths_numpy_numbers_and_no_seed(path):
    args = EngineArgs(model=Path("/models/x"), max_model_len=np.int64(128), gpu_memory_utilization=1, seed=None,
                      kv_cache_memory_bytes=2e9, hf_token=True)  # a whole float, as YAML and JSON configs write it
    assert (args.model, type(args.max_model_len), args.gpu_memory_utilization) == ("/models/x", int, 1.0)
    assert args.kv_cache_memory_bytes == 2_000_000_000 and type(args.kv_cache_memory_bytes) is int
    assert args.seed is None and args.hf_token is True  # (vLLM's: True is the saved login)
    engine = LLM(path, max_model_len=64, seed=None).llm_engine  # a random seed, drawn for every rank at once
    assert isinstance(engine.args.seed, int)


def test_bad_prompts_fail_before_work_and_others_keep_running(llm):
    engine = llm.llm_engine
    engine.add_request("good", {"prompt_token_ids": ids(0, 20)}, SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len is 256"):
        engine.add_request("long", {"prompt_token_ids": ids(0, 300)})
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", {"prompt_token_ids": []})
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", {"prompt_token_ids": [10**9]})
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", {"prompt_token_ids": ids(0, 5)})
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert len(finished[0].outputs[0].token_ids) == 4


def test_generate_is_all_or_nothing_on_bad_input(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": ids(0, 8)}, {"prompt_token_ids": ids(0, 400)}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_gpu_blocks"]


def test_reset_prefix_cache_answers_as_vllms_does(llm):
    llm.generate({"prompt_token_ids": ids(0, 40)}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert llm.llm_engine.cached_prefix_len(ids(0, 40)) > 0
    assert llm.reset_prefix_cache() is True
    assert llm.llm_engine.cached_prefix_len(ids(0, 40)) == 0


def test_what_is_not_a_prompt_is_refused_by_name(llm):
    for prompts in (None, 5, b"abc"):
        with pytest.raises(TypeError, match="prompts must be a prompt or a sequence of prompts"):
            llm.warm(prompts, use_tqdm=False)
    with pytest.raises(TypeError, match="chat conversation"):
        llm.warm([[{"role": "user", "content": "hi"}]], use_tqdm=False)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_gpu_blocks"]


def test_pool_too_small_for_one_sequence(path):
    with pytest.raises(ValueError, match="fewer than one sequence of max_model_len=256"):
        LLM(path, max_model_len=256, block_size=16, num_gpu_blocks_override=8)


def test_a_kv_budget_past_the_memory_available_is_refused_by_name(path):
    """It allocated until the machine ran out (or torch's size calculation overflowed)."""
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=\d+ is more than the .* GiB of cpu memory"):
        LLM(path, max_model_len=256, kv_cache_memory_bytes=10 ** 20)


def test_unknown_model_and_unknown_argument(path):
    with pytest.raises((ValueError, OSError), match="no-such-model"):
        LLM("no-such-org/no-such-model")
    with pytest.raises(TypeError, match="gpu_mem"):
        LLM(path, gpu_mem=0.5)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_frees_blocks(llm, path, async_scheduling):
    """Also when the aborted request's token is still on the device (asynchronous scheduling,
    CUDA's default): no work is left, the token is dropped when the next step reads it."""
    llm = LLM(path, max_model_len=256, block_size=BLOCK, async_scheduling=True) if async_scheduling else llm
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": ids(0, 60)}, SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert llm.stats()["num_free_blocks"] < llm.stats()["num_gpu_blocks"]
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_gpu_blocks"]
    assert gen(llm, ids(3, 25), max_tokens=4).outputs[0].token_ids  # the engine goes on


def _finished(engine, reason: str) -> float:
    return sum(sample.value for family in engine.metrics.registry.collect() for sample in family.samples
               if sample.name.endswith("request_success_total") and sample.labels["finished_reason"] == reason)


def test_each_of_n_completions_ends_once_in_the_request_counter(llm):
    """request_success{finished_reason}: an n=3 request counts 3 whether it finishes, is aborted
    while its siblings are not forked yet, or after they are."""
    engine = llm.llm_engine
    done = _finished(engine, "length")
    llm.generate({"prompt_token_ids": ids(0, 20)}, SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1),
                 use_tqdm=False)
    assert _finished(engine, "length") - done == 3
    for steps in (0, 2):  # waiting (siblings pending), then forked and decoding
        before = _finished(engine, "abort")
        engine.add_request("n3", {"prompt_token_ids": ids(1, 20)}, SamplingParams(n=3, max_tokens=50, seed=1))
        for _ in range(steps):
            engine.step()
        engine.abort_request("n3")
        assert _finished(engine, "abort") - before == 3, steps


def test_gpu_memory_utilization_on_cpu_is_a_logged_warning(path, caplog):
    """A vLLM user's gpu_memory_utilization has no meaning on CPU (the pool takes a share of
    available memory): said, not dropped in silence."""
    with caplog.at_level("WARNING", logger="pagedrag"):
        LLM(path, max_model_len=256, gpu_memory_utilization=0.5, device="cpu")
    assert "gpu_memory_utilization=0.5 is a share of GPU memory" in caplog.text


def test_a_forked_child_cannot_run_the_parents_engine(llm):
    """Its tier writer, worker ranks and thread settings stayed in the parent: the child's
    copy fails at once, naming the fork, and the parent goes on."""
    from pagedrag.engine.recovery import EngineDeadError
    assert gen(llm, ids(0, 20)).outputs[0].token_ids

    def in_the_child() -> int:
        try:
            gen(llm, ids(0, 20))
        except EngineDeadError as error:
            return 0 if "forked" in str(error) else 2
        return 1

    assert exit_code_in_a_fork(in_the_child, timeout_s=60) == 0
    assert gen(llm, ids(0, 20)).outputs[0].token_ids


def test_beam_search_width_one_is_greedy_and_scores_are_true_logprobs(llm, path):
    import torch
    from transformers import AutoModelForCausalLM

    from pagedrag import BeamSearchParams
    prompt = ids(3, 25)
    greedy = gen(llm, prompt, max_tokens=6).outputs[0].token_ids
    narrow = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=1, max_tokens=6))[0]
    assert narrow.sequences[0].tokens[25:] == greedy
    wide = llm.beam_search([{"prompt_token_ids": prompt}],
                           BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))[0]
    assert len({tuple(s.tokens) for s in wide.sequences}) == 4
    scores = [s.cum_logprob for s in wide.sequences]
    assert scores == sorted(scores, reverse=True)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    for seq in wide.sequences:
        with torch.no_grad():
            logits = model(torch.tensor([seq.tokens])).logits[0].log_softmax(-1)
        true = sum(logits[p - 1, seq.tokens[p]].item() for p in range(25, len(seq.tokens)))
        assert seq.cum_logprob == pytest.approx(true, abs=1e-3)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_gpu_blocks"]


def test_dummy_weights_from_a_config_only_folder(tmp_path):
    from transformers import LlamaConfig
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), load_format="dummy", num_gpu_blocks_override=32)
    out = llm.generate({"prompt_token_ids": ids(0, 20)}, SamplingParams(max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)


def test_calls_from_several_threads_each_get_their_own_outputs(llm):
    """A sync web app or a thread pool sharing one LLM: calls run one after another (they mixed
    up each other's requests, or waited forever for one another had taken)."""
    prompts = [{"prompt_token_ids": ids(3 + 11 * i, 5 + i)} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def answer(prompt: dict) -> list[int]:
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    def reply(index: int) -> list[int]:
        return llm.chat([{"role": "user", "content": f"question {index}"}], params,
                        use_tqdm=False)[0].outputs[0].token_ids

    alone = [answer(prompt) for prompt in prompts]
    replies = [reply(index) for index in range(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = pool.map(answer, prompts * 3)
        chats = pool.map(reply, list(range(4)) * 3)
        assert (list(answers), list(chats)) == (alone * 3, replies * 3)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_gpu_blocks"]
