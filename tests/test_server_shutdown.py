"""`pagedrag serve` on SIGTERM: a bounded drain (in-flight requests end with finish_reason
"abort" after --shutdown-timeout, exit 0), a second signal exits at once, an idle server
exits promptly. Each of those runs its own `python -m pagedrag serve` subprocess (all
three start together); DrainingServer's timing and the server flags are also checked
in-process, without a model."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedrag.server import cli
from pagedrag.server.background import free_port
from pagedrag.server.serving import ServerConfig
from pagedrag.server import shutdown
from pagedrag.server.shutdown import ABORT_DRAIN_S, ABORT_REASON, SAME_SIGNAL_S, DrainingServer

# 64 blocks of 16 tokens: two sequences of 512 fit, and on CPU a long one takes far longer
# than the grace periods below (tokens come at tens per second)
ENGINE_FLAGS = ["--max-model-len", "512", "--num-gpu-blocks-override", "64", "--max-num-seqs", "4"]
LONG = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
GRACE = 2.0
SERVERS = {  # name: flags; all start at once (loading the model dominates: ~10 s each on 2 cores)
    "drain": ["--shutdown-timeout", str(GRACE)],
    "force": ["--shutdown-timeout", "30"],
    "idle": [],
}


class Serve:
    """One `python -m pagedrag serve` subprocess, its output in ``log``."""

    def __init__(self, log: Path, flags: list[str]):
        self.port = free_port()
        self.log = log
        # one torch thread each: three servers load at once, and on 2 cores more threads only
        # contend (loading got about twice as slow); slow generation suits these tests anyway
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pagedrag", "serve", "--port", str(self.port), *ENGINE_FLAGS, *flags],
                stdout=out, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120.0) -> "Serve":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                httpx.get(self.url + "/health", timeout=2).raise_for_status()
                return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError(f"serve did not come up: {self.log.read_text()}")

    def signal_and_time_exit(self, sig: int, timeout: float) -> tuple[int, float]:
        """Send ``sig``; (exit status, seconds until the process was gone)."""
        start = time.monotonic()
        self.process.send_signal(sig)
        status = self.process.wait(timeout=timeout)
        return status, time.monotonic() - start

    def output(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve")
    started = {name: Serve(logs / f"{name}.log", flags) for name, flags in SERVERS.items()}
    yield started
    for serve in started.values():
        if serve.process.poll() is None:
            serve.process.kill()
            serve.process.wait()


class Stream(threading.Thread):
    """A streaming completion read in the background: ``events`` (parsed JSON, or
    "[DONE]"), ``error`` if the connection broke; ``started`` is set at the first event."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.events: list = []
        self.error: Exception | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=LONG | {"stream": True},
                              timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        except httpx.HTTPError as error:
            self.error = error
        finally:
            self.started.set()

    def finish_reason(self) -> str | None:
        reasons = [c["finish_reason"] for e in self.events if e != "[DONE]" for c in e["choices"]]
        return reasons[-1] if reasons else None


class Whole(threading.Thread):
    """A non-streaming completion in the background: ``body`` once it returns."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.body: dict | None = None

    def run(self) -> None:
        self.body = httpx.post(self.url + "/v1/completions", json=LONG, timeout=60).json()


def _refused(url: str, timeout: float = 3.0) -> bool:
    """Whether a new request soon meets a closed port (the shutdown starts within 0.1 s
    of the signal, as uvicorn's main loop notices it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=2)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            pass  # accepted just before the listener closed, then dropped
        time.sleep(0.1)
    return False


def _start_and_wait_for_streams(url: str, *requests: threading.Thread, timeout: float = 60.0) -> None:
    """Start the requests; return once each stream has its first event (the engine is
    generating for it) and the engine holds every request (the server's /v1/stats says so)."""
    for request in requests:
        request.start()
    deadline = time.monotonic() + timeout
    for request in requests:
        if isinstance(request, Stream):
            assert request.started.wait(max(deadline - time.monotonic(), 0)), "the stream did not start"
    while _requests_in_engine(url) < len(requests):
        assert time.monotonic() < deadline, f"the engine never held all {len(requests)} requests"
        time.sleep(0.05)


def _requests_in_engine(url: str) -> int:
    stats = httpx.get(url + "/v1/stats", timeout=30).json()
    return stats["num_requests_running"] + stats["num_requests_waiting"]


def test_sigterm_drains_then_aborts_within_the_grace_period(servers):
    """In-flight requests get GRACE seconds, then end with "abort" (or "length" had they
    finished); no new connection is accepted meanwhile; the exit status is 0."""
    serve = servers["drain"].wait_ready()
    stream, whole = Stream(serve.url), Whole(serve.url)
    _start_and_wait_for_streams(serve.url, stream, whole)
    start = time.monotonic()
    serve.process.send_signal(signal.SIGTERM)
    assert _refused(serve.url)
    status = serve.process.wait(timeout=GRACE + 10)
    elapsed = time.monotonic() - start
    stream.join(10)
    whole.join(10)
    log = serve.output()
    assert status == 0, log
    assert elapsed >= GRACE * 0.9 or stream.finish_reason() == "length", elapsed
    assert stream.error is None and stream.events[-1] == "[DONE]", (stream.error, stream.events[-2:])
    assert stream.finish_reason() in ("abort", "length")
    assert whole.body is not None, "the non-streaming request got no response"
    assert [c["finish_reason"] for c in whole.body["choices"]] in (["abort"], ["length"]), whole.body
    in_flight = re.search(r"shutting down: (\d+) HTTP requests in flight", log)
    assert in_flight and int(in_flight[1]) >= 2, log  # more if a probe of _refused got in first
    if stream.finish_reason() == "abort":
        assert "grace period ran out" in log
    assert "Traceback" not in log


def test_second_sigterm_exits_at_once(servers):
    """While a 30 s drain waits on a stream, a second SIGTERM ends the process in < 2 s."""
    serve = servers["force"].wait_ready()
    stream = Stream(serve.url)
    _start_and_wait_for_streams(serve.url, stream)
    serve.process.send_signal(signal.SIGTERM)
    assert _refused(serve.url), "the first SIGTERM did not start the shutdown"
    assert serve.process.poll() is None, "the first SIGTERM must drain, not exit"
    time.sleep(SAME_SIGNAL_S)  # (sooner, it is the same stop sent twice)
    status, elapsed = serve.signal_and_time_exit(signal.SIGTERM, timeout=20)
    assert elapsed < 10.0, elapsed  # at once, where the drain would wait 30 s
    assert status == 128 + signal.SIGTERM, serve.output()
    assert "SIGTERM received while shutting down: exiting now" in serve.output()


def test_sigterm_on_an_idle_server_exits_promptly(servers):
    serve = servers["idle"].wait_ready()
    status, elapsed = serve.signal_and_time_exit(signal.SIGTERM, timeout=30)
    assert status == 0, serve.output()
    assert elapsed < 20.0, elapsed  # its 30 s grace period was not waited for: nothing was in flight
    assert "grace period ran out" not in serve.output()


# ---- DrainingServer in-process, with a stand-in engine (no model) -----------------------
class FakeEngine:
    """abort_all() releases the app's requests, as the real one ends engine requests."""

    def __init__(self):
        self.reasons: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.release: asyncio.Event | None = None
        self.num_in_flight = 0

    def abort_all(self, reason: str) -> None:  # called on the server's loop; thread-safe anyway
        self.reasons.append(reason)
        self.loop.call_soon_threadsafe(self.release.set)


def _app(engine: FakeEngine):
    """Answers "aborted" once engine.abort_all() ran."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        engine.loop, engine.release = asyncio.get_running_loop(), engine.release or asyncio.Event()
        engine.num_in_flight += 1
        await engine.release.wait()
        engine.num_in_flight -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"aborted"})

    return app


def test_draining_server_aborts_after_the_grace_period():
    engine = FakeEngine()
    server = DrainingServer(_app(engine), engine, 0.5, port=free_port(), log_level="warning", lifespan="off")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.config.port}/"
    answers: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answers.append(httpx.get(url, timeout=10)), daemon=True)
    request.start()
    while not server.server_state.tasks:
        time.sleep(0.01)
    start = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)  # what the signal would do (signals need the main thread)
    thread.join(10)
    elapsed = time.monotonic() - start
    request.join(5)
    assert not thread.is_alive()
    assert 0.5 <= elapsed < 0.5 + ABORT_DRAIN_S, elapsed  # the grace period, not the backstop after it
    assert engine.reasons and set(engine.reasons) == {ABORT_REASON}
    assert answers[0].text == "aborted"


def test_a_second_signal_exits_at_once(monkeypatch):
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    clock = [100.0]  # a clock of the test's own
    monkeypatch.setattr(shutdown.time, "monotonic", lambda: clock[0])
    engine = FakeEngine()
    server = DrainingServer(_app(engine), engine, 30.0)
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and exits == []
    clock[0] += SAME_SIGNAL_S / 2
    server.handle_exit(signal.SIGTERM, None)  # within SAME_SIGNAL_S: the same stop, sent twice
    assert exits == []
    clock[0] += SAME_SIGNAL_S
    server.handle_exit(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT]


def test_the_grace_period_is_bounded_by_uvicorns_backstop():
    engine = FakeEngine()
    server = DrainingServer(_app(engine), engine, 2.0)
    assert server.config.timeout_graceful_shutdown == 2.0 + ABORT_DRAIN_S
    with pytest.raises(ValueError):
        DrainingServer(_app(engine), engine, -1.0)


# ---- the flags (no server) ----------------------------------------------------------
def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_server_flags_defaults_match_server_config():
    args = _parse()
    config = cli.server_config_from(args, "m")
    defaults = ServerConfig(served_model_names=["m"])
    assert args.shutdown_timeout == 30.0
    assert dataclasses.asdict(config) == dataclasses.asdict(defaults)
    assert config.max_request_bytes == 4194304 and config.trust_request_chat_template is False


def test_server_flags_reach_server_config():
    args = _parse("--max-request-bytes", "1024", "--trust-request-chat-template", "--shutdown-timeout", "0")
    config = cli.server_config_from(args, "m")
    assert (config.max_request_bytes, config.trust_request_chat_template) == (1024, True)
    assert args.shutdown_timeout == 0.0


@pytest.mark.parametrize("argv", [["--shutdown-timeout", "-1"], ["--shutdown-timeout", "inf"],
                                  ["--shutdown-timeout", "nan"], ["--max-request-bytes", "0"]])
def test_server_flags_refuse_bad_values(argv, capsys):
    with pytest.raises(SystemExit):
        _parse(*argv)


@pytest.mark.parametrize("argv", [["--api-key", ""], ["--api-key", "k", "--api-key", "  "]])
def test_an_empty_api_key_is_refused(argv, capsys):
    """An empty key (--api-key "$UNSET") matched requests that sent no key at all."""
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert "argument --api-key: is empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="an API key is empty"):
        ServerConfig(served_model_names=["m"], api_keys=["k", ""])


def test_optional_engine_flags_take_none_and_the_model_its_flag():
    args = _parse("--model", "some/model", "--seed", "None", "--max-model-len", "none", "--hf-token", "True")
    engine_args = cli.engine_args_from(args)
    assert (engine_args.model, engine_args.seed, engine_args.max_model_len, engine_args.hf_token) == \
        ("some/model", None, None, True)
    assert cli.engine_args_from(_parse("--hf-token", "hf_abc")).hf_token == "hf_abc"
    with pytest.raises(ValueError, match="two models given"):
        cli.engine_args_from(_parse("a/model", "--model", "b/model"))
    with pytest.raises(ValueError, match="seed must be a 64-bit integer"):
        cli.engine_args_from(_parse("--seed", str(2 ** 70)))


def test_an_address_the_server_cannot_listen_on_is_named_before_the_engine_loads():
    with pytest.raises(OSError, match="cannot listen on --host bogus.invalid --port 8000"):
        cli.check_can_listen("bogus.invalid", 8000)
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(OSError, match=f"cannot listen on --host 127.0.0.1 --port {port}"):
            cli.check_can_listen("127.0.0.1", port)
    cli.check_can_listen("127.0.0.1", port)
