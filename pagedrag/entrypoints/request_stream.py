"""A request's outputs on their way from the engine thread to the caller's event loop:
a mailbox per request, read as an async iterator (RequestStream)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from pagedrag.outputs import CompletionOutput, RequestOutput
from pagedrag.sampling_params import RequestOutputKind


class Mailbox:
    """The outputs of one request, from the engine thread to the caller's event loop.

    Outputs are cumulative, so an unread output is superseded by a newer one (latest
    wins: a slow reader never makes memory grow). An error is final: it supersedes
    any unread output and nothing replaces it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self.closed = False  # the caller gave up on the request (read on the engine thread)

    def post(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe; a mailbox whose event loop has closed drops the item."""
        try:
            self._loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:
            pass

    def _put(self, item: RequestOutput | BaseException) -> None:
        if not isinstance(self._item, BaseException):
            self._item = item
            self._ready.set()

    async def get(self) -> RequestOutput:
        """The newest output; raises the request's error if it failed."""
        await self._ready.wait()
        item = self._item
        if isinstance(item, BaseException):
            raise item
        self._item = None
        self._ready.clear()
        return item


class RequestStream:
    """The outputs of one request as an async iterator; it ends after the finished output.

    ``kind`` (SamplingParams.output_kind) shapes what it yields: each output cumulative, only
    what is new since the previous one (DELTA: every completion that changed, its new tokens,
    text and logprobs; prompt logprobs on the first output only), or the finished output alone.
    Closing it before then, or cancelling a task waiting on it, aborts the request
    (even if it was never iterated).
    """

    def __init__(self, request_id: str, mailbox: Mailbox, abort: Callable[[str, Mailbox], None],
                 kind: RequestOutputKind = RequestOutputKind.CUMULATIVE):
        self.request_id = request_id
        self._mailbox = mailbox
        self._abort = abort  # queues the request's abort on the engine thread
        self._done = False
        self._kind = kind
        self._previous: RequestOutput | None = None  # DELTA: the last cumulative output yielded from

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            output = await self._next_cumulative()
            if output.finished or self._kind is not RequestOutputKind.FINAL_ONLY:
                break
        if self._kind is not RequestOutputKind.DELTA:
            return output
        delta, self._previous = delta_output(output, self._previous), output
        return delta

    async def _next_cumulative(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            output = await self._mailbox.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        except BaseException:
            self._done = True
            raise
        self._done = output.finished
        return output

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._mailbox.closed = True
            self._abort(self.request_id, self._mailbox)


def delta_output(output: RequestOutput, previous: RequestOutput | None) -> RequestOutput:
    """What ``output`` (cumulative) adds to ``previous`` (the last cumulative output of the same
    request, or None): the completions with new tokens, text or a finish, each cut to what is new."""
    before = {} if previous is None else {c.index: c for c in previous.outputs}
    changed = [cut for c in output.outputs if (cut := _completion_delta(c, before.get(c.index))) is not None]
    return dataclasses.replace(output, outputs=changed,
                               prompt_logprobs=output.prompt_logprobs if previous is None else None)


def _completion_delta(now: CompletionOutput, before: CompletionOutput | None) -> CompletionOutput | None:
    if before is None:
        return now
    seen_tokens, seen_text = len(before.token_ids), len(before.text)
    if len(now.token_ids) == seen_tokens and len(now.text) == seen_text and now.finish_reason == before.finish_reason:
        return None
    return dataclasses.replace(now, text=now.text[seen_text:], token_ids=now.token_ids[seen_tokens:],
                               logprobs=None if now.logprobs is None else now.logprobs[seen_tokens:])
