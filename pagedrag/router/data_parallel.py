"""`pagedrag serve --data-parallel-size N`: N engine replicas on one machine, each a
`pagedrag serve` process on a loopback port, behind one OpenAI-compatible endpoint that
routes each request by prefix-cache affinity (router.affinity) over the replicas' block
hashes (router.prompt_blocks).

Invariants:
- A request is sent to one replica at a time. If that replica cannot be reached, or dies
  before the reply is complete (before the first byte of a stream), the request goes to
  another replica: an accepted request is lost only if its stream had begun, or (503) after
  every replica failed it twice.
- POST /v1/warm is the exception: it goes to every replica up at once and is answered as one
  (router.warm_fanout).
- A replica that dies is restarted (its estimated cache forgotten); while none is up,
  requests wait for one up to ``REPLICA_WAIT_S`` and are then answered 503. One that exits
  again before it came up waits twice as long each time before its next start (up to
  ``RESTART_DELAY_MAX_S``). A replica that exits before it ever came up cannot start with
  these flags: the router stops (exit code 1) rather than restart it forever.
- A replica up is asked for /health every ``HEALTH_EVERY_S``; one that misses
  ``HEALTH_MISSES`` answers in a row (hung, stopped) gets no new requests until it answers,
  and the requests sent to it that it has not begun to answer go to another replica (the
  router closes their connections, which aborts them there should it ever run them).
- A replica that answers 503 queue_full (its --max-queue) passes the request to another.
- /metrics and /v1/stats are every replica's figures and their sums (router.metrics_sum),
  from those that answer within ``FIGURES_TIMEOUT_S``; /health is 200 while any replica is up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from pagedrag.router.affinity import AffinityThresholds, ReplicaChooser
from pagedrag.router.app_settings import flag_arguments
from pagedrag.router.metrics_sum import CumulativeMemory, merge_metrics, merge_stats
from pagedrag.router.prompt_blocks import PromptBlocks
from pagedrag.router.proxy_headers import forwarded_headers
from pagedrag.router.warm_fanout import WARM_PATH, warm_every_replica
from pagedrag.server.background import free_port
from pagedrag.server.body_limit import BodySizeLimitMiddleware
from pagedrag.server.errors import APIError, install_error_handlers
from pagedrag.server.shutdown import ABORT_DRAIN_S, SignalledServer

logger = logging.getLogger("pagedrag")

REPLICA_WAIT_S = 300.0  # how long a request waits for a replica to come (back) up
HEALTH_EVERY_S = 5.0
HEALTH_TIMEOUT_S = 5.0
HEALTH_MISSES = 2
FIGURES_TIMEOUT_S = 10.0  # a replica's /metrics or /v1/stats, else left out of the sums
ROUTER_DRAIN_S = 5.0  # on top of the replicas' own bound: their last bytes reach the clients
RESTART_DELAY_MAX_S = 60.0


@dataclass
class LocalReplica:
    """One `pagedrag serve` child process on a loopback port."""

    name: str
    argv: list[str]
    port: int = 0
    process: subprocess.Popen | None = None
    up: bool = False
    ever_up: bool = False  # came up at least once (else an exit means it cannot start)
    missed_checks: int = 0
    failed_starts: int = 0  # exits in a row before it came up (once it had been up)
    restart_at: float | None = None  # when an exited replica starts again (monotonic time)
    stopping: bool = False  # sent SIGTERM
    in_flight: int = 0
    restarts: int = 0
    unresponsive: asyncio.Event = field(default_factory=asyncio.Event)  # set when checks take it out

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        self.up, self.missed_checks, self.in_flight, self.stopping, self.restart_at = False, 0, 0, False, None
        self.unresponsive = asyncio.Event()
        command = [sys.executable, "-m", "pagedrag", "serve", *self.argv, "--host", "127.0.0.1",
                   "--port", str(self.port)]
        # A session of its own: a terminal's Ctrl-C reaches the router alone, which then tells each
        # replica once (a second signal would make a replica exit at once, abandoning its requests)
        self.process = subprocess.Popen(command, start_new_session=True)

    def exited(self) -> bool:
        return self.process is None or self.process.poll() is not None

    def stop(self) -> None:
        self.signal_stop()
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def release(self) -> None:
        """A request sent to this replica is over (the count restarts from 0 with the process)."""
        self.in_flight = max(0, self.in_flight - 1)

    def signal_stop(self) -> None:
        """SIGTERM, once (a second would make the replica exit at once, skipping its cleanup): the
        replica drains its requests within its --shutdown-timeout, then exits."""
        if self.process is not None and self.process.poll() is None and not self.stopping:
            self.stopping = True
            self.process.terminate()


@dataclass
class Replicas:
    """The replica processes, the routing policy and the client that reaches them."""

    replicas: list[LocalReplica]
    chooser: ReplicaChooser
    blocks: PromptBlocks
    client: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=None))
    on_failure: Callable[[], None] = lambda: None  # called once a replica cannot start: stop serving
    failure: str | None = None
    metrics_memory: CumulativeMemory = field(default_factory=CumulativeMemory)  # /metrics sums never go down

    def up(self) -> list[LocalReplica]:
        return [replica for replica in self.replicas if replica.up and not replica.exited()]

    async def supervise(self) -> None:
        """Start every replica, then restart any that exits (but one that never came up: then
        ``on_failure``), and check the health of those up."""
        for replica in self.replicas:
            replica.start()
        last_check = time.monotonic()
        while self.failure is None:
            for replica in self.replicas:
                if replica.stopping:  # told to stop (the router is shutting down): never restarted
                    continue
                if replica.exited() and replica.process is not None:
                    self._restart(replica)
                elif not replica.up and await self._healthy(replica, 2.0):
                    replica.up = replica.ever_up = True
                    replica.missed_checks = 0
                    replica.unresponsive = asyncio.Event()
            if time.monotonic() - last_check >= HEALTH_EVERY_S:
                await asyncio.gather(*(self._check(replica) for replica in self.up()))
                last_check = time.monotonic()
            await asyncio.sleep(0.5)

    def _restart(self, replica: LocalReplica) -> None:
        """Start an exited replica again: at once, or after a delay doubling with each exit in a
        row before it came up (up to RESTART_DELAY_MAX_S). One that never came up since the router
        started cannot start with these flags: ``on_failure``."""
        code = replica.process.returncode
        if not replica.ever_up:
            self.failure = f"replica {replica.name} exited (code {code}) before it came up: see its log above"
            logger.error("%s; stopping", self.failure)
            self.on_failure()
            return
        now = time.monotonic()
        if replica.restart_at is None:  # its exit, first seen
            replica.failed_starts = 0 if replica.up else replica.failed_starts + 1
            delay = min(RESTART_DELAY_MAX_S, 2.0 ** min(replica.failed_starts, 16)) if replica.failed_starts else 0.0
            replica.restart_at = now + delay
            logger.warning("replica %s exited (code %s); restarting it%s", replica.name, code,
                           f" in {delay:g} s" if delay else "")
        if now >= replica.restart_at:
            self.chooser.forget(replica.name)
            replica.restarts += 1
            replica.start()

    async def _check(self, replica: LocalReplica) -> None:
        """One health check of a replica up; HEALTH_MISSES in a row take it out of routing."""
        replica.missed_checks = 0 if await self._healthy(replica, HEALTH_TIMEOUT_S) else replica.missed_checks + 1
        if replica.missed_checks >= HEALTH_MISSES:
            logger.warning("replica %s missed %d health checks; no new requests go to it until it answers, "
                           "and those it has not begun to answer go to another", replica.name, replica.missed_checks)
            replica.up = False
            replica.unresponsive.set()

    async def _healthy(self, replica: LocalReplica, timeout: float) -> bool:
        try:
            return (await self.client.get(replica.url + "/health", timeout=timeout)).status_code == 200
        except httpx.HTTPError:
            return False

    async def figures(self, path: str, headers: dict[str, str]) -> dict[str, httpx.Response]:
        """Each replica up's answer to GET ``path``, of those that answer within FIGURES_TIMEOUT_S."""
        async def ask(replica: LocalReplica) -> httpx.Response | None:
            with contextlib.suppress(httpx.HTTPError):
                return await self.client.get(replica.url + path, headers=headers, timeout=FIGURES_TIMEOUT_S)
            return None

        live = self.up()
        replies = await asyncio.gather(*(ask(replica) for replica in live))
        return {replica.name: reply for replica, reply in zip(live, replies) if reply is not None}

    async def live(self) -> list[LocalReplica]:
        """The replicas up, at least one: waits up to ``REPLICA_WAIT_S`` for one, then 503."""
        deadline = time.monotonic() + REPLICA_WAIT_S
        while not (live := self.up()):
            if time.monotonic() > deadline:
                raise APIError(503, "no engine replica is up", code="service_unavailable")
            await asyncio.sleep(0.2)
        return live

    async def pick(self, hashes: list[bytes], exclude: set[str]) -> LocalReplica:
        """The policy's replica among those up but ``exclude`` (among all up if that leaves none)."""
        live = await self.live()
        candidates = [r for r in live if r.name not in exclude] or live
        name = self.chooser.choose(hashes, {r.name: r.in_flight for r in candidates})
        return next(r for r in candidates if r.name == name)

    async def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()
        await self.client.aclose()


def build_router_app(replicas: Replicas, max_request_bytes: int) -> FastAPI:
    """The router's endpoint. Bodies over ``max_request_bytes`` (the replicas' own
    --max-request-bytes) get 413 here, before the router reads or tokenizes them."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        supervisor = asyncio.create_task(replicas.supervise())
        yield
        supervisor.cancel()
        await replicas.stop()

    app = FastAPI(title="pagedrag router", lifespan=lifespan)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"replicas_up": len(replicas.up())}, status_code=200 if replicas.up() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        texts = {name: reply.text for name, reply in (await replicas.figures("/metrics", {})).items()}
        return Response(merge_metrics(texts, replicas.metrics_memory),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/stats")
    async def stats(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        replies = {}
        for name, reply in (await replicas.figures("/v1/stats", headers)).items():
            if reply.status_code != 200:  # a refused key: every replica says the same
                return Response(reply.content, status_code=reply.status_code,
                                media_type=reply.headers.get("content-type"))
            replies[name] = reply.json()
        if not replies:
            raise APIError(503, "no engine replica is up", code="service_unavailable")
        return JSONResponse(merge_stats(replies))

    @app.post(WARM_PATH)
    async def warm(request: Request) -> Response:
        return await warm_every_replica(replicas.client, await replicas.live(), await request.body(),
                                        forwarded_headers(request.headers))

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        hashes = await anyio.to_thread.run_sync(replicas.blocks.of_request, request.method, request.url.path,
                                                body, request.headers)
        return await _send(replicas, request, body, hashes)

    return app


async def _send(replicas: Replicas, request: Request, body: bytes, hashes: list[bytes]) -> Response:
    """Send to the chosen replica; on a replica that fails before answering, to another."""
    headers = forwarded_headers(request.headers)
    tried: set[str] = set()
    for _ in range(2 * len(replicas.replicas) + 1):  # each replica twice: a restarted one may take it
        replica = await replicas.pick(hashes, tried)
        replica.in_flight += 1
        upstream = replicas.client.build_request(request.method, replica.url + request.url.path,
                                                 params=request.query_params, content=body, headers=headers)
        try:
            reply = await _open_unless_unresponsive(replicas.client, upstream, replica)
        except (httpx.HTTPError, ReplicaUnresponsive) as error:
            replica.release()
            tried.add(replica.name)
            logger.warning("replica %s failed (%s); sending the request to another", replica.name, error)
            continue
        if reply.queue_full() and any(r.name not in tried | {replica.name} for r in replicas.up()):
            await reply.discard(replica)
            tried.add(replica.name)
            continue
        replicas.chooser.record(replica.name, hashes)  # it holds the prompt's blocks now (or soon)
        return reply.response(replica)
    raise APIError(503, "every engine replica failed to answer this request", code="service_unavailable")


class ReplicaUnresponsive(Exception):
    """Health checks took the replica out of routing before it began to answer."""


async def _open_unless_unresponsive(client: httpx.AsyncClient, request: httpx.Request,
                                    replica: LocalReplica) -> _Reply:
    """The replica's reply, unless health checks take the replica out of routing first: then
    the request's connection is closed and ReplicaUnresponsive raised (a reply that came
    first wins)."""
    opening = asyncio.ensure_future(_Reply.open(client, request))
    noticed = asyncio.ensure_future(replica.unresponsive.wait())
    try:
        await asyncio.wait({opening, noticed}, return_when=asyncio.FIRST_COMPLETED)
        if opening.done():
            return opening.result()
        raise ReplicaUnresponsive(f"it missed {replica.missed_checks} health checks before answering")
    finally:
        noticed.cancel()
        if not opening.done():
            opening.cancel()  # _Reply.open closes the connection


@dataclass
class _Reply:
    """A replica's answer once it is safe to pass on: a whole reply (non-streamed: read to
    the end, so that a replica dying mid-reply makes the caller retry), or a stream whose
    first chunk has come."""

    upstream: httpx.Response
    first: bytes | None  # None: not a stream
    rest: AsyncIterator[bytes] | None

    @classmethod
    async def open(cls, client: httpx.AsyncClient, request: httpx.Request) -> _Reply:
        upstream = await client.send(request, stream=True)
        try:
            if "text/event-stream" not in upstream.headers.get("content-type", ""):
                await upstream.aread()
                return cls(upstream, None, None)
            chunks = upstream.aiter_raw()
            return cls(upstream, await anext(chunks, b""), chunks)
        except BaseException:
            await upstream.aclose()
            raise

    def queue_full(self) -> bool:
        """A whole 503 answer with code queue_full: the replica is at its --max-queue."""
        return self.first is None and self.upstream.status_code == 503 and b'"queue_full"' in self.upstream.content

    async def discard(self, replica: LocalReplica) -> None:
        replica.release()
        await self.upstream.aclose()

    def response(self, replica: LocalReplica) -> Response:
        """The answer to pass on. The replica's in-flight count drops once, when it is sent or
        when its stream ends however it ends (a replica dying mid-stream included)."""
        headers = forwarded_headers(self.upstream.headers, drop={"content-encoding"})
        released = False

        async def done() -> None:
            nonlocal released
            if not released:
                released = True
                await self.discard(replica)

        if self.first is None:
            return Response(self.upstream.content, status_code=self.upstream.status_code, headers=headers,
                            background=BackgroundTask(done))
        return StreamingResponse(self._stream(done), status_code=self.upstream.status_code, headers=headers,
                                 background=BackgroundTask(done))

    async def _stream(self, done: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
        try:
            yield self.first
            async for chunk in self.rest:
                yield chunk
        finally:
            await done()


def replica_argv(parser: argparse.ArgumentParser, args: argparse.Namespace, skip: set[str]) -> list[str]:
    """The command line of a replica: every option of ``args`` that differs from its default,
    but those whose dest is in ``skip``."""
    argv: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of its actions
        if action.dest in skip or action.dest == "help" or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        argv += flag_arguments(action, value) if action.option_strings else [str(value)]  # or a positional
    return argv


ROUTER_DESTS = {"data_parallel_size", "router_policy", "router_cache_threshold", "router_balance_abs_threshold",
                "host", "port"}


def serve_replicas(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``args.data_parallel_size`` replicas of `pagedrag serve` (``args`` minus the router's
    own flags) behind the router on --host/--port, until SIGTERM or Ctrl-C."""
    from pagedrag.server.cli import template_text

    chooser = ReplicaChooser(args.router_policy, AffinityThresholds(
        cache_threshold=args.router_cache_threshold, balance_abs_threshold=args.router_balance_abs_threshold))
    blocks = PromptBlocks(args.model, args.block_size, args.salt_by_api_key, template_text(args.chat_template),
                          args.enable_chunk_reuse)
    argv = replica_argv(parser, args, ROUTER_DESTS)
    replicas = Replicas([LocalReplica(str(index), argv) for index in range(args.data_parallel_size)], chooser, blocks)
    logger.info("routing (%s) over %d replicas of `pagedrag serve %s` on http://%s:%d", args.router_policy,
                args.data_parallel_size, " ".join(argv), args.host, args.port)
    server = RouterServer(build_router_app(replicas, args.max_request_bytes), replicas, args.shutdown_timeout, host=args.host,
                          port=args.port, log_level=args.log_level)
    replicas.on_failure = lambda: setattr(server, "should_exit", True)
    server.run()
    return 1 if replicas.failure else 0


class RouterServer(SignalledServer):
    """The router's server: on the first SIGTERM or SIGINT every replica is told to stop at once,
    so each drains its requests within the --shutdown-timeout it was given and then ends them
    (finish_reason "abort"), and the router's own wait for its connections ends with theirs;
    the router then exits 0. A second signal exits at once."""

    def __init__(self, app, replicas: Replicas, grace: float, **config):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace + ABORT_DRAIN_S + ROUTER_DRAIN_S,
                                        **config))
        self.replicas = replicas

    async def shutdown(self, sockets=None) -> None:
        for replica in self.replicas.replicas:
            replica.signal_stop()
        await super().shutdown(sockets)

