"""The data-parallel router (pagedrag.router): the affinity policy, the block hashes it
computes for request bodies (they must be the replica's own), summed metrics, the replica
command line, and `pagedrag serve --data-parallel-size 2` end to end: requests sharing a
prefix meet its cache, a killed replica is restarted and no request is lost, a warm-up is sent
to every replica and answered as one, and replicas started after a prompt was warmed load its
KV from the disk tier they share."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedrag import LLM, SamplingParams
from pagedrag.core.block_hash import extend_block_hashes
from pagedrag.router.affinity import AffinityThresholds, ReplicaChooser
from pagedrag.router.app_settings import serve_argv
from pagedrag.router import data_parallel
from pagedrag.router.data_parallel import ROUTER_DESTS, LocalReplica, Replicas, _send, replica_argv
from pagedrag.router.metrics_sum import CumulativeMemory, merge_metrics, merge_stats
from pagedrag.router.prompt_blocks import PromptBlocks
from pagedrag.router.warm_fanout import warm_every_replica
from pagedrag.server.background import free_port
from pagedrag.server.cli import add_arguments, template_text

SYSTEM = "You answer questions about the Python standard library from the documents given. " * 4


def test_affinity_keeps_a_prefix_on_its_replica_until_loads_diverge():
    chooser = ReplicaChooser(thresholds=AffinityThresholds(balance_abs_threshold=4))
    shared, other = [b"a", b"b", b"c"], [b"x", b"y"]
    first = chooser.choose(shared, {0: 0, 1: 0})
    chooser.record(first, shared)
    second = chooser.choose(other, {0: 0, 1: 0})  # no match: the replica with the smaller cache
    assert second != first
    chooser.record(second, other)
    assert chooser.choose(shared + [b"d"], {0: 3, 1: 0} if first == 0 else {0: 0, 1: 3}) == first
    overloaded = {first: 10, second: 0}
    assert chooser.choose(shared, overloaded) == second  # out of balance: load wins


def test_affinity_below_the_cache_threshold_goes_by_load():
    chooser = ReplicaChooser(thresholds=AffinityThresholds(cache_threshold=0.5))
    chooser.record(0, [b"a"])
    assert chooser.choose([b"a", b"b", b"c"], {0: 2, 1: 1}) == 1  # 1 of 3 blocks: not enough
    assert chooser.choose([b"a", b"b"], {0: 2, 1: 1}) == 0


def test_round_robin_alternates_and_bad_settings_are_refused():
    chooser = ReplicaChooser("round_robin")
    assert [chooser.choose([b"a"], {0: 0, 1: 0}) for _ in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="router policy"):
        ReplicaChooser("random")
    with pytest.raises(ValueError, match="cache_threshold"):
        AffinityThresholds(cache_threshold=2)
    with pytest.raises(ValueError, match="no replica"):
        ReplicaChooser().choose([b"a"], {})


class _Running:
    """A replica process that runs (poll() is None) until ``returncode`` is set."""

    def __init__(self, returncode: int | None = None):
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def _fake_replicas(answers: dict[str, httpx.Response]) -> Replicas:
    """Replicas up, named as ``answers``' keys, each answering every request with its answer."""
    replicas = [LocalReplica(name, [], port=1000 + index, up=True, ever_up=True, process=_Running())
                for index, name in enumerate(answers)]
    by_port = {replica.port: answers[replica.name] for replica in replicas}

    def replica_side(request: httpx.Request) -> httpx.Response:
        answer = by_port[request.url.port]
        return httpx.Response(answer.status_code, content=answer.content, headers=answer.headers)

    return Replicas(replicas, ReplicaChooser("round_robin"), blocks=None,
                    client=httpx.AsyncClient(transport=httpx.MockTransport(replica_side)))


def test_a_replica_at_its_max_queue_passes_the_request_to_another():
    full = httpx.Response(503, json={"error": {"message": "queue full", "code": "queue_full"}})
    replicas = _fake_replicas({"a": full, "b": httpx.Response(200, json={"served_by": "b"})})
    request = SimpleNamespace(headers={}, method="POST", url=SimpleNamespace(path="/v1/completions"),
                              query_params={})
    reply = asyncio.run(_send(replicas, request, b"{}", []))
    assert reply.status_code == 200 and json.loads(reply.body) == {"served_by": "b"}
    everyone_full = _fake_replicas({"a": full, "b": full})
    assert asyncio.run(_send(everyone_full, request, b"{}", [])).status_code == 503  # the last one's answer
    assert [r.in_flight for r in replicas.replicas + everyone_full.replicas] == [0, 1, 0, 1]  # 1: being sent


def test_a_body_over_the_replicas_size_limit_is_refused_by_the_router_before_it_is_read():
    """The router applies the replicas' --max-request-bytes itself: a larger body gets their
    413 there, declared or chunked, and no replica is asked."""
    seen = []
    replicas = _fake_replicas({"a": httpx.Response(200)})
    replicas.client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: seen.append(request)))
    client = TestClient(data_parallel.build_router_app(replicas, max_request_bytes=1000))  # no lifespan
    declared = client.post("/v1/completions", content=b"x" * 1001, headers={"content-type": "application/json"})
    chunked = client.post("/v1/completions", content=iter([b"x" * 600, b"x" * 600]))
    for reply in (declared, chunked):
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert seen == []


def test_requests_waiting_on_a_replica_that_stops_answering_go_to_another(monkeypatch):
    """A replica that hangs with a request sent to it: once health checks take it out of
    routing, that request goes to another replica (its connection to the hung one closed)."""
    hung, closed = asyncio.Event(), []

    async def replica_side(request: httpx.Request) -> httpx.Response:
        if request.url.port == 1000 and request.url.path != "/health":
            try:
                await hung.wait()  # never set: the replica never answers
            finally:
                closed.append(True)
        if request.url.path == "/health":
            return httpx.Response(503 if request.url.port == 1000 else 200)
        return httpx.Response(200, json={"served_by": request.url.port})

    replicas = _fake_replicas({"a": httpx.Response(200), "b": httpx.Response(200)})
    replicas.client = httpx.AsyncClient(transport=httpx.MockTransport(replica_side))
    request = SimpleNamespace(headers={}, method="POST", url=SimpleNamespace(path="/v1/completions"),
                              query_params={})

    async def scenario():
        sending = asyncio.create_task(_send(replicas, request, b"{}", []))  # round robin: "a" first
        await asyncio.sleep(0.05)
        assert not sending.done() and replicas.replicas[0].in_flight == 1
        for _ in range(data_parallel.HEALTH_MISSES):
            await asyncio.gather(*(replicas._check(replica) for replica in replicas.up()))
        return await asyncio.wait_for(sending, timeout=5)

    reply = asyncio.run(scenario())
    assert reply.status_code == 200 and json.loads(reply.body) == {"served_by": 1001}
    assert closed == [True] and [r.up for r in replicas.replicas] == [False, True]
    assert replicas.replicas[0].in_flight == 0


def test_a_replica_that_cannot_start_stops_the_router_instead_of_restarting_forever(monkeypatch):
    replica = LocalReplica("0", [])
    monkeypatch.setattr(replica, "start", lambda: setattr(replica, "process", _Running(returncode=1)))
    stopped = []
    replicas = Replicas([replica], ReplicaChooser(), blocks=None, on_failure=lambda: stopped.append(True))
    asyncio.run(asyncio.wait_for(replicas.supervise(), timeout=10))
    assert stopped == [True] and "exited (code 1) before it came up" in replicas.failure
    assert replica.restarts == 0


def test_replicas_told_to_stop_are_never_restarted_nor_counted_as_failures(monkeypatch):
    """While the router shuts down, a replica it told to stop exits: that is neither a replica
    to restart nor one that could not start (which would make the router exit 1)."""
    replica = LocalReplica("0", [], process=_Running(returncode=0), stopping=True)
    starts = []
    replica.start = lambda: starts.append(True)  # supervise() starts every replica once, first
    replicas = Replicas([replica], ReplicaChooser(), blocks=None, on_failure=lambda: pytest.fail("a failure"))
    rounds = []

    async def end_of_round(_seconds):  # the supervisor's pause between rounds: three rounds, then stop
        rounds.append(True)
        if len(rounds) == 3:
            raise asyncio.CancelledError

    monkeypatch.setattr(data_parallel.asyncio, "sleep", end_of_round)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(replicas.supervise())
    assert starts == [True] and replicas.failure is None and replica.restarts == 0


def test_a_replica_that_keeps_exiting_after_it_had_been_up_is_restarted_later_each_time(monkeypatch):
    clock = [100.0]  # a clock of the test's own: the delays are read, not waited for
    monkeypatch.setattr(data_parallel.time, "monotonic", lambda: clock[0])
    replica = LocalReplica("0", [], up=True, ever_up=True, process=_Running(returncode=1))
    monkeypatch.setattr(replica, "start", lambda: replica.__dict__.update(restart_at=None, up=False))
    replicas = Replicas([replica], ReplicaChooser(), blocks=None)
    replicas._restart(replica)  # it had been up since its start: at once
    assert (replica.restarts, replica.failed_starts) == (1, 0)
    for failed_starts in (1, 2, 3):  # each exit before coming up again doubles the wait
        replicas._restart(replica)
        assert replica.restarts == failed_starts and replica.failed_starts == failed_starts
        assert replica.restart_at - clock[0] == 2.0 ** failed_starts
        clock[0] = replica.restart_at  # (the wait is over)
        replicas._restart(replica)


@pytest.mark.parametrize("flag, value", [("--max-queue", "0"), ("--router-cache-threshold", "nan"),
                                         ("--router-balance-abs-threshold", "-1"), ("--port", "99999")])
def test_router_and_server_flags_out_of_range_are_refused_by_argparse(flag, value, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([flag, value])
    assert exited.value.code == 2 and flag in capsys.readouterr().err


def test_a_chat_template_that_looks_like_a_missing_file_is_refused(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert template_text(str(template)) == "{{ messages[0]['content'] }}"
    assert template_text("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="looks like a file path"):
        template_text(str(tmp_path / "missing.jinja"))


@pytest.fixture(scope="module")
def engine():
    return LLM(max_model_len=1024, kv_cache_memory_bytes=64 << 20)


@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_router_hashes_are_the_blocks_the_engine_caches(engine, salt):
    """What the router computes for a chat body is what the replica hashes and caches for it."""
    block_size = engine.llm_engine.args.block_size
    blocks = PromptBlocks(None, block_size)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does json.dumps do?"}]
    body = {"model": "m", "messages": messages, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
    hashes = blocks.of("/v1/chat/completions", body)
    token_ids = engine.llm_engine.inputs.render_chat(messages, True, salt).token_ids
    expected: list[bytes] = []
    extend_block_hashes(expected, token_ids, block_size, salt)
    assert hashes == expected and len(hashes) >= 4
    engine.generate({"prompt_token_ids": token_ids, **({"cache_salt": salt} if salt else {})},
                    SamplingParams(max_tokens=1), use_tqdm=False)
    assert engine.llm_engine.cached_prefix_len(token_ids, salt) >= block_size * (len(hashes) - 1)
    assert blocks.of("/v1/chat/completions", {"messages": "not a list"}) == []
    assert blocks.of("/v1/completions", {"model": "m", "prompt": ["a", "b"]}) == []  # a batch: by load


def test_merged_metrics_label_each_replica_and_sum_them():
    def replica(tokens: float, usage: float) -> str:
        registry = CollectorRegistry()
        Counter("pagedrag:prompt_tokens", "Prompt tokens.", ["model_name"], registry=registry).labels("m").inc(tokens)
        Gauge("pagedrag:kv_cache_usage_perc", "Usage.", ["model_name"], registry=registry).labels("m").set(usage)
        capacity = Gauge("pagedrag:kv_tier_capacity_bytes", "Capacity.", ["tier"], registry=registry)
        capacity.labels("disk").set(1 << 30)  # one directory, shared: not the replicas' to add
        capacity.labels("host").set(tokens)  # each replica's own host memory: added
        return generate_latest(registry).decode()

    merged = {family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples}
              for family in text_string_to_metric_families(merge_metrics({"0": replica(3, 0.2), "1": replica(5, 0.6)}))}
    tokens = merged["pagedrag:prompt_tokens"]
    assert tokens[(("model_name", "m"), ("replica", "0"))] == 3 and tokens[(("model_name", "m"),)] == 8
    assert merged["pagedrag:kv_cache_usage_perc"][(("model_name", "m"),)] == pytest.approx(0.4)
    assert merged["pagedrag:kv_tier_capacity_bytes"][(("tier", "disk"),)] == 1 << 30
    assert merged["pagedrag:kv_tier_capacity_bytes"][(("tier", "host"),)] == 8


def test_merged_stats_sum_the_kv_tiers_traffic_and_share_the_disk():
    def replica(hits: int, load_s: float | None) -> dict:
        return {"prefix_cache_queries": 10, "prefix_cache_hits": hits, "block_size": 16, "kv_tiers": {
            "tiers": {"host": {"enabled": True, "used_bytes": hits, "capacity_bytes": 100, "dropped_files": 0},
                      "disk": {"enabled": True, "used_bytes": 500 + hits, "capacity_bytes": 1000,
                               "dropped_files": 1}},
            "hit_tokens": {"host": hits, "disk": 2 * hits}, "external_prefix_cache_queries": 10,
            "external_prefix_cache_hits": 3 * hits, "bytes": {"disk_to_device": hits}, "seconds": {},
            "cost_model": {"prefill_seconds_per_token": 0.001, "disk_load_seconds_per_block": load_s}}}

    merged = merge_stats({"0": replica(2, 0.01), "1": replica(4, None), "2": replica(6, 0.03)})
    tiers = merged["kv_tiers"]
    assert merged["prefix_cache_hits"] == 12 and merged["block_size"] == 16
    assert tiers["hit_tokens"] == {"host": 12, "disk": 24} and tiers["bytes"] == {"disk_to_device": 12}
    assert (tiers["external_prefix_cache_queries"], tiers["external_prefix_cache_hits"]) == (30, 36)
    assert tiers["tiers"]["host"] == {"enabled": True, "used_bytes": 12, "capacity_bytes": 300, "dropped_files": 0}
    assert tiers["tiers"]["disk"] == {"enabled": True, "used_bytes": 506, "capacity_bytes": 1000, "dropped_files": 3}
    assert tiers["cost_model"] == {"disk_load_seconds_per_block": pytest.approx(0.02),
                                   "prefill_seconds_per_token": 0.001}
    assert merged["replicas"]["1"]["kv_tiers"]["hit_tokens"] == {"host": 4, "disk": 8}


def test_summed_counters_never_go_down_when_a_replica_restarts_or_misses_a_scrape():
    def replica(tokens: float) -> str:
        registry = CollectorRegistry()
        Counter("pagedrag:prompt_tokens", "Prompt tokens.", registry=registry).inc(tokens)
        return generate_latest(registry).decode()

    def total(texts: dict[str, str]) -> float:
        families = text_string_to_metric_families(merge_metrics(texts, memory))
        return next(s.value for f in families for s in f.samples if s.name == "pagedrag:prompt_tokens_total"
                    and "replica" not in s.labels)

    memory = CumulativeMemory()
    assert total({"0": replica(6), "1": replica(4)}) == 10
    assert total({"0": replica(1), "1": replica(4)}) == 11  # replica 0 restarted: its 6 stay counted
    assert total({"1": replica(5)}) == 12  # replica 0 missed the scrape: its last value stays


def test_replica_command_line_keeps_every_flag_but_the_routers():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["some/model", "--max-model-len", "512", "--no-enable-prefix-caching",
                              "--api-key", "k1", "--api-key", "k2", "--served-model-name", "a", "b",
                              "--salt-by-api-key", "--data-parallel-size", "2", "--port", "9000",
                              "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    again = parser.parse_args(replica_argv(parser, args, ROUTER_DESTS))
    for name, value in vars(args).items():
        if name not in ROUTER_DESTS:
            assert getattr(again, name) == value, name
    assert again.data_parallel_size == 1 and again.port == 8000


def test_ray_application_settings_become_the_flags_they_name():
    """Typed values of a Ray Serve config file and `serve run key=value` strings alike."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = serve_argv({"model": "some/model", "served_model_name": ["alpha", "beta"], "api_key": ["k1", "k2"],
                       "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
                       "salt_by_api_key": False, "trust_request_chat_template": "true",
                       "enable_prefix_caching": "false", "max_model_len": None, "kv_disk_path": None,
                       "block_size": "32", "seed": None}, parser)
    args = parser.parse_args(argv)
    assert args.model == "some/model" and args.served_model_names == ["alpha", "beta"]
    assert args.api_keys == ["k1", "k2"] and args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert (args.salt_by_api_key, args.trust_request_chat_template, args.enable_prefix_caching) == (False, True, False)
    assert (args.max_model_len, args.kv_disk_path, args.block_size, args.seed) == (None, None, 32, 0)  # null: default
    for settings, refused in (({"port": 9999}, "'port' does nothing on Ray Serve"),
                              ({"data_parallel_size": 2}, "use num_replicas"),
                              ({"max_modle_len": 5}, "unknown setting 'max_modle_len'"),
                              ({"block_size": [16, 32]}, "'block_size' takes one value"),
                              ({"salt_by_api_key": "yes"}, "'salt_by_api_key' is on or off")):
        with pytest.raises(ValueError, match=refused):
            serve_argv(settings, parser)


def _fan_out(answers: dict[str, httpx.Response | Exception]) -> tuple[int, dict]:
    """warm_every_replica over fake replicas named as ``answers``' keys, each giving its answer
    (or raising it): the status and JSON body it answers with. Each replica is sent the caller's
    API key once, and no request is left counted in flight."""
    fakes = [SimpleNamespace(name=name, url=f"http://{name}", in_flight=0) for name in answers]
    keys = []

    def replica_side(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["authorization"])
        answer = answers[request.url.host]
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer.status_code, content=answer.content, headers=answer.headers)  # one each

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(replica_side)) as client:
            return await warm_every_replica(client, fakes, b"{}", {"authorization": "Bearer k"})

    response = asyncio.run(run())
    assert keys == ["Bearer k"] * len(answers) and all(fake.in_flight == 0 for fake in fakes)
    return response.status_code, json.loads(response.body)


def test_a_warm_up_through_the_router_is_every_replicas_answered_as_one():
    warmed = httpx.Response(200, json={"object": "warm", "prompts": 1, "prompt_tokens": 40, "cached_tokens": 16})
    refused = httpx.Response(400, json={"error": {"message": "give prompt", "type": "invalid_request_error"}})
    full = httpx.Response(503, json={"error": {"message": "queue full", "code": "queue_full"}})
    status, body = _fan_out({"a": warmed, "b": warmed})
    assert status == 200 and (body["prompts"], body["prompt_tokens"], body["cached_tokens"]) == (2, 80, 32)
    assert [(entry["replica"], entry["status"], entry["prompt_tokens"]) for entry in body["replicas"]] == \
        [("a", 200, 40), ("b", 200, 40)]
    status, body = _fan_out({"a": full, "b": warmed, "c": httpx.ConnectError("refused")})
    assert status == 200 and body["prompt_tokens"] == 40
    assert [(entry["replica"], entry["status"]) for entry in body["replicas"]] == [("a", 503), ("b", 200), ("c", 503)]
    assert body["replicas"][0]["error"]["code"] == "queue_full"
    assert "did not answer" in body["replicas"][2]["error"]["message"]
    status, body = _fan_out({"a": httpx.Response(502, text="Bad Gateway"), "b": warmed})  # not JSON: an error body
    assert status == 200 and body["replicas"][0]["error"]["message"] == "Bad Gateway"
    assert _fan_out({"a": warmed, "b": refused}) == (400, refused.json())  # a bad request is never a 200
    assert _fan_out({"a": full, "b": httpx.ReadError("died")}) == (503, full.json())  # none warmed


def _metric(url: str, name: str) -> dict[str, float]:
    """A counter per replica label ('' for the sum) from the router's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                values[sample.labels.get("replica", "")] = sample.value
    return values


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    disk = tmp_path_factory.mktemp("kv-disk")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "pagedrag", "serve", "--data-parallel-size", "2",
                                    "--port", str(port), "--max-model-len", "1024", "--log-level", "warning",
                                    "--kv-cache-memory-bytes", str(128 << 20), "--kv-disk-path", str(disk),
                                    "--kv-disk-size", "1"],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).json().get("replicas_up") == 2:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        process.kill()
        raise AssertionError(f"the router did not come up: {log.read_text()}")
    yield url, process
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0, log.read_text()[-2000:]  # drained: the replicas first, then it


def _ask(url: str, question: str, stream: bool = False) -> httpx.Response:
    body = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=600)


def test_requests_sharing_a_prefix_meet_its_cache(router):
    url, _ = router
    replies = [_ask(url, f"Question {i}: what does module {i} do?") for i in range(4)]
    assert all(r.status_code == 200 for r in replies)
    assert all(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in replies[1:])
    served = _metric(url, "pagedrag:prompt_tokens_total")
    assert sorted(v > 0 for k, v in served.items() if k) == [False, True]  # one replica took them all
    assert "data: [DONE]" in _ask(url, "Question: stream it", stream=True).text
    stats = httpx.get(url + "/v1/stats", timeout=30).json()
    assert stats["prompt_tokens_total"] == sum(r["prompt_tokens_total"] for r in stats["replicas"].values()) > 0
    assert stats["prefix_cache_hit_rate"] == stats["prefix_cache_hits"] / stats["prefix_cache_queries"]


def _replica_pids(process: subprocess.Popen) -> set[int]:
    """The router's child processes (a killed one stays listed until the router reaps it)."""
    children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    return {int(child) for child in children}


def _wait_for_both_replicas(url: str, process: subprocess.Popen, killed: set[int]) -> None:
    """Until the router has replaced every killed replica and reports two replicas up."""
    deadline = time.monotonic() + 240
    while _replica_pids(process) & killed or httpx.get(url + "/health", timeout=5).json()["replicas_up"] < 2:
        assert time.monotonic() < deadline, "a killed replica did not come back"
        time.sleep(0.5)


def test_a_killed_replica_is_restarted_and_no_request_is_lost(router):
    url, process = router
    children = _replica_pids(process)
    assert len(children) == 2
    killed = min(children)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_ask, url, f"Other question {i}?") for i in range(6)]
        time.sleep(1.0)
        os.kill(killed, signal.SIGKILL)
        statuses = [future.result().status_code for future in futures]
    assert statuses == [200] * 6
    _wait_for_both_replicas(url, process, {killed})


def _disk_hits(url: str) -> dict[str, int]:
    """The prompt tokens each replica has loaded from the disk tier, by replica name."""
    replicas = httpx.get(url + "/v1/stats", timeout=30).json()["replicas"]
    return {name: stats["kv_tiers"]["hit_tokens"].get("disk", 0) for name, stats in replicas.items()}


def test_a_warm_up_through_the_router_fills_every_replicas_pool(router):
    """POST /v1/warm through the router runs on both replicas; then both pools hold the
    prompt: warming it again, each replica finds it cached without a block from the disk, and
    a chat of the same conversation, whichever replica takes it, is a pool hit."""
    url, _ = router
    conversation = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Which module compresses and decompresses gzip files? " * 8}]
    warmed = httpx.post(url + "/v1/warm", json={"conversations": [conversation]}, timeout=600)
    assert warmed.status_code == 200, warmed.text
    body = warmed.json()
    assert [(entry["replica"], entry["status"], entry["prompts"]) for entry in body["replicas"]] == \
        [("0", 200, 1), ("1", 200, 1)]
    assert body["prompt_tokens"] == 2 * body["replicas"][0]["prompt_tokens"] > 64
    disk_before = _disk_hits(url)
    again = httpx.post(url + "/v1/warm", json={"conversations": [conversation]}, timeout=600)
    assert again.status_code == 200, again.text
    assert all(entry["cached_tokens"] >= 64 for entry in again.json()["replicas"]), again.text
    assert _disk_hits(url) == disk_before
    reply = httpx.post(url + "/v1/chat/completions", json={"max_tokens": 2, "temperature": 0,
                                                          "messages": conversation}, timeout=600)
    details = reply.json()["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] >= 64 and details["tier_cache_hits"].get("disk", 0) == 0, details


def test_a_bad_warm_up_through_the_router_is_a_400(router):
    url, _ = router
    both_forms = {"prompt": "x", "conversations": [[{"role": "user", "content": "x"}]]}
    for body in ({}, both_forms):
        reply = httpx.post(url + "/v1/warm", json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["type"] == "invalid_request_error"


def test_replicas_started_after_a_warm_up_load_its_kv_from_the_shared_disk_tier(router):
    """POST /v1/warm answers once the disk tier holds the prompt's blocks; both replicas are
    then killed and restarted (empty pools), and the same prompt is served from the disk,
    whichever replica takes it: the process that computed it is gone."""
    url, process = router
    conversation = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Which module reads and writes ZIP archives? " * 8}]
    warmed = httpx.post(url + "/v1/warm", json={"conversations": [conversation]}, timeout=600)
    assert warmed.status_code == 200, warmed.text
    killed = _replica_pids(process)
    assert len(killed) == 2
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    _wait_for_both_replicas(url, process, killed)
    body = {"max_tokens": 2, "temperature": 0, "messages": conversation}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    assert reply.status_code == 200, reply.text
    details = reply.json()["usage"]["prompt_tokens_details"]
    assert details["tier_cache_hits"].get("disk", 0) >= 64, details
    assert details["cached_tokens"] >= details["tier_cache_hits"]["disk"]


def test_the_integrations_reach_the_replicas_through_base_url(router):
    """LangChain's and LlamaIndex's clients point at the router as at one server; the cached
    tokens they report are those of the replica that served them."""
    langchain = pytest.importorskip("langchain_pagedrag")
    llama_index = pytest.importorskip("llama_index.llms.pagedrag")
    url, _ = router
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    chat = langchain.ChatPagedRAG(base_url=url, model=model, max_tokens=2)
    messages = [("system", SYSTEM), ("human", "Which module parses JSON?")]
    chat.invoke(messages)
    reply = chat.invoke(messages)
    assert reply.usage_metadata["input_token_details"]["cache_read"] == reply.response_metadata["cached_tokens"] > 0
    llm = llama_index.PagedRAG(base_url=url, model=model, max_new_tokens=2)
    llm.complete(SYSTEM + "Which module parses JSON?")
    again = llm.complete(SYSTEM + "Which module parses JSON?")
    assert again.raw["usage"]["prompt_tokens_details"]["cached_tokens"] == again.additional_kwargs["cached_tokens"] > 0
