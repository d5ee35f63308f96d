"""Async plumbing for the endpoints: merging engine streams, racing a client's disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")
_END = object()


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several async iterators as they come, each with its iterator's index.

    The first error of any iterator is raised. However the merge ends (exhausted,
    error, cancelled, closed), every iterator is closed when it does, so engine
    requests behind them are aborted. One item at a time is buffered: a slow reader
    slows the iterators down instead of piling up items.
    """
    handoff: asyncio.Queue = asyncio.Queue(maxsize=1)

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await handoff.put((index, item))
            await handoff.put((index, _END))
        except Exception as error:
            await handoff.put((index, error))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await handoff.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()
        await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected.

    Only for use once the request body has been read (the next ASGI message is then
    the disconnect).
    """
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
    if not work_task.done():  # the client left first: the work's cancellation is under way
        raise ClientDisconnected()
    return work_task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
