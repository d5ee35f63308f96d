"""What /openapi.json says each route answers.

Invariant: every status code a route can send is documented on it, each error code with
OpenAI's error body (ErrorResponse), and none it cannot send: FastAPI's automatic 422 is
removed, since validation errors are 400s here (errors.py). Routes name the codes their
own handlers raise (``error_responses``); the codes the app adds to every route of a
kind are added here (``install_openapi``): 500 to all (the last-resort handler), 413 to
every POST (the body limit), 401 to /v1/* when API keys are set (auth.py).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagedrag.server.auth import PROTECTED_PREFIXES
from pagedrag.server.protocol import ErrorResponse

MEANINGS = {
    400: "Invalid request: a field, the JSON body or the prompt cannot be served",
    401: "Missing or invalid API key (code invalid_api_key)",
    404: "The model named in the request is not served here",
    413: "The request body is larger than --max-request-bytes",
    500: "A step failed in a way traced to this request (code request_failed), or an internal error",
    503: "Over --max-queue sequences in flight, or the engine is dead (code engine_dead)",
}
EVENT_STREAM = {200: {"description": "The answer, or with stream=true its server-sent events",
                      "content": {"application/json": {}, "text/event-stream": {}}}}


def error_responses(*codes: int) -> dict[int, dict]:
    """FastAPI ``responses=`` for ``codes``, each an OpenAI error body."""
    return {code: {"model": ErrorResponse, "description": MEANINGS[code]} for code in codes}


def install_openapi(app: FastAPI, api_keys: bool) -> None:
    """Replace ``app.openapi`` by one that documents the app-wide codes (built once)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, operations in schema["paths"].items():
                for method, operation in operations.items():
                    _document(operation, _app_codes(path, method, api_keys))
            _drop_validation_schemas(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _app_codes(path: str, method: str, api_keys: bool) -> tuple[int, ...]:
    codes = [500]
    if method == "post":
        codes.append(413)
    if api_keys and path.startswith(PROTECTED_PREFIXES):
        codes.append(401)
    return tuple(codes)


def _document(operation: dict, codes: tuple[int, ...]) -> None:
    responses = operation["responses"]
    responses.pop("422", None)
    for code in codes:
        responses.setdefault(str(code), {"description": MEANINGS[code], "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})


def _drop_validation_schemas(schema: dict) -> None:
    """FastAPI's 422 bodies, no longer referenced (ErrorResponse is there: the generation
    routes name it)."""
    schemas = schema["components"]["schemas"]
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
