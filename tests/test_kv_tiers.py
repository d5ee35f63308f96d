"""KV tiers under the pool, end to end on a tiny random Llama (CPU, float32): a block loaded
from the host or the disk tier gives exactly the outputs of a pool hit and of HF's greedy
generate, after a restart too; a changed checkpoint misses; a bad file is a miss; a broken
directory turns the tier off and the engine goes on."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from model_fixtures import hf_greedy, make_tiny_model
from pagedrag import LLM, SamplingParams
from pagedrag.rag.explain import explain_against_engine

GREEDY = SamplingParams(temperature=0, max_tokens=10)
ENGINE = {"max_model_len": 512, "num_gpu_blocks_override": 96, "block_size": 16, "dtype": "float32"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The model, its prompts (sharing a 160-token prefix) and HF's greedy answers to them."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiers"), "llama")
    generator = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 250, (160,), generator=generator).tolist()
    prompts = [shared + torch.randint(3, 250, (n,), generator=generator).tolist() for n in (9, 23, 40)]
    return path, prompts, hf_greedy(path, prompts, max_new=GREEDY.max_tokens)


def _run(llm: LLM, prompts):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm.llm_engine.flush_tiers()
    return outputs


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_restart_on_the_disk_tier_equals_hf_and_the_cold_run(tiny, tmp_path):
    path, prompts, expected = tiny
    cold = LLM(str(path), kv_disk_path=tmp_path, **ENGINE)
    first = _run(cold, prompts)
    cold.llm_engine.shutdown()
    assert _tokens(first) == expected
    restarted = LLM(str(path), kv_disk_path=tmp_path, **ENGINE)
    # what probes the cache (cache-aware order, pagedrag explain) sees what a request would load
    assert restarted.llm_engine.cached_prefix(prompts[0]) == {"pool": 0, "disk": 160}
    assert restarted.llm_engine.cached_prefix_len(prompts[0], cache_salt="another tenant") == 0
    explanation = explain_against_engine(prompts[0], restarted.llm_engine, restarted.get_tokenizer())
    assert explanation.cause == "none" and explanation.tier_tokens == {"disk": 160}
    assert "160 in the disk tier" in str(explanation)
    second = _run(restarted, prompts)
    assert _tokens(second) == expected
    assert second[0].num_tier_hit_tokens == {"disk": 160} and second[0].num_cached_tokens == 160
    assert restarted.llm_engine.cached_prefix(prompts[0]) == {"pool": 160}
    stats = restarted.stats()["kv_tiers"]
    assert stats["external_prefix_cache_hits"] >= 160 and stats["bytes"]["disk_to_host"] > 0
    assert stats["tiers"]["disk"]["used_bytes"] > 0


def test_a_request_waiting_for_disk_reads_does_not_spin_the_step_loop(tiny, tmp_path):
    """While a request's blocks load, the step loop sleeps until a read lands: it used to wait
    on reads already done, return at once and spin, holding the interpreter the reader
    threads need (on the embedded model a block read took 20-60x its time alone)."""
    path, prompts, expected = tiny
    long_prompt = prompts[2] * 2  # 400 tokens: 25 blocks to read
    _run(LLM(str(path), kv_disk_path=tmp_path, **ENGINE), [long_prompt])
    restarted = LLM(str(path), kv_disk_path=tmp_path, **ENGINE)
    engine, steps = restarted.llm_engine, []
    step = engine.step
    engine.step = lambda: steps.append(1) or step()
    out = _run(restarted, [long_prompt])[0]
    assert out.num_tier_hit_tokens == {"disk": 384}
    assert len(steps) <= GREEDY.max_tokens + 25  # a step per landed read at most, then the decode steps


def test_host_tier_serves_blocks_the_pool_let_go(tiny):
    path, prompts, expected = tiny
    llm = LLM(str(path), kv_offloading_size=0.01, **{**ENGINE, "num_gpu_blocks_override": 40})
    assert _tokens(_run(llm, prompts[:1])) == expected[:1]
    filler = [[5 + i] * 300 for i in range(2)]  # evicts every cached block of the first prompt
    _run(llm, filler)
    assert llm.llm_engine.cached_prefix(prompts[0])["pool"] == 0
    again = _run(llm, prompts)
    assert _tokens(again) == expected
    assert again[0].num_tier_hit_tokens.get("host", 0) >= 160


def _segments(*segments):
    return {"prompt_segments": [{"token_ids": list(s)} for s in segments]}


def test_chunk_reuse_through_the_disk_tier(tiny, tmp_path):
    """A chunk's position-independent KV goes through the disk tier: a restarted engine imports
    it exactly as an engine that computed it imports it from its pool."""
    path, prompts, _ = tiny
    tokens = prompts[0]
    head, first, second, tail = tokens[:32], tokens[32:80], tokens[80:120], [9, 10, 11, 12, 13]
    engine = {**ENGINE, "enable_chunk_reuse": True, "chunk_recompute_window": 0}  # `first` stays imported
    computing = LLM(str(path), kv_disk_path=tmp_path, **engine)
    computing.generate(_segments(head, first, tail), GREEDY, use_tqdm=False)
    computing.llm_engine.flush_tiers()
    computing.llm_engine.shutdown()
    in_pool = LLM(str(path), **engine)  # no tier: the reference
    in_pool.generate(_segments(head, first, tail), GREEDY, use_tqdm=False)
    from_pool = in_pool.generate(_segments(head, second, first, tail), GREEDY, use_tqdm=False)[0]
    assert from_pool.num_chunk_hit_tokens > 0
    restarted = LLM(str(path), kv_disk_path=tmp_path, **engine)
    from_disk = restarted.generate(_segments(head, second, first, tail), GREEDY, use_tqdm=False)[0]
    assert from_disk.num_chunk_hit_tokens == from_pool.num_chunk_hit_tokens
    assert from_disk.num_tier_hit_tokens["disk"] >= len(first)
    assert from_disk.outputs[0].token_ids == from_pool.outputs[0].token_ids


@pytest.mark.parametrize("window", [0, 48])
def test_a_restarted_engine_takes_the_blocks_chunk_reuse_made(tiny, tmp_path, window):
    """A prompt built with imported chunks is cached past its exact prefix under blended keys
    (core.prefix_keys): the same prompt after a restart loads all but its last block from the
    disk tier and computes only that, giving the first engine's answer token for token; a
    prompt of the same tokens without segments (no chunk reuse) never takes them."""
    path, prompts, _ = tiny
    tokens = prompts[0]
    head, first, second, tail = tokens[:32], tokens[32:80], tokens[80:128], [9, 10, 11, 12, 13]
    engine = {**ENGINE, "enable_chunk_reuse": True, "chunk_recompute_window": window}
    computing = LLM(str(path), kv_disk_path=tmp_path, **engine)
    computing.generate(_segments(head, first, tail), GREEDY, use_tqdm=False)
    built = computing.generate(_segments(head, second, first, tail), GREEDY, use_tqdm=False)[0]
    assert built.num_chunk_hit_tokens + built.num_recomputed_tokens > 0  # `first` imported
    computing.llm_engine.flush_tiers()
    computing.llm_engine.shutdown()
    restarted = LLM(str(path), kv_disk_path=tmp_path, **engine)
    again = restarted.generate(_segments(head, second, first, tail), GREEDY, use_tqdm=False)[0]
    num_full = (len(again.prompt_token_ids) - 1) // 16 * 16
    assert again.num_cached_tokens == num_full and again.num_chunk_hit_tokens == 0
    assert again.num_tier_hit_tokens == {"disk": num_full}
    assert again.outputs[0].token_ids == built.outputs[0].token_ids
    exact = len(head) + len(second)  # computed before the first import
    assert restarted.stats()["blended_prefix_hits"] == num_full - exact
    plain = restarted.generate({"prompt_token_ids": list(again.prompt_token_ids)}, GREEDY, use_tqdm=False)[0]
    assert plain.num_cached_tokens == exact


@pytest.mark.parametrize("window", [0, 16, 1000])
def test_tier_hits_of_a_chunk_are_its_tokens_not_computed_again(tiny, tmp_path, window):
    """A chunk loaded from a tier counts as tier hits only for the tokens it imports: tokens of
    it computed again (the question window) are not hits, so a response's tier hits never exceed
    its cached plus chunk-hit tokens, and the engine's counters say the same."""
    path, prompts, _ = tiny
    tokens = prompts[0]
    head, first, second, tail = tokens[:32], tokens[32:80], tokens[80:120], [9, 10, 11, 12, 13]
    def prompt(*segments):
        return {"prompt_segments": [{"token_ids": list(s)} for s in segments]}
    engine = {**ENGINE, "enable_chunk_reuse": True, "chunk_recompute_window": window}
    computing = LLM(str(path), kv_disk_path=tmp_path, **engine)
    computing.generate(prompt(head, first, tail), GREEDY, use_tqdm=False)
    computing.llm_engine.flush_tiers()
    computing.llm_engine.shutdown()
    restarted = LLM(str(path), kv_disk_path=tmp_path, **engine)
    output = restarted.generate(prompt(head, second, first, tail), GREEDY, use_tqdm=False)[0]
    assert output.num_recomputed_tokens > 0  # of the chunk that came from the disk
    assert output.num_tier_hit_tokens == {"disk": output.num_cached_tokens + output.num_chunk_hit_tokens}
    stats = restarted.stats()["kv_tiers"]
    assert stats["hit_tokens"] == output.num_tier_hit_tokens
    assert stats["external_prefix_cache_hits"] == output.num_cached_tokens + output.num_chunk_hit_tokens


def test_a_restarted_engine_knows_what_each_chunk_was_computed_after(tiny, tmp_path):
    """A chunk behind the segment it was computed after is imported whole (no token computed
    again), after a restart as in an engine that computed it: the relation travels with the
    chunk's first block through the disk tier."""
    path, prompts, _ = tiny
    tokens = prompts[0]
    head, first, second, other = tokens[:32], tokens[32:80], tokens[80:120], tokens[120:160]
    engine = {**ENGINE, "enable_chunk_reuse": True, "chunk_recompute_window": 0}
    computed, reordered = _segments(head, first, second, [5, 6, 7]), _segments(head, other, first, second, [9, 10, 11])
    computing = LLM(str(path), kv_disk_path=tmp_path, **engine)
    computing.generate(computed, GREEDY, use_tqdm=False)
    computing.llm_engine.flush_tiers()
    computing.llm_engine.shutdown()
    in_pool = LLM(str(path), **engine)  # no tier: the reference
    in_pool.generate(computed, GREEDY, use_tqdm=False)
    in_process = in_pool.generate(reordered, GREEDY, use_tqdm=False)[0]  # `second` still follows `first`
    restarted = LLM(str(path), kv_disk_path=tmp_path, **engine)
    after_restart = restarted.generate(reordered, GREEDY, use_tqdm=False)[0]
    recompute_first = restarted.llm_engine.kv.chunks.recompute_count(len(first))
    assert in_process.num_chunk_hit_tokens == len(first) + len(second) - recompute_first
    assert after_restart.num_chunk_hit_tokens == in_process.num_chunk_hit_tokens
    assert after_restart.num_recomputed_tokens == in_process.num_recomputed_tokens == recompute_first
    assert after_restart.outputs[0].token_ids == in_process.outputs[0].token_ids


def _other_weights(changed, tmp_path_factory):
    other = make_tiny_model(tmp_path_factory.mktemp("seed1"), "llama", seed=1)
    shutil.copy(other / "model.safetensors", changed / "model.safetensors")


def _other_norm_epsilon(changed, tmp_path_factory):
    """A value only the config holds (no weight changes)."""
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))


@pytest.mark.parametrize("change", [_other_weights, _other_norm_epsilon])
def test_a_changed_checkpoint_under_the_same_name_misses(tiny, tmp_path_factory, tmp_path, change):
    path, prompts, _ = tiny
    _run(LLM(str(path), kv_disk_path=tmp_path, **ENGINE), prompts[:1])
    changed = tmp_path_factory.mktemp("changed") / path.name
    shutil.copytree(path, changed)
    change(changed, tmp_path_factory)
    out = _run(LLM(str(changed), kv_disk_path=tmp_path, **ENGINE), prompts[:1])[0]
    assert out.num_cached_tokens == 0 and out.num_tier_hit_tokens == {}
    assert _tokens([out]) == hf_greedy(changed, prompts[:1], max_new=GREEDY.max_tokens)


def _flip_a_byte(path, files):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path, files):
    path.write_bytes(path.read_bytes()[:-100])


def _another_blocks_file(path, files):
    path.write_bytes(files[(files.index(path) + 1) % len(files)].read_bytes())


@pytest.mark.parametrize("damage", [_flip_a_byte, _truncate, _another_blocks_file])
def test_a_damaged_file_is_a_miss_that_is_removed(tiny, tmp_path, damage):
    path, prompts, expected = tiny
    _run(LLM(str(path), kv_disk_path=tmp_path, **ENGINE), prompts[:1])
    files = sorted(tmp_path.rglob("*.kv"))
    originals = {file: file.read_bytes() for file in files}
    for file in files:
        damage(file, [f for f in originals])
    llm = LLM(str(path), kv_disk_path=tmp_path, **ENGINE)
    out = _run(llm, prompts[:1])
    assert _tokens(out) == expected[:1] and out[0].num_cached_tokens == 0
    dropped = llm.stats()["kv_tiers"]["tiers"]["disk"]["dropped_files"]
    assert dropped >= 1 and sum(not f.exists() or f.read_bytes() in originals.values() for f in files) >= dropped


def test_a_directory_that_breaks_turns_the_tier_off_and_the_engine_goes_on(tiny, tmp_path, caplog):
    path, prompts, expected = tiny
    directory = tmp_path / "kv"
    llm = LLM(str(path), kv_disk_path=directory, **ENGINE)
    _run(llm, prompts[:1])
    assert llm.stats()["kv_tiers"]["tiers"]["disk"]["used_bytes"] > 0
    llm.reset_prefix_cache()
    shutil.rmtree(directory)
    directory.write_text("not a directory")  # every read and write under it now fails
    with caplog.at_level(logging.WARNING, logger="pagedrag"):
        assert _tokens(_run(llm, prompts)) == expected
    disk = llm.stats()["kv_tiers"]["tiers"]["disk"]
    assert not disk["enabled"] and disk["used_bytes"] == 0  # an off tier holds nothing
    assert sum("turned off" in r.getMessage() for r in caplog.records) == 1


def test_warm_fills_the_tier_for_a_later_engine(tiny, tmp_path):
    path, prompts, expected = tiny
    summary = LLM(str(path), kv_disk_path=tmp_path, **ENGINE).warm(
        [{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    assert summary["prompts"] == 3 and summary["prompt_tokens"] == sum(map(len, prompts))
    out = _run(LLM(str(path), kv_disk_path=tmp_path, **ENGINE), prompts)
    assert _tokens(out) == expected and all(o.num_cached_tokens >= 160 for o in out)


@pytest.mark.parametrize("bad", [{"kv_offloading_size": -1}, {"kv_offloading_size": float("inf")},
                                 {"kv_disk_size": 0}, {"kv_disk_size": float("inf")}, {"kv_disk_path": 3},
                                 {"kv_disk_path": ""}, {"kv_disk_size": 4},
                                 {"kv_disk_path": "x", "enable_prefix_caching": False},
                                 {"kv_offloading_size": 1e-9}, {"kv_disk_path": "x", "kv_disk_size": 1e-9},
                                 {"kv_disk_path": __file__}, {"kv_offloading_size": 1e6},
                                 {"kv_disk_path": "x", "kv_disk_size": 8192 / 2**30}])
def test_bad_tier_arguments_are_refused_by_name(tiny, bad):
    """Refused by name: out-of-range sizes, a size that holds no block (on disk: no block's
    file, which is its 8 KiB of K/V and a header), a host tier past the memory there is, a
    disk size without a directory, a path that is a file."""
    with pytest.raises(ValueError, match="kv_"):
        LLM(str(tiny[0]), **ENGINE, **bad)


def test_a_tight_pool_with_loads_for_many_requests_at_once_makes_progress(tiny):
    """Many requests whose blocks are in the host tier, admitted together into a pool that holds
    a few of them: every one finishes, with HF's tokens (loads never take the pool's last room),
    and counts as tier hits only what it found loaded when it got in."""
    path, prompts, expected = tiny
    llm = LLM(str(path), kv_offloading_size=0.05, **{**ENGINE, "num_gpu_blocks_override": 36})
    batch = [prompts[i % 3] for i in range(9)]
    assert _tokens(_run(llm, batch)) == [expected[i % 3] for i in range(9)]
    llm.reset_prefix_cache()
    again = _run(llm, batch)
    assert _tokens(again) == [expected[i % 3] for i in range(9)]
    served = sum(o.num_tier_hit_tokens.get("host", 0) for o in again)
    assert llm.stats()["kv_tiers"]["hit_tokens"]["host"] == served > 0
    assert all(sum(o.num_tier_hit_tokens.values()) <= o.num_cached_tokens for o in again)


def test_the_stats_line_reads_a_small_tier_in_mib():
    """A tier of a few MiB read "0.00/0.00 GiB" in the periodic stats line."""
    from pagedrag.engine.stats_log import _tiers_line
    tiers = {"tiers": {"disk": {"used_bytes": 1_500_000, "capacity_bytes": 2 << 20, "enabled": True},
                       "host": {"used_bytes": 1 << 30, "capacity_bytes": 4 << 30, "enabled": False}},
             "hit_tokens": {"disk": 32}, "external_prefix_cache_queries": 64, "external_prefix_cache_hits": 32}
    assert _tiers_line(tiers) == ("disk 1.43/2.00 MiB (32 tokens served), host 1.00/4.00 GiB (0 tokens served, off), "
                                  "hit rate below the pool: 50.0%")
