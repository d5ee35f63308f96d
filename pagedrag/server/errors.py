"""Errors as OpenAI reports them: {"error": {"message", "type", "param", "code"}}.

Status codes: 400 bad input (FastAPI's 422 validation errors and malformed JSON
included), 401 missing or wrong API key, 404 unknown model (as OpenAI), 413 body
over --max-request-bytes, 500 a step failed in a way traced to this request (the
others went on), 503 over --max-queue or engine dead. Every error a handler raises
is turned into that body here, so no route formats errors itself. Messages may echo
client text: anything that is not valid UTF-8 in them is escaped, so the body always
encodes.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedrag.engine.recovery import EngineDeadError, RequestFailedError
from pagedrag.server.protocol import ErrorDetail, ErrorResponse
from pagedrag.server.streams import ClientDisconnected

logger = logging.getLogger("pagedrag")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "service_unavailable_error"}
# nginx's code for "the client closed the connection"; nobody receives the response
CLIENT_CLOSED_REQUEST = 499


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        message = _encodable(message)
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorDetail(
            message=message, type=_TYPES.get(status, "server_error"),
            param=None if param is None else _encodable(param), code=code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status)


class BodyTooLarge(HTTPException):
    """A body that passed --max-request-bytes while it was read. Raised inside the body read,
    where FastAPI re-raises only HTTPExceptions; answered as ``error`` (413 request_too_large)."""

    def __init__(self, error: APIError):
        super().__init__(error.status, error.body.error.message)
        self.error = error


def _encodable(text: str) -> str:
    """``text`` with lone surrogates escaped (\\udc80), so that it always encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def as_api_error(error: Exception) -> APIError:
    """The APIError for what an engine stream raised: bad input is 400, a dead engine 503."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, (ValueError, TypeError)):
        return APIError(400, str(error))
    if isinstance(error, EngineDeadError):
        return engine_dead(str(error))
    if isinstance(error, RequestFailedError):
        return APIError(500, str(error), code="request_failed")
    return APIError(500, f"internal error: {error}")


def engine_dead(reason: str) -> APIError:
    return APIError(503, reason, code="engine_dead")


def _validation_error(errors: list[dict]) -> APIError:
    """One 400 naming every invalid field (param: the first one, dotted)."""
    def where(error: dict) -> str:
        return ".".join(str(part) for part in error["loc"] if part != "body")

    if any(error["type"] == "json_invalid" for error in errors):
        return APIError(400, f"malformed JSON body: {errors[0].get('ctx', {}).get('error', errors[0]['msg'])}")
    def param(error: dict) -> str | None:  # a validator's ParameterError names its field
        return where(error) or getattr(error.get("ctx", {}).get("error"), "param", None)

    def described(error: dict) -> str:  # pydantic's "Value error, " prefix is noise to a client
        text = error["msg"].removeprefix("Value error, ")
        return f"{where(error)}: {text}" if where(error) else text

    message = "; ".join(described(error) for error in errors)
    return APIError(400, message, param=param(errors[0]))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(list(error.errors())).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        if isinstance(error, BodyTooLarge):
            return error.error.response()
        return APIError(error.status_code, str(error.detail)).response()

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, __: ClientDisconnected) -> JSONResponse:
        return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request")
        return APIError(500, f"internal error: {error!r}").response()
