"""pagedrag on Ray Serve: engine replicas behind one OpenAI-compatible ingress, routed by
prefix-cache affinity through Ray Serve's request-router API.

    serve run pagedrag.router.ray_app:build_app num_replicas=2 max_model_len=2048
    serve run deploy/ray_serve.yaml                    # the same as a config file

Arguments are `pagedrag serve`'s flags without dashes (``model``, ``max_model_len``,
``enable_chunk_reuse``, ``api_key``...; router.app_settings says how each kind of value is
read, and refuses the HTTP server's own), plus ``num_replicas``, ``num_gpus`` and ``num_cpus``
(each replica's devices: one GPU, or a share of a node's CPUs) and ``router_policy``,
``router_cache_threshold``, ``router_balance_abs_threshold`` (router.affinity).

Deployments:
- ``EngineReplica``: one pagedrag server (its FastAPI app) in process. ``forward`` hands it
  one HTTP request and yields the reply: status and headers first, then the body's chunks.
- ``Ingress`` (HTTP): passes each request to an EngineReplica through its handle. That
  handle's router is ``AffinityRequestRouter``: it ranks the replicas with router.affinity
  over the body's block hashes (router.prompt_blocks) and their requests in flight. A
  replica that fails before its reply began (a stream's first chunk, a whole JSON reply):
  the request goes to another one; Ray Serve restarts the dead replica.
- POST /v1/warm: sent to every EngineReplica running at once (the handle's broadcast) and
  answered as one (router.warm_fanout).
- /metrics: each replica publishes its Prometheus text to a named actor every
  ``METRICS_PERIOD_S``; the ingress serves them merged (router.metrics_sum).
"""


import argparse
import asyncio
import threading
import time
from collections.abc import AsyncIterator

import ray
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import generate_latest
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedrag.router.affinity import AffinityThresholds, ReplicaChooser
from pagedrag.router.app_settings import serve_argv
from pagedrag.router.metrics_sum import CumulativeMemory, merge_metrics
from pagedrag.router.prompt_blocks import PromptBlocks
from pagedrag.router.proxy_headers import forwarded_headers
from pagedrag.router.warm_fanout import WARM_PATH, WarmAnswer, combined
from pagedrag.server.errors import APIError, install_error_handlers

METRICS_PERIOD_S = 5.0
_BOARD = "pagedrag-metrics"
_STALE_S = 4 * METRICS_PERIOD_S  # a replica silent this long is gone from /metrics
_RETRIES = 3


# ---- the router ------------------------------------------------------------------------
class AffinityRequestRouter(FIFOMixin, RequestRouter):
    """Ray Serve's router for EngineReplica handles: router.affinity's choice first, the
    other replicas after it (Ray Serve moves down the ranks when a replica is full or does
    not answer its queue-length probe). Loads are Ray Serve's own queue lengths; a request's
    blocks are recorded on the replica chosen for it."""

    def initialize_state(self, model: str | None = None, block_size: int = 16, salt_by_api_key: bool = False,
                         chat_template: str | None = None, chunk_reuse: bool = False,
                         policy: str = "prefix_affinity",
                         cache_threshold: float = AffinityThresholds.cache_threshold,
                         balance_abs_threshold: int = AffinityThresholds.balance_abs_threshold) -> None:
        self.blocks = PromptBlocks(model, block_size, salt_by_api_key, chat_template, chunk_reuse)
        self.chooser = ReplicaChooser(policy, AffinityThresholds(cache_threshold=cache_threshold,
                                                                 balance_abs_threshold=balance_abs_threshold))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hashes = self._hashes(pending_request)
        loads = {replica.replica_id: self.replica_queue_len_cache.get(replica.replica_id) or 0
                 for replica in candidate_replicas}
        chosen = self.chooser.choose(hashes, loads)
        self.chooser.record(chosen, hashes)
        first = [replica for replica in candidate_replicas if replica.replica_id == chosen]
        return [first, [replica for replica in candidate_replicas if replica.replica_id != chosen]]

    def _hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        """The request's block hashes, from ``EngineReplica.forward``'s arguments."""
        if pending_request is None or len(pending_request.args) < 5:
            return []
        method, path, _, headers, body = pending_request.args[:5]
        return self.blocks.of_request(method, path, body, headers)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.chooser.forget(replica_id)


# ---- the replicas ----------------------------------------------------------------------
@ray.remote(num_cpus=0)
class MetricsBoard:
    """The replicas' latest Prometheus texts, by replica."""

    def __init__(self):
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.time(), text)

    def fresh(self) -> dict[str, str]:
        now = time.time()
        return {replica: text for replica, (at, text) in self.texts.items() if now - at < _STALE_S}


def _board():
    return MetricsBoard.options(name=_BOARD, namespace="pagedrag", get_if_exists=True, lifetime="detached").remote()


@serve.deployment
class EngineReplica:
    def __init__(self, argv: list[str]):
        from pagedrag.entrypoints.async_engine import AsyncLLMEngine
        from pagedrag.server.app import build_app
        from pagedrag.server.cli import engine_args_from, freeze_startup_objects, server_config_from

        args = _parse(argv)
        self.engine = AsyncLLMEngine.from_engine_args(engine_args_from(args))
        freeze_startup_objects()  # a replica's process keeps its engine to the end
        self.app = build_app(self.engine, server_config_from(args, self.engine.model_info.name))
        self.name = serve.get_replica_context().replica_id.unique_id
        threading.Thread(target=self._publish_metrics, daemon=True).start()

    def _publish_metrics(self) -> None:
        board = _board()
        while True:
            board.put.remote(self.name, generate_latest(self.engine.metrics_registry).decode())
            time.sleep(METRICS_PERIOD_S)

    async def forward(self, method: str, path: str, query: str, headers: dict[str, str],
                      body: bytes) -> AsyncIterator[dict | bytes]:
        """The app's reply to one request: {"status", "headers"} first, then body chunks."""
        async for message in _asgi_call(self.app, method, path, query, headers, body):
            yield message

    async def warm(self, headers: dict[str, str], body: bytes) -> WarmAnswer:
        """The app's answer to POST /v1/warm, named by this replica (the ingress sends it to
        every replica at once)."""
        head, *chunks = [message async for message in _asgi_call(self.app, "POST", WARM_PATH, "", headers, body)]
        return WarmAnswer.of(self.name, head["status"], b"".join(chunks))

    def __del__(self):
        self.engine.shutdown()


async def _asgi_call(app, method: str, path: str, query: str, headers: dict[str, str],
                     body: bytes) -> AsyncIterator[dict | bytes]:
    """Run one HTTP request through an ASGI app in process; yields as ``forward`` does. The
    app sees a client that never disconnects unless this generator is closed."""
    messages: asyncio.Queue = asyncio.Queue()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
             "root_path": "", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent_body = asyncio.Event()
    closed = asyncio.Event()

    async def receive() -> dict:
        if not sent_body.is_set():
            sent_body.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await closed.wait()
        return {"type": "http.disconnect"}

    task = asyncio.create_task(app(scope, receive, messages.put))
    try:
        while True:
            message = await messages.get()
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": {k.decode(): v.decode() for k, v in message.get("headers", [])}}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    break
        await task
    finally:
        closed.set()
        if not task.done():
            task.cancel()


# ---- the ingress -----------------------------------------------------------------------
async def _opening(replies) -> tuple[dict, list[bytes]]:
    """The status and headers, and what must arrive before the reply is passed on: a whole
    JSON body, or a stream's first chunk."""
    head = await replies.__anext__()
    streaming = "text/event-stream" in head["headers"].get("content-type", "")
    first = []
    async for chunk in replies:
        first.append(chunk)
        if streaming:
            break
    return head, first


def _reply(head: dict, first: list[bytes], replies) -> Response:
    headers = forwarded_headers(head["headers"])
    if "text/event-stream" not in head["headers"].get("content-type", ""):
        return Response(b"".join(first), status_code=head["status"], headers=headers)

    async def stream():
        for chunk in first:
            yield chunk
        async for chunk in replies:
            yield chunk

    return StreamingResponse(stream(), status_code=head["status"], headers=headers)


async def warm_by_broadcast(engine: DeploymentHandle, headers: dict[str, str], body: bytes) -> Response:
    """The warm-up ``body`` sent to every replica ``engine`` reaches at once (its broadcast),
    answered as router.warm_fanout says, by replica name. A replica that died before answering
    is a 503 entry named "unknown" (the broadcast does not say whose its error was)."""
    try:
        results = await engine.broadcast("warm", headers, body).results_async(return_exceptions=True)
    except DeploymentUnavailableError:
        return APIError(503, "no engine replica is up", code="service_unavailable").response()
    answers = [result if isinstance(result, WarmAnswer) else WarmAnswer.unanswered("unknown", result)
               for result in results]
    return combined(sorted(answers, key=lambda answer: answer.replica))


# serve.ingress serializes the app where it decorates the class: what its routes call is defined above.
ingress_app = FastAPI(title="pagedrag on Ray Serve")
install_error_handlers(ingress_app)  # its own errors (405, 404) in the OpenAI shape, as a replica's


@serve.deployment
@serve.ingress(ingress_app)
class Ingress:
    def __init__(self, engine: DeploymentHandle):
        self.engine = engine.options(stream=True)
        self.metrics_memory = CumulativeMemory()  # this ingress replica's: its sums never go down

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        texts = await _board().fresh.remote()
        return Response(merge_metrics(texts, self.metrics_memory),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @ingress_app.post(WARM_PATH)
    async def warm(self, request: Request) -> Response:
        return await warm_by_broadcast(self.engine, forwarded_headers(request.headers), await request.body())

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        headers = forwarded_headers(request.headers)
        for attempt in range(_RETRIES):
            replies = self.engine.forward.remote(request.method, request.url.path, request.url.query, headers, body)
            try:
                head, first = await _opening(replies)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                continue  # the replica died before answering: another one takes the request
            return _reply(head, first, replies)
        return APIError(503, "no engine replica could take the request", code="service_unavailable").response()


# ---- the application -------------------------------------------------------------------
_DEPLOYMENT_KEYS = ("num_replicas", "num_gpus", "num_cpus")
_ROUTER_KEYS = ("router_policy", "router_cache_threshold", "router_balance_abs_threshold")


class _ArgumentParser(argparse.ArgumentParser):
    """`pagedrag serve`'s parser, raising ValueError (naming the bad argument) where the
    command line would exit."""

    def error(self, message: str):
        raise ValueError(f"pagedrag.router.ray_app: {message}")


def _parser() -> _ArgumentParser:
    from pagedrag.server.cli import add_arguments

    parser = _ArgumentParser(prog="pagedrag.router.ray_app")
    add_arguments(parser)
    return parser


def _parse(argv: list[str]) -> argparse.Namespace:
    return _parser().parse_args(argv)


def build_app(settings: dict):
    """The application: ``settings`` as the module docstring says; bad ones fail here, by name."""
    settings = dict(settings)
    deployment = {key: settings.pop(key) for key in _DEPLOYMENT_KEYS if key in settings}
    parser = _parser()
    argv = serve_argv(settings, parser)  # unknown settings and those that do nothing on Ray: here
    args = parser.parse_args(argv)  # `pagedrag serve`'s own checks of each value
    from pagedrag.server.cli import template_text, engine_args_from

    engine_args_from(args)  # the engine's checks, before any replica starts
    router = RequestRouterConfig(request_router_class=AffinityRequestRouter, request_router_kwargs={
        "model": args.model, "block_size": args.block_size, "salt_by_api_key": args.salt_by_api_key,
        "chat_template": template_text(args.chat_template), "chunk_reuse": args.enable_chunk_reuse,
        "policy": args.router_policy, "cache_threshold": args.router_cache_threshold,
        "balance_abs_threshold": args.router_balance_abs_threshold})
    actor = {"num_gpus": float(deployment.get("num_gpus", 0)), "num_cpus": float(deployment.get("num_cpus", 1))}
    replica = EngineReplica.options(num_replicas=int(deployment.get("num_replicas", 1)), ray_actor_options=actor,
                                    request_router_config=router)
    return Ingress.bind(replica.bind(argv))
