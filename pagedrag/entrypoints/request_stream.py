"""A request's outputs on their way from the engine thread to the caller's event loop:
a mailbox per request, read as an async iterator (RequestStream)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pagedrag.outputs import RequestOutput


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

    Closing it before then, or cancelling a task waiting on it, aborts the request
    (even if it was never iterated).
    """

    def __init__(self, request_id: str, mailbox: Mailbox, abort: Callable[[str, Mailbox], None]):
        self.request_id = request_id
        self._mailbox = mailbox
        self._abort = abort  # queues the request's abort on the engine thread
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
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
