"""API keys (Bearer tokens on /v1/* and the legacy /generate) and the per-tenant cache salt
derived from them.

Keys are compared in constant time and never logged; a tenant's salt is a sha256
of its key, so the key itself never reaches the engine either.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedrag.server.errors import APIError

PROTECTED_PREFIXES = ("/v1", "/generate")  # every route that generates (/tokenize runs no model, as vLLM's)


def bearer_token(headers: Headers) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, if any."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class ApiKeyMiddleware:
    """Answers 401 to requests of the protected routes (/v1/*, /generate) without one of the
    keys (health, metrics and tokenizing stay open).

    A plain ASGI middleware: it never wraps the response, so streaming and
    disconnect detection pass through untouched.
    """

    def __init__(self, app: ASGIApp, api_keys: list[str]):
        self.app = app
        self._keys = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES) and not self._allowed(scope):
            error = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        token = bearer_token(Headers(scope=scope))
        return token is not None and any(hmac.compare_digest(token.encode(), key) for key in self._keys)


def tenant_cache_salt(api_key: str | None, request_salt: str | None) -> str:
    """The cache salt of a request when salts are per API key.

    Every salt made here starts with the tenant part, so a request can never pick
    another tenant's salt (that would take the other key's hash); the request's own
    cache_salt then splits its tenant further.
    """
    tenant = hashlib.sha256(b"pagedrag-tenant\0" + api_key.encode()).hexdigest()[:32] if api_key else "anonymous"
    return f"tenant:{tenant}" if request_salt is None else f"tenant:{tenant}/{request_salt}"
