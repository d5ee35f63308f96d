"""AsyncLLMEngine: one background thread steps an LLMEngine; asyncio callers stream from it.

The synchronous engine is not thread-safe, so it lives on a single thread of its own.
Everything another thread wants from it (add a request, abort one, read its stats) is
handed over as a command through a FIFO queue; the engine thread runs the queued
commands between two steps, and sleeps on the queue while it has nothing to step.
Outputs travel back through one mailbox per request, posted to the caller's event loop.

Nothing outside this module reaches into the LLMEngine: callers read it through
AsyncLLMEngine's public surface (``model_info``, ``metrics_registry``, ``get_tokenizer``,
``get_input_processor``, ``stats``, ``cached_prefix_len``, ``reset_prefix_cache``,
``flush_tiers``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from pagedrag.config import EngineArgs
from pagedrag.engine.llm_engine import LLMEngine
from pagedrag.engine.inputs import InputProcessor, ProcessedPrompt, PromptType
from pagedrag.outputs import RequestOutput
from pagedrag.engine.recovery import FORKED, EngineDeadError, RequestFailedError
from pagedrag.entrypoints.request_stream import Mailbox, RequestStream
from pagedrag.sampling_params import SamplingParams

__all__ = ["AsyncLLMEngine", "EngineDeadError", "ModelInfo", "RequestFailedError", "RequestStream"]
# Threads that tokenize prompts (each with its own tokenizer copy), off the engine thread
# and off the caller's event loop; more would only compete for the cores the steps use.
NUM_INPUT_THREADS = 2

logger = logging.getLogger("pagedrag")


@dataclass(frozen=True)
class ModelInfo:
    """What an engine serves; fixed for the engine's life, so read without a trip to its thread."""

    name: str
    max_model_len: int  # prompt plus generated tokens
    block_size: int  # tokens per KV block (prefix-cache granularity)
    vocab_size: int
    device: str


def _STOP() -> None:
    """The marker command that ends the engine thread (compared by identity, never run)."""


_Queued = tuple[str, ProcessedPrompt, SamplingParams | None, Mailbox]
"""A request on its way into the engine: id, prompt, parameters, mailbox."""


_LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()  # AsyncLLMEngines of this process, for the fork hook


def _after_fork_in_child() -> None:
    for engine in list(_LIVE_ENGINES):
        engine._left_behind_by_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class AsyncLLMEngine:
    """An LLMEngine behind one thread, for many concurrent asyncio callers.

    Invariants:
    - Only the engine thread touches ``engine`` and ``_mailboxes``; other threads reach
      them through ``_commands``, which the engine thread runs in order between steps.
      Callers use the public surface below; ``engine`` is named only by tests that
      simulate failures.
    - A request counts in ``num_in_flight`` from ``generate()`` until it leaves the
      engine (finished, aborted, failed, or rejected by validation): exactly one
      ``_leave`` per request.
    - Every request in ``_mailboxes`` is unfinished in the engine; its mailbox ends
      with a finished output or an exception, never with silence.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.model_info = ModelInfo(engine.model_name, engine.max_model_len, engine.args.block_size,
                                    engine.vocab_size, str(engine.device))
        self.metrics_registry: CollectorRegistry = engine.metrics.registry  # collecting it is thread-safe
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._mailboxes: dict[str, Mailbox] = {}
        self._lock = threading.Lock()  # guards _num_in_flight and _closed
        self._num_in_flight = 0
        self._closed = False
        self._dead_reason: str | None = None  # set on the engine thread only (or in a forked child)
        self._input_template = engine.inputs.copy()  # copied again for each user; never used itself
        self._inputs = threading.local()  # each input thread's own InputProcessor copy
        self._input_pool = concurrent.futures.ThreadPoolExecutor(NUM_INPUT_THREADS, "pagedrag-inputs")
        self._thread = threading.Thread(target=self._run, name="pagedrag-engine", daemon=True)
        self._thread.start()
        _LIVE_ENGINES.add(self)

    def _left_behind_by_fork(self) -> None:
        """In a forked child: the engine's threads stayed in the parent, so this copy can run
        nothing; every call fails at once with EngineDeadError rather than wait forever."""
        self._lock = threading.Lock()  # the parent's may have been held by one of its threads
        self._closed = True
        self._dead_reason = FORKED
        self._input_pool = concurrent.futures.ThreadPoolExecutor(1)
        self._input_pool.shutdown()  # submit() raises: the request is refused with the reason

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLMEngine":
        return cls(LLMEngine(args))

    # ---- the read surface (any thread; the async forms need a running event loop) ----
    @property
    def num_in_flight(self) -> int:
        """Requests queued, waiting or running (each generate() call counts once)."""
        return self._num_in_flight

    @property
    def dead_reason(self) -> str | None:
        """Why the engine takes no more requests, or None while it is healthy."""
        return self._dead_reason

    def get_input_processor(self) -> InputProcessor:
        """A copy of the engine's InputProcessor (tokenizer included) for the caller's own
        thread: a tokenizer must not be shared between threads."""
        return self._input_template.copy()

    def get_tokenizer(self):
        """A copy of the engine's tokenizer for the caller's own thread (None: the model has none)."""
        return self.get_input_processor().tokenizer

    async def stats(self) -> dict[str, Any]:
        """The engine's counters (``LLMEngine.stats()``: prefix-cache figures in tokens, pool
        and queue sizes), read on the engine thread between two steps."""
        return await self._call(self.engine.stats)

    async def cached_prefix_len(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of this prompt the prefix cache holds now, under
        ``cache_salt`` (no side effects: nothing is touched or evicted)."""
        return await self._call(self.engine.cached_prefix_len, list(token_ids), cache_salt)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (for measurements that start cold)."""
        await self._call(self.engine.reset_prefix_cache)

    async def flush_tiers(self) -> None:
        """Wait until the KV tiers hold every block computed so far (``LLMEngine.flush_tiers``).

        The engine thread takes a mark in the tiers' queue of writes between two steps (every
        request whose output the caller has seen has had its blocks handed over by then) and
        goes on stepping; the caller's event loop awaits the writes up to that mark."""
        await asyncio.wrap_future(await self._call(self.engine.tiers_written))

    # ---- requests (from a running event loop) ---------------------------------------
    def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                 request_id: str | None = None, cache_salt: str | None = None,
                 ) -> "RequestStream":
        """Queue a request now and return its outputs (cumulative, or as ``params.output_kind``
        says) as an async iterator.

        Call from a running event loop. The prompt is tokenized and checked on an input
        thread, never on the engine thread. The iterator raises what went wrong: ValueError /
        TypeError for bad input (nothing was queued), RequestFailedError (a step failed in a
        way traced to this request), EngineDeadError.
        Cancelling it, or closing it (``aclose()``) before the finished output, aborts the
        request; a stream that is merely dropped runs to its end in the engine.
        """
        if isinstance(prompt, ProcessedPrompt) and cache_salt is None:  # checked already: queue it now
            return self.generate_batch([(prompt, params)], [request_id])[0]
        request_id, mailbox = self._open(request_id)
        try:
            prepared = self._input_pool.submit(self._prepare, prompt, params, cache_salt)
        except RuntimeError:  # the pool has shut down
            self._reject(mailbox, EngineDeadError(self._dead_reason or "the engine has shut down"))
        else:
            prepared.add_done_callback(lambda done: self._queue_prepared(request_id, done, params, mailbox))
        return RequestStream(request_id, mailbox, self._abort_later, _output_kind(params))

    def generate_batch(self, requests: Sequence[tuple[ProcessedPrompt, SamplingParams | None]],
                       request_ids: Sequence[str | None] | None = None) -> list["RequestStream"]:
        """Queue prompts processed already (``get_input_processor()`` made them) so that they
        enter the engine together, between the same two steps: one engine batch.

        Call from a running event loop. Each stream behaves as one from ``generate()``.
        """
        ids = request_ids if request_ids is not None else [None] * len(requests)
        opened = [self._open(request_id) for request_id in ids]
        self._queue([(request_id, prompt, params, mailbox)
                     for (request_id, mailbox), (prompt, params) in zip(opened, requests, strict=True)])
        return [RequestStream(request_id, mailbox, self._abort_later, _output_kind(params))
                for (request_id, mailbox), (_, params) in zip(opened, requests)]

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError / TypeError for sampling parameters this engine cannot run."""
        self._input_template.check_params(params)

    async def preprocess(self, fn: Callable[[InputProcessor], Any]) -> Any:
        """``fn(inputs)`` on an input thread, with that thread's own InputProcessor: for work
        that grows with the input (chat templates, tokenizing), off the event loop and off
        the engine thread."""
        return await asyncio.wrap_future(self._input_pool.submit(lambda: fn(self._thread_inputs())))

    def _open(self, request_id: str | None) -> tuple[str, Mailbox]:
        """A request's id and its mailbox on the caller's event loop; it counts in flight from now."""
        mailbox = Mailbox(asyncio.get_running_loop())
        with self._lock:
            self._num_in_flight += 1
        return (request_id if request_id is not None else uuid.uuid4().hex), mailbox

    def _prepare(self, prompt: PromptType, params: SamplingParams | None, cache_salt: str | None
                 ) -> ProcessedPrompt:
        """Tokenize and check on an input thread (a long prompt never stalls a step)."""
        inputs = self._thread_inputs()
        if params is not None:
            inputs.check_params(params)
            inputs.compile_constraint(params)
        return inputs.process(prompt, cache_salt, params.truncate_prompt_tokens if params is not None else None)

    def _thread_inputs(self) -> InputProcessor:
        """This input thread's own copy of the engine's InputProcessor."""
        inputs = getattr(self._inputs, "processor", None)
        if inputs is None:
            inputs = self._inputs.processor = self.get_input_processor()
        return inputs

    def _queue_prepared(self, request_id: str, prepared: concurrent.futures.Future,
                        params: SamplingParams | None, mailbox: Mailbox) -> None:
        """Queue a prompt processed on an input thread, or hand its error to the caller."""
        try:
            processed = prepared.result()
        except Exception as failure:
            self._reject(mailbox, failure)
            return
        self._queue([(request_id, processed, params, mailbox)])

    def _queue(self, requests: list[_Queued]) -> None:
        """Queue the requests as one command, so that no step runs between their adds."""
        try:
            self._enqueue(lambda: self._add_all(requests))
        except EngineDeadError as error:
            for *_, mailbox in requests:
                self._reject(mailbox, error)

    def _reject(self, mailbox: Mailbox, error: Exception) -> None:
        """The request never entered the engine: it leaves, and its caller gets ``error``."""
        self._leave()
        mailbox.post(error)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """End these requests now (vLLM's ``abort``): each stream gets a finished output with
        finish_reason "abort". Ids not in flight (unknown, or finished already) are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self._call(self._abort_ids, ids)

    def abort_all(self, reason: str) -> None:
        """End every request in flight now, from any thread: each gets a finished output with
        finish_reason "abort" (streams end normally). ``reason`` is logged."""
        self._enqueue(lambda: self._abort_all(reason))

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` run on the engine thread between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as error:  # handed to the caller, never to the loop
                    future.set_exception(error)

        self._enqueue(command)
        return await asyncio.wrap_future(future)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Fail whatever is in flight with EngineDeadError and stop the engine thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._commands.put(_STOP)
        self._input_pool.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout)

    def _enqueue(self, command: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise EngineDeadError(self._dead_reason or "the engine has shut down")
            self._commands.put(command)

    def _abort_later(self, request_id: str, mailbox: Mailbox) -> None:
        """Queue an abort (after a shutdown there is nothing left to abort)."""
        try:
            self._enqueue(lambda: self._abort(request_id, mailbox))
        except EngineDeadError:
            pass

    def _leave(self) -> None:
        with self._lock:
            self._num_in_flight -= 1

    # ---- the engine thread -------------------------------------------------------
    def _run(self) -> None:
        """Run commands; step while the engine has work; sleep on the queue otherwise."""
        running = True
        while running:
            running = self._run_commands(wait=not self._has_work())
            if running and self._has_work():
                self._step()
        self._fail_in_flight(EngineDeadError("the engine has shut down"))
        self.engine.shutdown()  # its tensor-parallel workers, if any

    def _has_work(self) -> bool:
        return self._dead_reason is None and self.engine.has_unfinished_requests()

    def _run_commands(self, wait: bool) -> bool:
        """Run the queued commands (waiting for one if ``wait``); False once told to stop."""
        try:
            command = self._commands.get(block=wait)
        except queue.Empty:
            return True
        while command is not _STOP:
            try:
                command()
            except Exception:  # a command must never take the engine thread down
                logger.exception("an engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _add_all(self, requests: list[_Queued]) -> None:
        for request in requests:
            self._add(*request)

    def _add(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams | None,
             mailbox: Mailbox) -> None:
        if mailbox.closed:  # aborted before it was queued
            self._leave()
            return
        try:
            if self._dead_reason is not None:
                raise EngineDeadError(self._dead_reason)
            self.engine.add_request(request_id, prompt, params)
        except Exception as error:  # bad input: the caller gets it, the loop goes on
            self._reject(mailbox, error)
            return
        self._mailboxes[request_id] = mailbox

    def _abort(self, request_id: str, mailbox: Mailbox) -> None:
        """Abort the request if this mailbox still owns it (it may have finished already)."""
        if self._mailboxes.get(request_id) is mailbox:
            del self._mailboxes[request_id]
            self._leave()
            self.engine.abort_request(request_id)

    def _step(self) -> None:
        """One engine step. A step error that escapes the engine means the device or model is
        broken (the engine fails only the traced requests for any other): it is dead."""
        try:
            outputs = self.engine.step()
        except Exception as error:
            logger.exception("the engine is dead; failing the %d requests in flight", len(self._mailboxes))
            self._dead_reason = f"the engine failed: {error}"
            self._fail_in_flight(EngineDeadError(self._dead_reason))
            return
        for output in outputs:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        mailbox = self._mailboxes.get(output.request_id)
        if mailbox is None:
            return
        if output.finished:
            del self._mailboxes[output.request_id]
            self._leave()
        mailbox.post(RequestFailedError(output.error) if output.error else output)

    def _abort_all(self, reason: str) -> None:
        """Abort every request in flight; each mailbox gets the request's final output."""
        if self._mailboxes:
            logger.warning("aborting %d requests in flight: %s", len(self._mailboxes), reason)
        self._abort_ids(list(self._mailboxes))

    def _abort_ids(self, request_ids: list[str]) -> None:
        """Abort those of ``request_ids`` in flight; each one's mailbox gets its final output."""
        for request_id in request_ids:
            output = self.engine.abort_request(request_id) if request_id in self._mailboxes else None
            if output is not None:
                self._deliver(output)

    def _fail_in_flight(self, error: Exception) -> None:
        """Fail and abort every request in flight; an engine that cannot abort is dead."""
        failed, self._mailboxes = self._mailboxes, {}
        for request_id, mailbox in failed.items():
            self._leave()
            mailbox.post(error)
            try:
                self.engine.abort_request(request_id)
            except Exception as abort_error:
                self._dead_reason = f"the engine could not recover from a failed step: {abort_error!r}"
                logger.exception("aborting %s failed; the engine takes no more requests", request_id)


def _output_kind(params: SamplingParams | None) -> RequestOutputKind:
    return RequestOutputKind.CUMULATIVE if params is None else params.output_kind
