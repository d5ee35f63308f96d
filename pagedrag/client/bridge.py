"""Synchronous calls into the async client, through one anyio BlockingPortal.

The portal (an event loop on a daemon thread; anyio >= 4.5) is started on first use,
serves the whole process and is stopped at exit. Synchronous calls therefore work where an
event loop is already running (Jupyter) and from many threads at once, and the remote
client keeps one pool of connections on the portal's loop. A synchronous call from the
portal's own thread raises RuntimeError (it would wait for itself). A process forked from
one that used the portal starts a portal of its own.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

T = TypeVar("T")
_END = object()
_portal: BlockingPortal | None = None
_portal_lock = threading.Lock()
_portal_context = contextlib.ExitStack()  # holds the portal open for the process's life


async def gather_or_cancel(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Every awaitable's result, in order, run at once; the first to fail (or the caller's
    cancellation) cancels the others, which aborts their requests, and is raised once they
    have ended."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def run_sync(awaitable: Awaitable[T]) -> T:
    """Run a coroutine to its end from synchronous code and return its result; if the
    caller is interrupted (Ctrl-C), the coroutine is cancelled (and its request aborted)."""
    try:
        future = _shared_portal().start_task_soon(_wait_for, awaitable)
    except RuntimeError:
        getattr(awaitable, "close", lambda: None)()  # never awaited: no warning about it
        raise
    try:
        return future.result()
    finally:
        future.cancel()  # a no-op once done


def iterate_sync(items: AsyncIterator[T]) -> Iterator[T]:
    """The items of an async iterator, pumped by one task on the portal's loop (a stream is
    read by a single task from start to end). Leaving the loop early, or dropping the
    iterator, cancels the pump, which closes ``items``; an error of ``items`` is raised here."""
    handoff: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()

    async def pump() -> None:
        try:
            async for item in items:
                handoff.put((item, None))
            handoff.put((_END, None))
        except Exception as error:  # raised again on the caller's side
            handoff.put((_END, error))

    future = _shared_portal().start_task_soon(pump)
    try:
        while True:
            item, error = handoff.get()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        future.cancel()


async def _wait_for(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _shared_portal() -> BlockingPortal:
    """The process's portal, started on first use and stopped at exit."""
    global _portal
    with _portal_lock:
        if _portal is None:
            _portal = _portal_context.enter_context(start_blocking_portal())
            atexit.register(_stop_portal, _portal)
        return _portal


def _forget_portal_after_fork() -> None:
    """In a forked child the portal's thread does not exist: start a new portal on first use
    there (the parent's would never run a task), and never wait for the old one at exit."""
    global _portal, _portal_lock, _portal_context
    atexit.unregister(_stop_portal)
    _LEFT_BY_FORK.append(_portal_context)  # never finalized: closing it would wait for the missing thread
    _portal, _portal_lock, _portal_context = None, threading.Lock(), contextlib.ExitStack()


_LEFT_BY_FORK: list[contextlib.ExitStack] = []


os.register_at_fork(after_in_child=_forget_portal_after_fork)


def _stop_portal(portal: BlockingPortal) -> None:
    """Cancel what still runs on the portal, then end its thread. Left to the garbage
    collector, the portal's context would wait for its thread while the interpreter
    finalizes (when threads no longer run), and the process would hang at exit."""
    portal.call(portal.stop, True)
    _portal_context.close()
