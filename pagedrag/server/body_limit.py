"""Request bodies over --max-request-bytes get 413 before anything parses them."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedrag.server.errors import APIError, BodyTooLarge


class BodySizeLimitMiddleware:
    """Refuses a declared Content-Length over the limit at once; a body sent without one
    (chunked) is counted as it arrives and refused once it passes the limit, so at most
    ``max_bytes`` of it is ever held. A plain ASGI middleware: responses pass untouched."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self._too_large())
            return message

        return counted

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} "
                             "bytes (--max-request-bytes)", code="request_too_large")
