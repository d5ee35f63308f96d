"""The engine client that the LlamaIndex and LangChain integrations share.

One interface over two back ends:

- in process (``connect(model, engine_kwargs=...)``): an ``AsyncLLMEngine`` shared by
  every client built from the same engine arguments, so a second LLM object with the
  same arguments reuses the loaded model and its prefix cache instead of loading again;
- remote (``connect(base_url=...)``): a ``pagedrag serve`` reached through its
  OpenAI-compatible HTTP API with httpx; cached tokens come from
  ``usage.prompt_tokens_details.cached_tokens``.

Every call has a synchronous, an async and a streaming form, for completion (a text
prompt) and chat (a list of ``{"role", "content"}`` messages rendered through the
model's chat template). Results are ``Generation`` objects. Synchronous calls run their
coroutine on a private event-loop thread, so they also work where an event loop is
already running (Jupyter) and from many threads at once.

The module also holds what both integrations' prompt helpers share: the template
messages in the canonical layout and the token-budget rule for retrieved chunks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .canonical import Chunk, PromptCanonicalizer, canonical_order
from .config import EngineArgs
from .inputs import ProcessedPrompt
from .models.loader import EMBEDDED_NAME
from .sampling_params import SamplingParams

DEFAULT_MODEL_NAME = EMBEDDED_NAME
Messages = list[dict[str, str]]
Prompt = str | Messages
"""A completion prompt (text) or a chat conversation (messages)."""
T = TypeVar("T")


# ---- results --------------------------------------------------------------------------

@dataclass(frozen=True)
class Generation:
    """One completion, or one piece of a stream.

    A stream yields pieces whose ``text`` is new text and whose ``finish_reason`` is None,
    then a last piece (its text possibly empty) with the finish reason and the request's
    token counts; the counts of earlier pieces are 0, so summing pieces gives the totals.
    """

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def cache_hit_rate(self) -> float:
        """The share of prompt tokens served from the prefix cache."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def cache_figures(self) -> dict[str, Any]:
        """Finish reason, token counts and hit rate, as the integrations report them."""
        return {"finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "cache_hit_rate": self.cache_hit_rate}


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves: the model's name and its context window in tokens."""

    model_name: str
    max_model_len: int


_SAMPLING_FIELDS = frozenset(field.name for field in dataclasses.fields(SamplingParams))


def sampling_params(settings: dict[str, Any], overrides: dict[str, Any]) -> SamplingParams:
    """An adapter's sampling settings, updated by a call's keyword arguments. Keywords that
    are not SamplingParams fields are left out: frameworks pass other things along."""
    chosen = {**settings, **{key: value for key, value in overrides.items() if key in _SAMPLING_FIELDS}}
    return SamplingParams(**chosen)


async def _collect(pieces: AsyncIterator[Generation]) -> Generation:
    """The whole Generation of a stream: its texts joined, the last piece's figures."""
    texts, last = [], Generation("")
    async for piece in pieces:
        texts.append(piece.text)
        last = piece
    return dataclasses.replace(last, text="".join(texts))


# ---- the client interface ---------------------------------------------------------------

class EngineClient(ABC):
    """What the integrations call. Back ends implement the async primitives; the
    synchronous and batch forms are derived here."""

    @abstractmethod
    async def agenerate(self, prompt: Prompt, params: SamplingParams,
                        cache_salt: str | None = None) -> Generation:
        """The whole completion of a text prompt or a conversation."""

    @abstractmethod
    def astream(self, prompt: Prompt, params: SamplingParams,
                cache_salt: str | None = None) -> AsyncIterator[Generation]:
        """The completion as it is generated (see ``Generation`` for the pieces).
        Closing the iterator early aborts the request."""

    @abstractmethod
    async def astats(self) -> dict[str, Any]:
        """The engine's counters, keyed as ``pagedrag.LLM.stats()`` keys them."""

    @abstractmethod
    async def ainfo(self) -> EngineInfo:
        """The served model's name and context window."""

    # ---- completion and chat, async -------------------------------------------------
    async def acomplete(self, prompt: str, params: SamplingParams, cache_salt: str | None = None) -> Generation:
        return await self.agenerate(_text(prompt), params, cache_salt)

    async def achat(self, messages: Messages, params: SamplingParams, cache_salt: str | None = None) -> Generation:
        return await self.agenerate(_conversation(messages), params, cache_salt)

    def astream_complete(self, prompt: str, params: SamplingParams,
                         cache_salt: str | None = None) -> AsyncIterator[Generation]:
        return self.astream(_text(prompt), params, cache_salt)

    def astream_chat(self, messages: Messages, params: SamplingParams,
                     cache_salt: str | None = None) -> AsyncIterator[Generation]:
        return self.astream(_conversation(messages), params, cache_salt)

    async def abatch(self, prompts: Sequence[Prompt], params: SamplingParams,
                     cache_salt: str | None = None) -> list[Generation]:
        """All prompts submitted at once (one engine batch), results in their order."""
        checked = [_text(p) if isinstance(p, str) else _conversation(p) for p in prompts]
        tasks = [asyncio.ensure_future(self.agenerate(p, params, cache_salt)) for p in checked]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # one failed (or the caller gave up): abort the others
                task.cancel()
            raise

    # ---- synchronous forms ------------------------------------------------------------
    def complete(self, prompt: str, params: SamplingParams, cache_salt: str | None = None) -> Generation:
        return run_sync(self.acomplete(prompt, params, cache_salt))

    def chat(self, messages: Messages, params: SamplingParams, cache_salt: str | None = None) -> Generation:
        return run_sync(self.achat(messages, params, cache_salt))

    def stream_complete(self, prompt: str, params: SamplingParams,
                        cache_salt: str | None = None) -> Iterator[Generation]:
        return _portal().iterate(self.astream_complete(prompt, params, cache_salt))

    def stream_chat(self, messages: Messages, params: SamplingParams,
                    cache_salt: str | None = None) -> Iterator[Generation]:
        return _portal().iterate(self.astream_chat(messages, params, cache_salt))

    def batch(self, prompts: Sequence[Prompt], params: SamplingParams,
              cache_salt: str | None = None) -> list[Generation]:
        return run_sync(self.abatch(prompts, params, cache_salt))

    def stats(self) -> dict[str, Any]:
        return run_sync(self.astats())

    def info(self) -> EngineInfo:
        return run_sync(self.ainfo())


def _text(prompt: Any) -> str:
    if not isinstance(prompt, str):
        raise TypeError(f"a completion prompt must be a string, got {type(prompt).__name__}")
    return prompt


def _conversation(messages: Any) -> Messages:
    """The messages as a list, each a dict with a string role and string content."""
    if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("a chat needs a non-empty list of {'role', 'content'} messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content', got {message!r}")
        for key in ("role", "content"):
            if not isinstance(message[key], str):
                raise TypeError(f"messages[{index}].{key} must be str, got {type(message[key]).__name__}")
    return list(messages)


def connect(model: str | None = None, *, base_url: str | None = None, api_key: str | None = None,
            engine_kwargs: dict[str, Any] | None = None, timeout: float = 600.0,
            max_retries: int = 0) -> EngineClient:
    """A client of a ``pagedrag serve`` at ``base_url``, or else of the shared in-process
    engine for ``model`` (None: the embedded SmolLM2) and ``engine_kwargs`` (EngineArgs fields).
    ``timeout`` (seconds per request) and ``max_retries`` (of failed connections) apply to a server."""
    if base_url is None:
        return InProcessClient(shared_engine(model, engine_kwargs or {}))
    if engine_kwargs:
        raise ValueError("engine_kwargs configure an in-process engine; a server takes its own flags")
    return RemoteClient(base_url, model, api_key, timeout, max_retries)


# ---- synchronous calls through a private event loop -------------------------------------

class _Portal:
    """An event loop on a daemon thread that synchronous callers hand coroutines to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pagedrag-client", daemon=True)
        self.thread.start()

    def run(self, coroutine) -> Any:
        """Run the coroutine on the portal's loop and wait for its result."""
        if threading.current_thread() is self.thread:
            coroutine.close()
            raise RuntimeError("a synchronous pagedrag call cannot run on the client's own event loop")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result()
        finally:
            future.cancel()  # a no-op once done; cancels (and aborts) when interrupted

    def iterate(self, items: AsyncIterator) -> Iterator:
        """The items of an async iterator, pumped on the portal's loop; leaving the loop
        early (or dropping the iterator) cancels the pump, which closes ``items``."""
        handoff: queue.SimpleQueue = queue.SimpleQueue()
        done = object()

        async def pump() -> None:
            try:
                async for item in items:
                    handoff.put((item, None))
                handoff.put((done, None))
            except Exception as error:  # raised again on the caller's side
                handoff.put((done, error))

        future = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while True:
                item, error = handoff.get()
                if error is not None:
                    raise error
                if item is done:
                    return
                yield item
        finally:
            future.cancel()


_portal_instance: _Portal | None = None
_portal_lock = threading.Lock()


def run_sync(coroutine) -> Any:
    """Run a coroutine to its end from synchronous code (also inside a running event loop)."""
    return _portal().run(coroutine)


def _portal() -> _Portal:
    global _portal_instance
    with _portal_lock:
        if _portal_instance is None:
            _portal_instance = _Portal()
        return _portal_instance


# ---- in process ---------------------------------------------------------------------------

class SharedEngine:
    """An AsyncLLMEngine shared by every client of the same engine arguments.

    Requests submitted during one turn of an event loop enter the engine together,
    between two of its steps, so a batch (``abatch``, LangChain's ``batch``, any
    ``asyncio.gather``) is one engine batch rather than a trickle. Chats are rendered
    with a tokenizer of the callers' own; the engine thread keeps the original.
    """

    def __init__(self, args: EngineArgs):
        from .async_engine import AsyncLLMEngine

        self.engine = AsyncLLMEngine.from_engine_args(args)
        self.inputs = self.engine.engine.inputs.copy()
        self.tokenizer = self.inputs.tokenizer
        self._tokenizer_lock = threading.Lock()
        self._pending: dict[asyncio.AbstractEventLoop, list] = {}  # per loop: submissions of this turn

    def engine_prompt(self, prompt: "Prompt") -> ProcessedPrompt:
        """Text, or a conversation rendered as ``LLM.chat`` renders it, tokenized and checked
        here, so that what this loop turn submits reaches the engine in one step."""
        with self._tokenizer_lock:
            if isinstance(prompt, str):
                return self.inputs.process(prompt)
            return self.inputs.render_chat(prompt)

    async def submit(self, prompt: ProcessedPrompt, params: SamplingParams, cache_salt: str | None):
        """Queue a request at the end of this loop turn; its stream of RequestOutputs."""
        loop = asyncio.get_running_loop()
        pending = self._pending.get(loop)
        if pending is None:
            pending = self._pending[loop] = []
            loop.call_soon(self._flush, loop)
        started = loop.create_future()
        pending.append((prompt, params, cache_salt, started))
        return await started

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Queue this turn's submissions while the engine thread waits between steps."""
        from .async_engine import EngineDeadError

        submissions = self._pending.pop(loop)
        release = threading.Event()
        try:
            self.engine.submit(release.wait)  # the engine thread pauses here until released
        except EngineDeadError:
            pass  # generate() reports it to each request
        try:
            for prompt, params, cache_salt, started in submissions:
                if not started.cancelled():
                    started.set_result(self.engine.generate(prompt, params, cache_salt=cache_salt))
        finally:
            release.set()


_engines: dict[tuple, SharedEngine] = {}
_engines_lock = threading.Lock()


def shared_engine(model: str | None, engine_kwargs: dict[str, Any]) -> SharedEngine:
    """The engine for these arguments, loaded on first use and shared afterwards.

    Arguments are compared after EngineArgs fills in defaults, so ``{}`` and
    ``{"block_size": 16}`` name the same engine.
    """
    unknown = set(engine_kwargs) - (EngineArgs.field_names() - {"model"})
    if unknown:
        raise TypeError(f"unknown engine arguments {sorted(unknown)}: the model is an argument of its own, "
                        "the rest are pagedrag.EngineArgs fields")
    args = EngineArgs(model=model, **engine_kwargs)
    key = tuple(sorted(dataclasses.asdict(args).items()))
    with _engines_lock:
        if key not in _engines:
            _engines[key] = SharedEngine(args)
        return _engines[key]


class InProcessClient(EngineClient):
    """A client of a shared in-process engine."""

    def __init__(self, shared: SharedEngine):
        self.shared = shared

    async def agenerate(self, prompt: Prompt, params: SamplingParams,
                        cache_salt: str | None = None) -> Generation:
        return await _collect(self.astream(prompt, params, cache_salt))

    async def astream(self, prompt: Prompt, params: SamplingParams,
                      cache_salt: str | None = None) -> AsyncIterator[Generation]:
        from .detokenizer import StopChecker
        from .server.choices import ChoiceCursor

        _check_single(params)
        engine_prompt = self.shared.engine_prompt(prompt)
        cursor = ChoiceCursor(0, StopChecker(params.stop, params.include_stop_str_in_output))
        stream = await self.shared.submit(engine_prompt, params, cache_salt)
        try:
            async for output in stream:
                delta = cursor.advance(output.outputs[0], wants_logprobs=False)
                if delta is None:
                    continue
                if delta.finish_reason is None:
                    yield Generation(delta.text)
                else:
                    yield Generation(delta.text, delta.finish_reason, len(output.prompt_token_ids),
                                     len(output.outputs[0].token_ids), output.num_cached_tokens)
        finally:
            await stream.aclose()

    async def astats(self) -> dict[str, Any]:
        return await self.shared.engine.call(self.shared.engine.engine.stats)

    async def ainfo(self) -> EngineInfo:
        engine = self.shared.engine.engine
        return EngineInfo(engine.model_name, engine.max_model_len)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (for measurements that start cold)."""
        self.shared.engine.submit(self.shared.engine.engine.reset_prefix_cache).result()


def _check_single(params: SamplingParams) -> None:
    if params.n != 1:
        raise ValueError(f"the integrations return one completion per prompt; got n={params.n}")


# ---- remote ------------------------------------------------------------------------------

class RemoteError(RuntimeError):
    """The server answered with an error other than bad input (which raises ValueError)."""


_WIRE_SKIPPED = {"n", "logprobs"}  # one choice per request, no logprobs in a Generation
_STATS_SERIES = {"prefix_cache_queries": "pagedrag:prefix_cache_queries_total",
                 "prefix_cache_hits": "pagedrag:prefix_cache_hits_total",
                 "kv_cache_usage_perc": "pagedrag:kv_cache_usage_perc",
                 "num_preemptions": "pagedrag:num_preemptions_total",
                 "num_requests_running": "pagedrag:num_requests_running",
                 "num_requests_waiting": "pagedrag:num_requests_waiting",
                 "num_requests_swapped": "pagedrag:num_requests_swapped"}


class RemoteClient(EngineClient):
    """A client of a ``pagedrag serve`` (or any OpenAI-compatible server reporting
    ``prompt_tokens_details.cached_tokens``). ``base_url`` may end in ``/v1`` or not."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, max_retries: int = 0):
        root = base_url.rstrip("/")
        self.base_url = root.removesuffix("/v1")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.max_retries = max_retries
        self._info: EngineInfo | None = None  # what /v1/models said; it does not change

    def _http(self):
        """An HTTP client for one call (a call may run on any event loop)."""
        import httpx

        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout,
                                 transport=httpx.AsyncHTTPTransport(retries=self.max_retries))

    async def agenerate(self, prompt: Prompt, params: SamplingParams,
                        cache_salt: str | None = None) -> Generation:
        path, body = self._request(prompt, params, cache_salt, stream=False)
        async with self._http() as http:
            response = await http.post(path, json=body)
            _check_response(response.status_code, response.text)
        payload = response.json()
        choice = payload["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"] or ""
        return _with_usage(Generation(text, choice["finish_reason"]), payload.get("usage"))

    async def astream(self, prompt: Prompt, params: SamplingParams,
                      cache_salt: str | None = None) -> AsyncIterator[Generation]:
        path, body = self._request(prompt, params, cache_salt, stream=True)
        finish_reason, usage = None, None
        async with self._http() as http, http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                _check_response(response.status_code, (await response.aread()).decode())
            async for event in _sse_events(response):
                if "error" in event:
                    raise _error_event(event["error"])
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    text = choice["text"] if "text" in choice else choice["delta"].get("content") or ""
                    finish_reason = choice.get("finish_reason") or finish_reason
                    if text:
                        yield Generation(text)
        yield _with_usage(Generation("", finish_reason), usage)

    def _request(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None,
                 stream: bool) -> tuple[str, dict]:
        """(path, JSON body) of a completion or chat request."""
        _check_single(params)
        body = {name: value for name, value in dataclasses.asdict(params).items() if name not in _WIRE_SKIPPED}
        body.update(stream=stream, cache_salt=cache_salt)
        if self.model is not None:
            body["model"] = self.model
        if stream:
            body["stream_options"] = {"include_usage": True}
        if isinstance(prompt, str):
            return "/v1/completions", {**body, "prompt": prompt}
        return "/v1/chat/completions", {**body, "messages": prompt}

    async def astats(self) -> dict[str, Any]:
        from prometheus_client.parser import text_string_to_metric_families

        async with self._http() as http:
            response = await http.get("/metrics")
            _check_response(response.status_code, response.text)
        samples = {sample.name: sample.value for family in text_string_to_metric_families(response.text)
                   for sample in family.samples}
        stats = {key: samples.get(series, 0.0) for key, series in _STATS_SERIES.items()}
        queries = stats["prefix_cache_queries"]
        stats["prefix_cache_hit_rate"] = stats["prefix_cache_hits"] / queries if queries else 0.0
        return stats

    async def ainfo(self) -> EngineInfo:
        if self._info is None:
            async with self._http() as http:
                response = await http.get("/v1/models")
                _check_response(response.status_code, response.text)
            cards = response.json()["data"]
            card = next((c for c in cards if c["id"] == self.model), cards[0])
            self._info = EngineInfo(card["id"], card["max_model_len"])
        return self._info


async def _sse_events(response) -> AsyncIterator[dict]:
    """The JSON payloads of a server-sent event stream, up to ``data: [DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _with_usage(generation: Generation, usage: dict | None) -> Generation:
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return dataclasses.replace(generation, prompt_tokens=usage.get("prompt_tokens", 0),
                               completion_tokens=usage.get("completion_tokens", 0),
                               cached_tokens=details.get("cached_tokens", 0))


def _check_response(status: int, body: str) -> None:
    """Raise what a non-200 answer means: ValueError for bad input (400), else RemoteError."""
    if status == 200:
        return
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": body}
    raise _as_exception(status, error.get("message", body))


def _error_event(error: dict) -> Exception:
    """The exception for an error event inside a stream (the status line said 200)."""
    status = 400 if error.get("type") == "invalid_request_error" else 500
    return _as_exception(status, error.get("message", str(error)))


def _as_exception(status: int, message: str) -> Exception:
    if status == 400:
        return ValueError(message)
    return RemoteError(f"pagedrag server error ({status}): {message}")


# ---- what both integrations' prompt helpers share ----------------------------------------

RAG_SYSTEM_PROMPT = ("You are an expert Q&A system. Answer the question using only the context given "
                     "before it, not prior knowledge. Never refer to the context directly in your answer.")


def canonical_template_messages(system_prompt: str, context_placeholder: str,
                                query_placeholder: str) -> Messages:
    """Chat messages of a prompt template in the canonical layout (system prompt, then
    the context, then the query), with the framework's placeholders left in them."""
    canonicalizer = PromptCanonicalizer(system_prompt, order="relevance", chunk_template="{text}")
    return canonicalizer.build(query_placeholder, [context_placeholder]).messages


def canonical_items(items: Sequence[T], to_chunk: Callable[[T], Chunk], with_text: Callable[[T, str], T],
                    order: str = "stable", max_tokens: int | None = None, tokenizer: Any = None,
                    chunk_template: str = "{text}") -> list[T]:
    """Retrieved items (LlamaIndex nodes, LangChain documents) deduplicated and in canonical
    order (see ``pagedrag.canonical.canonical_order``).

    With ``max_tokens``, they are also fitted into that many tokens of ``tokenizer``
    (default: the embedded model's), each rendered with ``chunk_template`` on a line of its
    own, by the canonicalizer's rule: items are kept while they fit, the first that does
    not is cut at a token boundary (``with_text(item, text)`` makes the cut copy), the rest
    are dropped.
    """
    ordered = canonical_order(items, order, to_chunk=to_chunk)
    if max_tokens is None:
        return ordered
    if tokenizer is None:
        from .models.loader import load_tokenizer

        tokenizer = load_tokenizer()
    chunks = [dataclasses.replace(to_chunk(item), metadata={"item": item}) for item in ordered]
    canonicalizer = PromptCanonicalizer(order="relevance", tokenizer=tokenizer, max_prompt_tokens=max_tokens,
                                        chunk_template=chunk_template, chat=False)
    kept = canonicalizer.build("", chunks).chunks
    return [_with_chunk_text(chunk.metadata["item"], chunk.text, to_chunk, with_text) for chunk in kept]


def _with_chunk_text(item: T, text: str, to_chunk: Callable[[T], Chunk], with_text: Callable[[T, str], T]) -> T:
    """The item itself, or a copy holding ``text`` if the budget cut it."""
    return item if to_chunk(item).text == text else with_text(item, text)
