"""POST /v1/chat/completions: a conversation in, through the model's chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from pagedrag.deltas import ChoiceDelta
from pagedrag.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                       ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, DeltaMessage)
from pagedrag.server.serving import Envelope, Run, Serving
from pagedrag.server.sse import sse_response
from pagedrag.server.streams import unless_disconnected


async def create_chat_completion(serving: Serving, request: ChatCompletionRequest,
                                 http_request: Request) -> ChatCompletionResponse | StreamingResponse:
    envelope, params = serving.check(request)
    prompt = await unless_disconnected(
        http_request, serving.chat_prompt(request, serving.cache_salt(http_request, request)))
    run = await serving.start(http_request, params, [prompt], envelope)
    if request.stream:
        return sse_response(_chunks(serving, request, envelope, run), run.close)
    deltas = await unless_disconnected(http_request, run.final())
    choices = [ChatChoice(index=d.index, message=AssistantMessage(content=d.text),
                          logprobs=_logprobs(serving, request, d), finish_reason=d.finish_reason,
                          stop_reason=d.stop_reason) for d in deltas]
    return ChatCompletionResponse(**envelope.fields, choices=choices, usage=run.usage(),
                                  prompt_logprobs=run.prompt_logprobs())


async def _chunks(serving: Serving, request: ChatCompletionRequest, envelope: Envelope,
                  run: Run) -> AsyncIterator[ChatCompletionChunk]:
    """A role chunk per choice, then content deltas (a choice's last one carries its
    finish_reason), then (if asked) a usage chunk with no choices."""
    for index in range(request.n):
        role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
        yield ChatCompletionChunk(**envelope.fields, choices=[role])
    async for delta in run.deltas():
        choice = ChatChunkChoice(index=delta.index, delta=DeltaMessage(content=delta.text or None),
                                 logprobs=_logprobs(serving, request, delta),
                                 finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
        yield ChatCompletionChunk(**envelope.fields, choices=[choice])
    if request.include_usage:
        yield ChatCompletionChunk(**envelope.fields, choices=[], usage=run.usage())


def _logprobs(serving: Serving, request: ChatCompletionRequest, delta: ChoiceDelta) -> ChatLogprobs | None:
    top = request.num_logprobs()
    return None if top is None else serving.logprobs.chat(delta, top)
