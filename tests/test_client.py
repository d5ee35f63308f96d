"""pagedrag.client: the in-process and remote back ends give the same answers and figures
(KV-tier hits included), the remote one through the openai SDK (extras in extra_body, stats
from /v1/stats, retries on the server's 503), and the synchronous bridge. One engine (with
a host-memory KV tier) serves both back ends."""

from __future__ import annotations

import asyncio
import time

import pytest
from openai.types import CompletionUsage

from pagedrag.client import (EngineClient, Generation, InProcessClient, RemoteClient, RemoteError, connect,
                             iterate_sync, run_sync)
from pagedrag.client.remote import _with_usage
from pagedrag.engine.recovery import EngineDeadError
from pagedrag.deltas import ChoiceCursor
from pagedrag.outputs import CompletionOutput
from pagedrag.sampling_params import SamplingParams
from pagedrag.server.app import build_app
from pagedrag.server.background import BackgroundServer
from pagedrag.server.serving import ServerConfig
from pagedrag.worker.fork_trial import exit_code_in_a_fork

# with a small host-memory KV tier, whose hits the tier test below reads
ENGINE_KWARGS = {"max_model_len": 512, "num_gpu_blocks_override": 128, "max_num_seqs": 16, "seed": 0,
                 "kv_offloading_size": 0.05}
KEY = "client-key"
MESSAGES = [{"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}]
# ~80 tokens: four full 16-token blocks that a second request finds in the cache
PREFIX = ("You answer questions about the solar system using only the context below. Context: The Sun "
          "holds 99.8 percent of the mass of the solar system. Mercury is the closest planet to the Sun "
          "and has no moons. Venus rotates backwards and has the hottest surface. Earth is the only "
          "planet known to have liquid water on its surface. Mars has two small moons. ")


def _greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, **{"max_tokens": 8, **extra})


@pytest.fixture(scope="module")
def local() -> InProcessClient:
    return connect(engine_kwargs=ENGINE_KWARGS)


@pytest.fixture(scope="module")
def engine(local):
    return local.shared.engine


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(build_app(engine, ServerConfig(served_model_names=["smol"], api_keys=[KEY]))) as server:
        yield server


@pytest.fixture(scope="module")
def remote(server) -> RemoteClient:
    return connect(base_url=server.base_url, api_key=KEY, max_retries=0)


def _wait_idle(engine, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_in_flight == 0


# ---- the two back ends agree -------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["The capital of France is", MESSAGES])
def test_remote_answers_equal_in_process_answers(local, remote, prompt):
    params = _greedy()
    here, there = (client.batch([prompt], params)[0] for client in (local, remote))
    assert (here.text, here.finish_reason, here.prompt_tokens, here.completion_tokens) == \
           (there.text, there.finish_reason, there.prompt_tokens, there.completion_tokens)


@pytest.mark.parametrize("client_name", ["local", "remote"])
def test_stream_adds_up_to_the_whole_with_a_stop_string(request, client_name):
    """The output processor alone holds back text that may start a stop string: streamed
    pieces join to the whole completion, which ends before the stop string."""
    client: EngineClient = request.getfixturevalue(client_name)
    free = client.complete("1, 2, 3, 4,", _greedy(max_tokens=12)).text
    stop = free.strip().split()[1]  # a word the model writes after the first
    whole = client.complete("1, 2, 3, 4,", _greedy(max_tokens=12, stop=[stop]))
    pieces = list(client.stream_complete("1, 2, 3, 4,", _greedy(max_tokens=12, stop=[stop])))
    assert whole.text == free[:free.index(stop)] and whole.finish_reason == "stop"
    assert "".join(p.text for p in pieces) == whole.text
    assert pieces[-1].finish_reason == "stop" and pieces[-1].prompt_tokens == whole.prompt_tokens
    assert all(p.finish_reason is None and p.prompt_tokens == 0 for p in pieces[:-1])


@pytest.mark.parametrize("kind", ["DELTA", "FINAL_ONLY"])
def test_the_engines_streams_follow_output_kind(engine, local, kind):
    """vLLM's output_kind on the async engine: DELTA pieces join to the cumulative output (tokens,
    text, logprobs); FINAL_ONLY yields the finished output alone. The client reads the engine
    cumulatively whatever its caller's parameters say."""
    async def outputs(output_kind: str):
        params = _greedy(max_tokens=12, ignore_eos=True, logprobs=1, output_kind=output_kind)
        return [output async for output in engine.generate(PREFIX, params)]

    whole = asyncio.run(outputs("CUMULATIVE"))[-1].outputs[0]
    streamed = asyncio.run(outputs(kind))
    assert streamed[-1].finished and streamed[-1].outputs[0].finish_reason == whole.finish_reason
    if kind == "FINAL_ONLY":
        assert len(streamed) == 1 and streamed[0].outputs[0].token_ids == whole.token_ids
    else:
        pieces = [o.outputs[0] for o in streamed]
        assert [t for p in pieces for t in p.token_ids] == whole.token_ids
        assert "".join(p.text for p in pieces) == whole.text
        assert [e for p in pieces for e in p.logprobs] == whole.logprobs
    assert local.complete(PREFIX, _greedy(max_tokens=12, ignore_eos=True, output_kind=kind)).text == whole.text


@pytest.mark.parametrize("client_name", ["local", "remote"])
def test_cache_salt_keeps_prefixes_apart(request, client_name):
    """The salt reaches the engine (remotely: in extra_body): the same prompt under another
    salt starts cold."""
    client: EngineClient = request.getfixturevalue(client_name)
    prompt = PREFIX + "Which planet has two moons?"
    client.complete(prompt, _greedy(max_tokens=1), cache_salt=f"{client_name}-a")
    warm = client.complete(prompt, _greedy(max_tokens=1), cache_salt=f"{client_name}-a")
    cold = client.complete(prompt, _greedy(max_tokens=1), cache_salt=f"{client_name}-b")
    assert warm.cached_tokens >= 64 and cold.cached_tokens == 0


@pytest.mark.parametrize("client_name", ["local", "remote"])
def test_chunks_without_chunk_reuse_change_nothing(request, client_name):
    """An engine without chunk reuse takes ``chunks=`` (remotely: prompt_chunks) and ignores
    them: the same answer, and no chunk figures."""
    client: EngineClient = request.getfixturevalue(client_name)
    prompt, chunk = PREFIX + "Which planet has no moons?", PREFIX[PREFIX.index("Mercury"):]
    plain = client.complete(prompt, _greedy(max_tokens=2))
    chunked = client.complete(prompt, _greedy(max_tokens=2), chunks=[chunk])
    assert (chunked.text, chunked.prompt_tokens) == (plain.text, plain.prompt_tokens)
    assert chunked.chunk_cache_hits == chunked.chunk_tokens_recomputed == 0
    assert chunked.prompt_tokens_computed == chunked.prompt_tokens - chunked.cached_tokens
    assert chunked.usage()["prompt_tokens_details"]["prompt_tokens_computed"] == chunked.prompt_tokens_computed


def test_both_back_ends_report_the_tier_hits_the_engine_counted(local, remote):
    """Once the pool has forgotten a warmed prompt, its blocks come from the host tier: both
    back ends report them in the same fields, as the engine's own tier counters have them."""
    prompt = PREFIX + "Which planet has the hottest surface?"
    local.warm(prompt, cache_salt="tiers")
    served_before = local.stats()["kv_tiers"]["hit_tokens"].get("host", 0)
    replies = []
    for client in (local, remote):
        local.reset_prefix_cache()
        replies.append(client.complete(prompt, _greedy(max_tokens=1), cache_salt="tiers"))
    here, there = replies
    assert here.cached_tokens == there.cached_tokens >= 64
    assert here.tier_cache_hits == there.tier_cache_hits == {"host": here.cached_tokens, "disk": 0}
    assert local.stats()["kv_tiers"]["hit_tokens"]["host"] - served_before == 2 * here.cached_tokens
    assert there.usage()["prompt_tokens_details"]["tier_cache_hits"] == there.tier_cache_hits


def test_a_server_without_tier_figures_reports_zeros():
    """The SDK keeps the server's tier_cache_hits; an older server (no such key, or no
    prompt_tokens_details at all) gives every tier 0, without an error."""
    counts = {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}
    usages = [{**counts, "prompt_tokens_details": {"cached_tokens": 32, "tier_cache_hits": {"disk": 32}}},
              {**counts, "prompt_tokens_details": {"cached_tokens": 32}}, counts]
    hits = [_with_usage(Generation(""), CompletionUsage.model_validate(usage)).tier_cache_hits for usage in usages]
    assert hits == [{"host": 0, "disk": 32}, {"host": 0, "disk": 0}, {"host": 0, "disk": 0}]


def test_stats_and_info(local, remote):
    """Remote stats come from the server's JSON /v1/stats, keyed as in process."""
    local.complete("Hello", _greedy(max_tokens=1))
    here, there = local.stats(), remote.stats()
    assert here.keys() == there.keys() and there["prefix_cache_queries"] > 0
    assert (there["max_model_len"], there["block_size"]) == (here["max_model_len"], here["block_size"])
    assert remote.info().model_name == "smol"
    assert remote.info().max_model_len == local.info().max_model_len == ENGINE_KWARGS["max_model_len"]


# ---- errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("client_name", ["local", "remote"])
def test_bad_input_is_a_value_error(request, client_name):
    client: EngineClient = request.getfixturevalue(client_name)
    with pytest.raises(ValueError, match="max_model_len"):
        client.complete("word " * 600, _greedy())
    with pytest.raises(ValueError, match="max_model_len"):
        list(client.stream_chat([{"role": "user", "content": "word " * 600}], _greedy()))
    with pytest.raises(ValueError, match="content must be a string"):  # inputs.check_conversation's rule
        client.chat([{"role": "user", "content": 3}], _greedy())
    with pytest.raises(ValueError, match="one completion per prompt"):
        client.complete("Hi", _greedy(n=2))


def test_remote_errors_are_typed(server):
    with pytest.raises(RemoteError) as wrong_key:
        connect(base_url=server.base_url, api_key="wrong", max_retries=0).complete("Hi", _greedy())
    with pytest.raises(RemoteError) as unknown_model:
        connect("gpt-9", base_url=server.base_url + "/v1", api_key=KEY, max_retries=0).complete("Hi", _greedy())
    with pytest.raises(RemoteError) as unreachable:
        connect(base_url="http://127.0.0.1:9", max_retries=0, timeout=5).complete("Hi", _greedy())
    assert (wrong_key.value.status_code, unknown_model.value.status_code, unreachable.value.status_code) == \
           (401, 404, None)


def test_remote_retries_while_the_queue_is_full(engine, remote):
    """The server answers 503 while --max-queue is reached; the SDK retries with backoff."""
    config = ServerConfig(served_model_names=["smol"], api_keys=[KEY], max_queue=1)
    with BackgroundServer(build_app(engine, config)) as small:
        patient = connect(base_url=small.base_url, api_key=KEY, max_retries=8)
        impatient = connect(base_url=small.base_url, api_key=KEY, max_retries=0)
        long_run = patient.stream_complete("Count:", _greedy(max_tokens=48, ignore_eos=True))
        next(long_run)  # in flight: the queue is full
        with pytest.raises(RemoteError) as refused:
            impatient.complete("Hi", _greedy(max_tokens=1))
        assert refused.value.status_code == 503 and "max-queue" in str(refused.value)
        waiting = asyncio.run(_later(patient.acomplete("Hi", _greedy(max_tokens=1)), long_run))
        assert waiting.completion_tokens == 1


async def _later(call, long_run):
    """Start ``call`` (refused at first), then finish the long run so that a retry gets in."""
    task = asyncio.ensure_future(call)
    await asyncio.sleep(0.2)
    await asyncio.to_thread(list, long_run)
    return await task


# ---- the synchronous bridge -------------------------------------------------------------------
def test_sync_calls_work_inside_a_running_event_loop(local):
    async def notebook_cell():
        return local.complete("The capital of France is", _greedy(max_tokens=2))

    assert asyncio.run(notebook_cell()).text == local.complete("The capital of France is", _greedy(max_tokens=2)).text


def test_sync_call_on_the_bridge_thread_is_refused():
    async def nested():
        return run_sync(asyncio.sleep(0))

    with pytest.raises(RuntimeError):
        run_sync(nested())


def test_leaving_a_sync_stream_early_aborts_the_request(local, engine):
    stream = local.stream_complete("Tell me a long story:", _greedy(max_tokens=300, ignore_eos=True))
    next(stream)
    stream.close()
    _wait_idle(engine, timeout=10)
    stats = local.stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def test_iterate_sync_raises_the_iterators_error():
    async def failing():
        yield 1
        raise KeyError("gone")

    items = iterate_sync(failing())
    assert next(items) == 1
    with pytest.raises(KeyError):
        next(items)


def test_remote_async_calls_from_several_event_loops(remote):
    """Each event loop gets its own pooled SDK client (connections belong to their loop)."""
    first = asyncio.run(remote.acomplete("Hi", _greedy(max_tokens=2)))
    second = asyncio.run(remote.acomplete("Hi", _greedy(max_tokens=2)))
    assert first.text == second.text and first.completion_tokens == second.completion_tokens == 2


# ---- one engine batch --------------------------------------------------------------------------
def test_a_salted_batch_is_one_engine_batch(local, monkeypatch):
    """Prompts processed on the caller's side (salt included) enter the engine together."""
    engine = local.shared.engine.engine  # observed, not driven
    events = []
    add_request, step = engine.add_request, engine.step
    monkeypatch.setattr(engine, "add_request", lambda *a, **k: events.append("add") or add_request(*a, **k))
    monkeypatch.setattr(engine, "step", lambda: events.append("step") or step())
    prompts = [f"What is {n} plus {n}?" for n in range(1, 5)]
    local.batch(prompts, _greedy(max_tokens=2), cache_salt="batch")
    assert events[:len(prompts)] == ["add"] * len(prompts) and "add" not in events[len(prompts):]


# ---- deltas ------------------------------------------------------------------------------------
def test_choice_cursor_sends_everything_it_is_given():
    """No second hold-back: text the output processor released is sent at once."""
    cursor = ChoiceCursor(0)
    first = cursor.advance(CompletionOutput(0, "Hello wor", [1, 2]), wants_logprobs=False)
    assert (first.text, first.token_ids, first.finish_reason) == ("Hello wor", [1, 2], None)
    assert cursor.advance(CompletionOutput(0, "Hello wor", [1, 2, 3]), wants_logprobs=False) is None
    last = cursor.advance(CompletionOutput(0, "Hello world", [1, 2, 3, 4], finish_reason="stop",
                                           stop_reason="!"), wants_logprobs=False)
    assert (last.text, last.text_start, last.token_ids, last.finish_reason, last.stop_reason) == \
           ("ld", 9, [3, 4], "stop", "!")
    assert cursor.advance(CompletionOutput(0, "Hello world", [1, 2, 3, 4], finish_reason="stop"), False) is None


def test_warm_takes_texts_and_conversations_and_sends_a_server_what_one_call_holds(monkeypatch):
    """Anything else is a TypeError (a prompt dict would be warmed key by key); a long list goes
    to a server in calls of at most its MAX_PROMPTS_PER_REQUEST prompts."""
    from pagedrag.client import WarmSummary
    from pagedrag.server.protocol import MAX_PROMPTS_PER_REQUEST

    client = connect(base_url="http://127.0.0.1:9", max_retries=0)
    for bad in ({"prompt": "Hello"}, None, 5):
        with pytest.raises(TypeError, match="warm takes a text or a sequence of texts and conversations"):
            client.warm(bad)
    sent = []

    async def post_warm(body):
        batch = body.get("prompt") or body["conversations"]
        sent.append(len(batch))
        return WarmSummary(len(batch), 0, 0)

    async def model_name():
        return "m"

    monkeypatch.setattr(client, "_post_warm", post_warm)
    monkeypatch.setattr(client, "_model_name", model_name)
    conversation = [{"role": "user", "content": "Hello"}]
    summary = client.warm(["Hello"] * (2 * MAX_PROMPTS_PER_REQUEST + 3) + [conversation])
    assert sent == [MAX_PROMPTS_PER_REQUEST, MAX_PROMPTS_PER_REQUEST, 3, 1]
    assert summary.prompts == 2 * MAX_PROMPTS_PER_REQUEST + 4


def test_engine_arguments_that_are_dicts_name_one_shared_engine(monkeypatch):
    """speculative_config is a dict (or its JSON text): the integrations pass it through."""
    from pagedrag.client import inprocess

    monkeypatch.setattr(inprocess, "SharedEngine", lambda args: object())
    monkeypatch.setattr(inprocess, "_engines", {})
    config = {"method": "ngram", "num_speculative_tokens": 4}
    first = inprocess.shared_engine(None, {"speculative_config": config})
    assert inprocess.shared_engine(None, {"speculative_config": dict(reversed(config.items()))}) is first
    assert inprocess.shared_engine(None, {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 4}'}) is first
    assert inprocess.shared_engine(None, {"speculative_config": {**config, "num_speculative_tokens": 2}}) is not first


# ---- truncate_prompt_tokens and exit with work in flight ---------------------------------
LONG_TEXT = "hello " * 600  # ~600 tokens: more than the engine's max_model_len (512)


@pytest.mark.parametrize("client_name", ["local", "remote"])
@pytest.mark.parametrize("prompt", [LONG_TEXT, [{"role": "user", "content": LONG_TEXT}]], ids=["text", "chat"])
def test_truncate_prompt_tokens_cuts_a_too_long_prompt_before_its_length_is_checked(request, client_name, prompt):
    """As vLLM: the last 100 tokens are kept, then checked (in process, and by the server's
    /v1/completions and /v1/chat/completions); without truncation the prompt is refused."""
    client: EngineClient = request.getfixturevalue(client_name)
    assert client.generate(prompt, _greedy(max_tokens=2, truncate_prompt_tokens=100)).prompt_tokens == 100
    with pytest.raises((ValueError, RemoteError), match="max_model_len|maximum context length|512"):
        client.generate(prompt, _greedy(max_tokens=2))


_EXIT_IN_FLIGHT = """
import threading, time
from pagedrag.client import connect
from pagedrag.sampling_params import SamplingParams
client = connect(engine_kwargs={engine_kwargs!r})
params = SamplingParams(max_tokens=400, ignore_eos=True)
threading.Thread(target=lambda: client.generate("Tell me a long story", params), daemon=True).start()
while client.shared.engine.num_in_flight == 0:
    time.sleep(0.01)
time.sleep(0.3)
print("exiting while the engine generates", flush=True)
"""


@pytest.mark.parametrize("tiers", [False, True], ids=["no tier", "disk tier"])
def test_exit_with_a_request_in_flight_is_clean(tiers, tmp_path):
    """The shared engines are shut down at exit (their threads joined before torch tears
    down): the process ends with its own exit status, not an abort, and the engine's thread
    raises nothing (the disk tier's close ran after the interpreter had stopped taking new
    thread work). The request in flight is cancelled: the script's own thread says so."""
    import subprocess
    import sys

    engine_kwargs = {"max_model_len": 512, "num_gpu_blocks_override": 64}
    if tiers:
        engine_kwargs["kv_disk_path"] = str(tmp_path)
    script = _EXIT_IN_FLIGHT.replace("{engine_kwargs!r}", repr(engine_kwargs))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "exiting while the engine generates" in done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr and "Exception in thread pagedrag" not in done.stderr, \
        done.stderr[-2000:]


def test_shutdown_shared_engines_frees_them_and_later_clients_load_anew():
    """Run last in this module: it shuts down the module's shared engine too."""
    from pagedrag.client import shutdown_shared_engines
    from pagedrag.engine.recovery import EngineDeadError

    first = connect(engine_kwargs=ENGINE_KWARGS)
    assert shutdown_shared_engines() >= 1
    with pytest.raises(EngineDeadError):
        first.generate("Hello", _greedy(max_tokens=2))
    second = connect(engine_kwargs=ENGINE_KWARGS)
    assert second.shared is not first.shared
    assert second.generate("Hello", _greedy(max_tokens=2)).text
    assert shutdown_shared_engines() == 1



def test_a_forked_child_is_told_its_inherited_engine_is_the_parents():
    """gunicorn --preload, Celery prefork: a child forked after the parent used the engine. Its
    copy of the engine can run nothing (its threads stayed in the parent): calls fail at once
    with EngineDeadError saying so (they waited forever), and sync calls still work there;
    a client made in the child loads an engine of its own and answers."""
    local = connect(engine_kwargs=ENGINE_KWARGS)  # the module's, unless a test above shut it down
    local.complete("Hello", _greedy(max_tokens=2))  # the portal and the engine's threads are running

    def in_the_child() -> int:
        try:
            local.complete("Hello", _greedy(max_tokens=2))
            return 1
        except EngineDeadError as error:
            if "forked" not in str(error) or run_sync(asyncio.sleep(0, "ok")) != "ok":
                return 2
        # a client made here loads an engine of its own, which computes (it hung loading)
        return 0 if connect(engine_kwargs=ENGINE_KWARGS).complete("Hello", _greedy(max_tokens=2)).text else 3

    assert exit_code_in_a_fork(in_the_child, timeout_s=120) == 0
    assert local.complete("Hello", _greedy(max_tokens=2)).text  # the parent goes on
