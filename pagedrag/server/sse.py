"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` per chunk, then
``data: [DONE]\\n\\n``. An error after the response has started is sent as one
``data: {"error": {...}}`` event before [DONE] (the status line is already 200)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from pagedrag.server.errors import as_api_error

DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


async def _events(chunks: AsyncIterator[BaseModel], on_close: Callable[[], Awaitable[None]],
                  ) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
        yield DONE
    except Exception as error:
        yield sse_event(as_api_error(error).body)
        yield DONE
    finally:
        await on_close()


def sse_response(chunks: AsyncIterator[BaseModel], on_close: Callable[[], Awaitable[None]],
                 ) -> StreamingResponse:
    """Stream ``chunks``; ``on_close`` (idempotent) runs once the stream ends, however it
    ends: also when the client is gone before the first chunk (as a background task)."""
    return StreamingResponse(_events(chunks, on_close), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"}, background=BackgroundTask(on_close))
