"""POST /v1/completions: text (or token ids) in, n completions per prompt out."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from pagedrag.deltas import ChoiceDelta
from pagedrag.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from pagedrag.server.serving import Envelope, Run, Serving
from pagedrag.server.sse import sse_response
from pagedrag.server.streams import unless_disconnected


async def create_completion(serving: Serving, request: CompletionRequest,
                            http_request: Request) -> CompletionResponse | StreamingResponse:
    envelope, params = serving.check(request)
    prompts = await unless_disconnected(
        http_request, serving.completion_prompts(request, serving.cache_salt(http_request, request)))
    run = await serving.start(http_request, params, prompts, envelope, request)
    if request.stream:
        return sse_response(_chunks(serving, request, envelope, run), run.close)
    deltas = await unless_disconnected(http_request, run.final())
    return CompletionResponse(**envelope.fields, choices=[_choice(serving, request, d) for d in deltas],
                              usage=run.usage(), prompt_logprobs=run.prompt_logprobs())


async def _chunks(serving: Serving, request: CompletionRequest, envelope: Envelope,
                  run: Run) -> AsyncIterator[CompletionResponse]:
    """One chunk per choice delta, then (if asked) a usage chunk with no choices."""
    async for delta in run.deltas():
        yield CompletionResponse(**envelope.fields, choices=[_choice(serving, request, delta)])
    if request.include_usage:
        yield CompletionResponse(**envelope.fields, choices=[], usage=run.usage())


def _choice(serving: Serving, request: CompletionRequest, delta: ChoiceDelta) -> CompletionChoice:
    top = request.num_logprobs()
    return CompletionChoice(index=delta.index, text=delta.text,
                            logprobs=None if top is None else serving.logprobs.completion(
                                delta, top, request.return_tokens_as_token_ids),
                            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
