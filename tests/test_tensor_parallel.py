"""Tensor parallelism on CPU: two processes over gloo run the same code as two GPUs over NCCL.

Greedy outputs at tensor_parallel_size=2 equal HF transformers' generate (and so the
one-rank engine's, which test_engine_equivalence holds to the same reference), with
prefix caching, chunked prefill, both preemption modes, copy-on-write forks, prompt
logprobs, asynchronous scheduling, speculative decoding and the KV tiers; sizes that cannot be split are refused before any
worker starts; a worker that dies stops the engine with an error naming it; torchrun
can start the ranks.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from model_fixtures import hf_greedy, make_tiny_model
from test_engine_equivalence import MAX_NEW, prompts_of
from pagedrag import LLM, SamplingParams
from pagedrag.distributed.launch import free_port
from pagedrag.engine.recovery import EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=12)
CPU = {"device": "cpu", "dtype": "float32"}  # gloo between processes, also where a GPU is present


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """An untied-head Llama with llama3 rope; its vocabulary (259) is odd, so the vocab split pads."""
    path = make_tiny_model(tmp_path_factory.mktemp("tp-llama"), "llama")
    prompts = prompts_of(259)
    return path, prompts, hf_greedy(path, prompts, MAX_NEW)


def generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_two_ranks_match_hf_through_caching_preemption_by_swap_forks_and_async_steps(llama):
    path, prompts, expected = llama
    # 16 blocks of 8 tokens: the batch does not fit, so sequences are swapped out and back.
    llm = LLM(path, tensor_parallel_size=2, max_model_len=128, block_size=8, num_gpu_blocks_override=16,
              preemption_mode="swap", swap_space=0.01, async_scheduling=True, max_num_batched_tokens=32, **CPU)
    try:
        assert generate(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] > 0
        for _ in range(2):  # the second pass reads the first one's blocks
            assert generate(llm, prompts[3:4]) == expected[3:4]
        assert llm.stats()["prefix_cache_hits"] >= 40
        forks = llm.generate({"prompt_token_ids": prompts[2]}, SamplingParams(temperature=0, max_tokens=12, n=3),
                             use_tqdm=False)[0]
        assert [c.token_ids for c in forks.outputs] == [expected[2]] * 3
    finally:
        llm.llm_engine.shutdown()


def test_two_ranks_prompt_logprobs_and_recompute_preemption_match_one_rank(tmp_path):
    path = make_tiny_model(tmp_path, "qwen2")  # q/k/v biases, tied embeddings
    prompts = prompts_of(259)
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2, logprobs=2)
    engines = {size: LLM(path, tensor_parallel_size=size, max_model_len=128, block_size=8,
                         num_gpu_blocks_override=16, **CPU) for size in (1, 2)}
    try:
        outs = {size: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                for size, llm in engines.items()}
        assert engines[2].stats()["num_preemptions"] > 0
    finally:
        engines[2].llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs[2]] == hf_greedy(path, prompts, max_new=8)
    for one, two in zip(outs[1], outs[2]):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()], abs=1e-4)


def test_two_ranks_with_speculative_decoding_match_hf(llama):
    """Rank 0 drafts and verifies; rank 1 runs the verification steps (1 + k tokens a row)
    like any other: greedy output is HF's, with drafts accepted on the way."""
    path, prompts, _ = llama
    repeating = [(prompt[:9] * 6)[:48] for prompt in prompts[:3]]  # n-grams recur from the start
    llm = LLM(path, tensor_parallel_size=2, max_model_len=128, num_gpu_blocks_override=32,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **CPU)
    try:
        params = SamplingParams(temperature=0, max_tokens=24)
        assert generate(llm, repeating, params) == hf_greedy(path, repeating, max_new=24)
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    finally:
        llm.llm_engine.shutdown()


def test_two_ranks_through_the_host_and_disk_tiers_match_hf_after_a_restart(llama, tmp_path):
    """Rank 0's tiers hold whole blocks (every rank's heads, gathered as blocks complete, each
    rank's heads broadcast back on a load): blocks the pool let go come back from host memory,
    a restarted pair of ranks reads the disk tier, and greedy output stays HF's. One rank on the
    same directory misses: the tensor-parallel size is in the key."""
    path, prompts, expected = llama
    tiers = {"max_model_len": 128, "block_size": 8, "num_gpu_blocks_override": 16, "kv_disk_path": str(tmp_path)}
    llm = LLM(path, tensor_parallel_size=2, kv_offloading_size=0.01, **tiers, **CPU)
    try:
        outs = [llm.generate([{"prompt_token_ids": p} for p in order], GREEDY, use_tqdm=False)
                for order in (prompts, prompts[::-1])]  # the last prompts' blocks went first
        assert [o.outputs[0].token_ids for o in outs[0]] == expected
        assert [o.outputs[0].token_ids for o in outs[1][::-1]] == expected
        served = sum(o.num_tier_hit_tokens.get("host", 0) for o in outs[0] + outs[1])
        assert llm.stats()["kv_tiers"]["hit_tokens"].get("host", 0) == served >= 48
        llm.llm_engine.flush_tiers()
    finally:
        llm.llm_engine.shutdown()
    restarted = LLM(path, tensor_parallel_size=2, **tiers, **CPU)
    try:
        outs = restarted.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert outs[-1].num_tier_hit_tokens.get("disk", 0) >= 64
    finally:
        restarted.llm_engine.shutdown()
    one_rank = LLM(path, **tiers, **CPU)
    out = one_rank.generate({"prompt_token_ids": prompts[-1]}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[-1] and out.num_tier_hit_tokens == {}


def test_sizes_that_do_not_divide_the_heads_are_refused_before_workers_start(llama):
    path = llama[0]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the model's 4 attention "
                                         r"heads, 2 KV heads"):
        LLM(path, tensor_parallel_size=3, **CPU)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(path, tensor_parallel_size=0, **CPU)
    with pytest.raises(ValueError, match="quantization='int8' .* tensor_parallel_size=2"):
        LLM(path, tensor_parallel_size=2, quantization="int8", **CPU)


def test_a_worker_that_dies_stops_the_engine_with_an_error_naming_it(llama):
    path, prompts, _ = llama
    llm = LLM(path, tensor_parallel_size=2, max_model_len=128, num_gpu_blocks_override=32, **CPU)
    worker = llm.llm_engine.ranks.workers[0]
    worker.kill()
    worker.wait()
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker rank 1 .* exited with code -9"):
        generate(llm, prompts[:1])
    assert time.monotonic() - started < 30
    llm.llm_engine.shutdown()  # returns although its worker is gone


TORCHRUN_SCRIPT = """
import json, sys
from pagedrag import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=128, num_gpu_blocks_override=32, device="cpu")
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                    SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
llm.llm_engine.shutdown()
"""


def test_torchrun_starts_the_ranks_and_only_rank_0_goes_past_the_engine(llama, tmp_path):
    import json

    path, prompts, expected = llama
    script = tmp_path / "serve_tp.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), str(script), str(path), json.dumps(prompts[:3])]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=Path(__file__).parent, start_new_session=True)
    try:
        stdout, stderr = launcher.communicate(timeout=300)
    finally:  # torchrun's ranks too, should it hang
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    done = subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(printed) == 1  # rank 1 left inside LLM(...)
    assert json.loads(printed[0][len("TOKENS "):]) == expected[:3]



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_more_ranks_than_gpus_is_refused_before_workers_start(llama):
    too_many = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=f"tensor_parallel_size={too_many} needs {too_many} GPUs"):
        LLM(llama[0], tensor_parallel_size=too_many, device="cuda")
