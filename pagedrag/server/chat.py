"""POST /v1/chat/completions: a conversation in, through the model's chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from pagedrag.deltas import ChoiceDelta
from pagedrag.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, DeltaMessage,
                                     DeltaToolCall, ToolCallItem)
from pagedrag.server.serving import Envelope, Run, Serving
from pagedrag.server.sse import sse_response
from pagedrag.server.streams import unless_disconnected
from pagedrag.tools import ToolCallSplitter, ToolPlan, whole_choice


async def create_chat_completion(serving: Serving, request: ChatCompletionRequest,
                                 http_request: Request) -> ChatCompletionResponse | StreamingResponse:
    envelope, params = serving.check(request)
    plan, params = serving.plan_tools(request, params)
    prompt = await unless_disconnected(
        http_request, serving.chat_prompt(request, serving.cache_salt(http_request, request), plan))
    run = await serving.start(http_request, params, [prompt], envelope, request)
    if request.stream:
        return sse_response(_chunks(serving, request, envelope, run, plan), run.close)
    deltas = await unless_disconnected(http_request, run.final())
    return ChatCompletionResponse(**envelope.fields, choices=[_choice(serving, request, d, plan) for d in deltas],
                                  usage=run.usage(), prompt_logprobs=run.prompt_logprobs())


def _choice(serving: Serving, request: ChatCompletionRequest, delta: ChoiceDelta,
            plan: ToolPlan | None) -> ChatChoice:
    """A whole choice: its content and the tool calls read out of it."""
    content, calls, finish_reason = whole_choice(plan, serving.tool_parser, delta.text, delta.finish_reason)
    message = AssistantMessage(content=content, tool_calls=[ToolCallItem(**call.to_openai()) for call in calls])
    return ChatChoice(index=delta.index, message=message, logprobs=_logprobs(serving, request, delta),
                      finish_reason=finish_reason, stop_reason=delta.stop_reason)


async def _chunks(serving: Serving, request: ChatCompletionRequest, envelope: Envelope,
                  run: Run, plan: ToolPlan | None) -> AsyncIterator[ChatCompletionChunk]:
    """A role chunk per choice, then content deltas (a choice's last one carries its
    tool calls and finish_reason), then (if asked) a usage chunk with no choices. Text that
    may be a tool call is held back until the choice ends (pagedrag.tools.stream)."""
    splitters = [ToolCallSplitter(plan, serving.tool_parser) for _ in range(request.n)]
    for index in range(request.n):
        role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
        yield ChatCompletionChunk(**envelope.fields, choices=[role])
    async for delta in run.deltas():
        text, calls = splitters[delta.index].feed(delta.text, delta.finish_reason is not None)
        logprobs = _logprobs(serving, request, delta)
        if not (text or calls or logprobs or delta.finish_reason):
            continue  # text held back as a possible tool call: nothing to send yet
        message = DeltaMessage(content=text or None, tool_calls=[
            DeltaToolCall(index=i, **call.to_openai()) for i, call in enumerate(calls)] or None)
        choice = ChatChunkChoice(index=delta.index, delta=message, logprobs=logprobs,
                                 finish_reason="tool_calls" if calls else delta.finish_reason,
                                 stop_reason=delta.stop_reason)
        yield ChatCompletionChunk(**envelope.fields, choices=[choice])
    if request.include_usage:
        yield ChatCompletionChunk(**envelope.fields, choices=[], usage=run.usage())


def _logprobs(serving: Serving, request: ChatCompletionRequest, delta: ChoiceDelta) -> ChatLogprobs | None:
    top = request.num_logprobs()
    return None if top is None else serving.logprobs.chat(delta, top, request.return_tokens_as_token_ids)
