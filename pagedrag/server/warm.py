"""POST /v1/warm, pagedrag's own route: compute and store the KV of prompts without generating,
so that the first queries sharing them hit the prefix cache, and, with KV tiers
(--kv-offloading-size, --kv-disk-path), so that they are found after the pool let them go, after
a restart, or by another replica on the same disk tier.

A warm-up is the completion request (or the chat requests) it stands for
(``WarmRequest.completion_request`` / ``chat_requests``), with max_tokens=1 and greedy sampling,
so its input is checked by the very code that checks those (``Serving.check``,
``completion_prompts``, ``chat_prompt``, ``start``): the same 400s, 404s and, counted as one
sequence per prompt, the same 503 over --max-queue. The answer comes once the KV tiers hold
every block (``AsyncLLMEngine.flush_tiers``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field, model_validator
from starlette.requests import Request

from pagedrag.engine.inputs import ProcessedPrompt
from pagedrag.server.errors import as_api_error
from pagedrag.server.openapi import error_responses
from pagedrag.server.protocol import (MAX_PROMPT_CHUNKS, MAX_PROMPTS_PER_REQUEST, ChatCompletionRequest,
                                      ChatMessage, CompletionRequest, StrictRequest)
from pagedrag.server.serving import Serving
from pagedrag.server.streams import unless_disconnected

router = APIRouter()
Conversation = Annotated[list[ChatMessage], Field(min_length=1)]  # as ChatCompletionRequest.messages
WARM_SAMPLING = {"max_tokens": 1, "temperature": 0.0}
"""The one token a warm-up samples (and throws away): the prompt's last token is computed
anyway, as for every request, so the cost over the prefill is one sampling step."""


class WarmRequest(StrictRequest):
    """Prompts to warm: ``prompt`` (a text, a list of texts, a token-id list or a list of them) or
    ``prompt_segments`` (one prompt as segments), as /v1/completions takes them; or
    ``conversations``, each a /v1/chat/completions ``messages`` list, rendered as that route
    renders it (with the generation prompt). ``prompt_chunks`` and ``cache_salt`` as both routes
    take them: with chunk reuse, a chunk's KV is stored for reuse at any position.

    Invariant: exactly one of the completion form (prompt / prompt_segments) and
    ``conversations`` is given (the completion form's own rules are CompletionRequest's).
    """

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    prompt_segments: list[Any] | None = None
    conversations: list[Conversation] | None = Field(None, min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)
    prompt_chunks: list[str] | None = Field(None, max_length=MAX_PROMPT_CHUNKS)
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _one_form(self) -> "WarmRequest":
        completion = self.prompt is not None or self.prompt_segments is not None
        if completion == (self.conversations is not None):
            raise ValueError("give prompt (or prompt_segments) or conversations, exactly one of them")
        return self

    def completion_request(self) -> CompletionRequest:
        """The (possibly batched) completion request this warm-up stands for."""
        return CompletionRequest(prompt=self.prompt, prompt_segments=self.prompt_segments, **self._shared())

    def chat_requests(self) -> list[ChatCompletionRequest]:
        """One chat request per conversation."""
        return [ChatCompletionRequest(messages=messages, **self._shared()) for messages in self.conversations]

    def _shared(self) -> dict[str, Any]:
        return {"model": self.model, "prompt_chunks": self.prompt_chunks, "cache_salt": self.cache_salt,
                **WARM_SAMPLING}


class WarmResponse(BaseModel):
    """What a warm-up did: ``prompts`` run, their ``prompt_tokens``, and ``cached_tokens``, those
    of them cached already (prefix-cache hits, tier hits and, with chunk reuse, chunk hits)."""

    object: Literal["warm"] = "warm"
    prompts: int
    prompt_tokens: int
    cached_tokens: int


@router.post("/v1/warm", responses=error_responses(400, 404, 503))
async def warm(body: WarmRequest, http_request: Request) -> WarmResponse:
    """pagedrag's extension (not OpenAI's): compute and store the KV of the prompts without
    generating, and answer once the KV tiers hold it. Input is checked as /v1/completions (or
    /v1/chat/completions, for ``conversations``) checks it: 400 with OpenAI's error body for bad
    input, 404 for an unknown model, 503 (code queue_full) when the prompts would take the server
    over --max-queue."""
    serving: Serving = http_request.app.state.serving
    requests = [body.completion_request()] if body.conversations is None else body.chat_requests()
    envelope, params = serving.check(requests[0], copies=len(requests))
    prompts = await unless_disconnected(
        http_request, _prompts(serving, requests, serving.cache_salt(http_request, requests[0])))
    run = await serving.start(http_request, params, prompts, envelope, requests[0])
    await unless_disconnected(http_request, run.final())
    try:
        await serving.engine.flush_tiers()
    except Exception as error:
        raise as_api_error(error) from error
    usage = run.usage()
    details = usage.prompt_tokens_details
    return WarmResponse(prompts=len(prompts), prompt_tokens=usage.prompt_tokens,
                        cached_tokens=details.cached_tokens + details.chunk_cache_hits)


async def _prompts(serving: Serving, requests: list[CompletionRequest | ChatCompletionRequest],
                   salt: str | None) -> list[ProcessedPrompt]:
    """Each prompt tokenized (and cut around the chunks, with chunk reuse) off the event loop."""
    if isinstance(requests[0], CompletionRequest):
        return await serving.completion_prompts(requests[0], salt)
    return [await serving.chat_prompt(request, salt) for request in requests]
