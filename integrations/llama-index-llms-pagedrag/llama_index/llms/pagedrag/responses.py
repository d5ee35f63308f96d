"""pagedrag's generations as LlamaIndex responses.

Invariants: a whole response (and the last piece of a stream) carries the request's token
counts twice: flat in ``additional_kwargs`` (finish_reason, prompt_tokens,
completion_tokens, cached_tokens, cache_hit_rate, tier_cache_hits ({"host": m, "disk": n}:
of the cache hits, those loaded from each KV tier), and where the prompt tokens came from:
prefix_cache_hits (= cached_tokens), chunk_cache_hits, chunk_tokens_recomputed,
prompt_tokens_computed; see ``chunk_reuse_figures``) and in ``raw`` next to OpenAI's
``usage`` object (prompt_tokens, completion_tokens, total_tokens,
prompt_tokens_details.cached_tokens, the chunk figures and tier_cache_hits), which
LlamaIndex's TokenCountingHandler reads.
``raw["choices"]`` holds every one of the n completions; the response's text is the first.
Earlier pieces of a stream carry no counts (raw None, additional_kwargs empty). Tool calls
are the message's (``message.additional_kwargs["tool_calls"]``), never the response's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, CompletionResponse, LogProb, MessageRole

from pagedrag.client import Generation, TokenLogprob
from pagedrag.rag.chunk_reuse_support import chunk_reuse_figures


def completion_response(generation: Generation, text: str | None = None) -> CompletionResponse:
    """A whole completion (``text`` None), or a stream piece with the ``text`` so far."""
    return CompletionResponse(text=generation.text if text is None else text,
                              delta=None if text is None else generation.text, **_details(generation))


def chat_response(generation: Generation, text: str | None = None) -> ChatResponse:
    """A whole chat reply (``text`` None), or a stream piece with the ``text`` so far; the
    generation's tool calls (a stream's come with its last piece) in the message's
    ``additional_kwargs["tool_calls"]``, as OpenAI's chat API writes them."""
    calls = [call.to_openai() for call in generation.tool_calls]
    message = ChatMessage(role=MessageRole.ASSISTANT, content=generation.text if text is None else text,
                          additional_kwargs={"tool_calls": calls} if calls else {})
    return ChatResponse(message=message, delta=None if text is None else generation.text, **_details(generation))


def running_text(pieces: Iterator[Generation]) -> Iterator[tuple[Generation, str]]:
    """Each streamed piece with the text so far."""
    text = ""
    for piece in pieces:
        text += piece.text
        yield piece, text


async def arunning_text(pieces: AsyncIterator[Generation]) -> AsyncIterator[tuple[Generation, str]]:
    text = ""
    async for piece in pieces:
        text += piece.text
        yield piece, text


def _details(generation: Generation) -> dict[str, Any]:
    """raw, additional_kwargs and logprobs of a response (counts only once finished)."""
    logprobs = None if generation.logprobs is None else [_position(entry) for entry in generation.logprobs]
    if generation.finish_reason is None:
        return {"raw": None, "additional_kwargs": {}, "logprobs": logprobs}
    figures = {**generation.cache_figures(), **chunk_reuse_figures(generation)}
    choices = [{"index": index, "text": choice.text, "finish_reason": choice.finish_reason}
               for index, choice in enumerate(generation.choices)]
    return {"raw": {**figures, "usage": generation.usage(), "choices": choices},
            "additional_kwargs": figures, "logprobs": logprobs}


def _position(entry: TokenLogprob) -> list[LogProb]:
    """One position as LlamaIndex's OpenAI LLM gives it: the top alternatives (the sampled
    token alone when none were asked for)."""
    alternatives = entry.top or ((entry.token, entry.logprob),)
    return [LogProb(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))
            for token, logprob in alternatives]
