"""POST /generate: vLLM's legacy demo API, which LlamaIndex's VllmServer posts to.

The body is a prompt plus SamplingParams fields by name ({"prompt", "stream", "n",
"temperature", "max_tokens", ...}); the answer is {"text": [prompt + completion, one per
choice]}. Streamed, each update is that JSON object followed by a NUL byte ("\\0"), as
vLLM's api_server sends it. It runs through the same checks as /v1/completions.
"""

from __future__ import annotations

import json
from typing import ClassVar
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from pagedrag.server.errors import APIError
from pagedrag.server.openapi import error_responses
from pagedrag.server.protocol import CompletionRequest, StrictRequest
from pagedrag.server.serving import Serving
from pagedrag.server.streams import unless_disconnected

router = APIRouter()


class GenerateRequest(StrictRequest):
    """The legacy body: a text prompt; every other field is a sampling field of /v1/completions
    (checked there, so unknown ones are not logged here)."""

    WARN_UNKNOWN: ClassVar[bool] = False

    prompt: str
    stream: bool = False


@router.post("/generate", responses=error_responses(400, 404, 503))
async def generate(body: GenerateRequest, http_request: Request):
    serving: Serving = http_request.app.state.serving
    request = _as_completion(body)
    envelope, params = serving.check(request)
    prompts = await unless_disconnected(
        http_request, serving.completion_prompts(request, serving.cache_salt(http_request, request)))
    run = await serving.start(http_request, params, prompts, envelope, request)
    texts = [body.prompt] * params.n
    if body.stream:
        return StreamingResponse(_updates(run, texts), media_type="application/octet-stream")
    for delta in await unless_disconnected(http_request, run.final()):
        texts[delta.index] += delta.text
    return JSONResponse({"text": texts})


def _as_completion(body: GenerateRequest) -> CompletionRequest:
    fields = {**(body.model_extra or {}), "prompt": body.prompt, "stream": body.stream}
    if fields.pop("use_beam_search", False):
        raise APIError(400, "use_beam_search is not supported by /generate; use LLM.beam_search offline",
                       param="use_beam_search")
    try:
        return CompletionRequest.model_validate(fields)
    except ValueError as error:
        raise APIError(400, str(error)) from error


async def _updates(run, texts: list[str]) -> AsyncIterator[bytes]:
    """The cumulative texts after each delta, NUL-terminated; the run is closed (aborting
    what is left) however the stream ends."""
    try:
        async for delta in run.deltas():
            texts[delta.index] += delta.text
            yield (json.dumps({"text": texts}) + "\0").encode("utf-8")
    finally:
        await run.close()
