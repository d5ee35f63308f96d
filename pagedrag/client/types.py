"""What the integrations call: the EngineClient interface and its result types.

A back end (in process, remote) implements five async primitives; the checked, completion,
chat, batch and synchronous forms are derived here once, so that both back ends behave alike.
A text prompt is a completion, a list of ``{"role", "content"}`` messages a chat, checked
by ``pagedrag.engine.inputs.check_conversation`` (the one rule, the engine's own). With
``chunks`` (the retrieved chunks' texts) an engine running with chunk reuse
(enable_chunk_reuse) cuts the prompt around them and reuses each chunk's KV wherever it
lands; other engines ignore them.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedrag.engine.inputs import check_conversation
from pagedrag.kv_tiers.store import TIER_NAMES, tier_hits as _add_tier_hits
from pagedrag.models.loader import EMBEDDED_NAME
from pagedrag.sampling_params import SamplingParams
from pagedrag.client.bridge import gather_or_cancel, iterate_sync, run_sync
from pagedrag.tools import ToolCall

DEFAULT_MODEL_NAME = EMBEDDED_NAME
Messages = list[dict[str, Any]]
Prompt = str | Messages
"""A completion prompt (text) or a chat conversation (messages)."""
KV_TIERS = TIER_NAMES
"""The engine's KV tiers under its pool, nearest first: the keys of ``Generation.tier_cache_hits``."""


def tier_hits(*figures: Mapping[str, int] | None) -> dict[str, int]:
    """Prompt tokens loaded from each KV tier, every tier of KV_TIERS named (0: none), from
    the engine's ``RequestOutput.num_tier_hit_tokens`` or a server's
    ``prompt_tokens_details.tier_cache_hits`` (empty without tiers; None from a server that
    does not report them); several figures are added up tier by tier."""
    return _add_tier_hits(dict.fromkeys(KV_TIERS, 0), *figures)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its text, its log probability, and the most likely tokens at its
    position (text, logprob), best first, as many as were asked for."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Generation:
    """One completion, or one piece of a stream.

    A stream yields pieces whose ``text`` is new text and whose ``finish_reason`` is None,
    then a last piece (its text possibly empty) with the finish reason and the request's
    token counts; the counts of earlier pieces are 0, so summing pieces gives the totals.
    ``logprobs`` (when asked for) cover exactly the tokens of ``text``.

    ``tool_calls`` are the calls a chat with tools made (then ``finish_reason`` is
    "tool_calls" and ``text`` the content besides them, often empty); in a stream they come
    with the last piece.

    A whole generation of n > 1 completions is the first one, with the other n - 1 in
    ``more`` (each with its own text, finish reason and logprobs). The token counts are the
    request's, as OpenAI's usage counts them (completion_tokens over all n), and are on the
    first only: those of ``more`` are 0.

    Of the prompt tokens, ``cached_tokens`` came from the prefix cache and, with chunk reuse,
    ``chunk_cache_hits`` from chunks cached at another position; the model computed the rest
    (``prompt_tokens_computed``), ``chunk_tokens_recomputed`` of them tokens of reused chunks.
    Of the cache hits (``cached_tokens`` and ``chunk_cache_hits``), ``tier_cache_hits`` counts
    those loaded from each KV tier (``{"host": m, "disk": n}``, every tier named: see
    ``tier_hits``; all 0 without tiers, or from a server that does not report them).
    """

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    more: tuple["Generation", ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    chunk_cache_hits: int = 0
    chunk_tokens_recomputed: int = 0
    tier_cache_hits: dict[str, int] = field(default_factory=tier_hits, hash=False)

    @classmethod
    def joined(cls, pieces: Sequence["Generation"]) -> "Generation":
        """The whole Generation of a stream's pieces: texts and logprobs joined, the last
        piece's finish reason and counts."""
        last = pieces[-1] if pieces else cls("")
        logprobs = None if last.logprobs is None else tuple(entry for p in pieces for entry in p.logprobs or ())
        return dataclasses.replace(last, text="".join(piece.text for piece in pieces), logprobs=logprobs)

    @property
    def choices(self) -> tuple["Generation", ...]:
        """Every completion of the request, the first one included, in order."""
        return (dataclasses.replace(self, more=()), *self.more)

    @property
    def cache_hit_rate(self) -> float:
        """The share of prompt tokens served from the prefix cache."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prompt_tokens_computed(self) -> int:
        """Prompt tokens the model computed: neither prefix-cache nor chunk-cache hits."""
        return self.prompt_tokens - self.cached_tokens - self.chunk_cache_hits

    def cache_figures(self) -> dict[str, Any]:
        """Finish reason, token counts, hit rate and tier hits, as the integrations report them."""
        return {"finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "cache_hit_rate": self.cache_hit_rate, "tier_cache_hits": dict(self.tier_cache_hits)}

    def usage(self) -> dict[str, Any]:
        """The token counts as OpenAI's ``usage`` object spells them (what LlamaIndex's
        TokenCountingHandler reads), cached prompt tokens in prompt_tokens_details with the
        chunk-reuse and tier figures that ``pagedrag serve`` adds there."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens,
                                          "chunk_cache_hits": self.chunk_cache_hits,
                                          "chunk_tokens_recomputed": self.chunk_tokens_recomputed,
                                          "prompt_tokens_computed": self.prompt_tokens_computed,
                                          "tier_cache_hits": dict(self.tier_cache_hits)}}


@dataclass(frozen=True)
class ToolRequest:
    """A chat's tools, as OpenAI's chat API takes them: ``tools`` ([{"type": "function",
    "function": {"name", "description", "parameters"}}]), ``tool_choice`` ("none", "auto",
    "required" or {"type": "function", "function": {"name": ...}}; None: "auto" with
    tools) and ``parallel_tool_calls`` (None: allowed). Checked by the back end
    (pagedrag.tools.plan_tools; ValueError for a bad one)."""

    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice: str | dict | None,
           parallel_tool_calls: bool | None) -> "ToolRequest | None":
        """None when nothing about tools was said."""
        if tools is None and tool_choice is None and parallel_tool_calls is None:
            return None
        return cls(tools, tool_choice, parallel_tool_calls)


@dataclass(frozen=True)
class WarmSummary:
    """What a warm-up did: the ``prompts`` it ran, their ``prompt_tokens``, and ``cached_tokens``,
    those of them whose KV was cached already (prefix-cache and tier hits, and with chunk reuse
    chunk hits): ``LLM.warm``'s and POST /v1/warm's figures."""

    prompts: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def of(cls, generations: Sequence[Generation]) -> "WarmSummary":
        return cls(len(generations), sum(g.prompt_tokens for g in generations),
                   sum(g.cached_tokens + g.chunk_cache_hits for g in generations))

    def __add__(self, other: "WarmSummary") -> "WarmSummary":
        """Two warm-ups' figures together (``sum(summaries, WarmSummary())``)."""
        return WarmSummary(self.prompts + other.prompts, self.prompt_tokens + other.prompt_tokens,
                           self.cached_tokens + other.cached_tokens)


WARM_PARAMS = SamplingParams(temperature=0, max_tokens=1)
"""A warm-up's one greedy token, thrown away (the prompt's last token is computed anyway)."""


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves: the model's name and its context window in tokens."""

    model_name: str
    max_model_len: int


def check_single(params: SamplingParams, call: str = "complete() / chat()") -> None:
    """``complete``, ``chat`` and streams give one completion per prompt; ``generate`` and
    ``batch`` give all n."""
    if params.n != 1:
        raise ValueError(f"{call} returns one completion per prompt: n must be 1, got n={params.n} "
                         "(generate() and batch() return all n)")


class EngineClient(ABC):
    """What the integrations call. Back ends implement ``_generate``, ``_stream``, ``_warm``,
    ``astats`` and ``ainfo``; the checked, completion, chat, batch and synchronous forms
    are derived here.

    Invariants: every prompt is checked (a text, or a conversation ``check_conversation``
    accepts) and so are ``chunks`` (None or a tuple of texts) before anything is submitted;
    ``generate`` and ``batch`` return all n completions of a prompt (``Generation.more``),
    ``complete``, ``chat`` and the streams exactly one (n != 1 is a ValueError, never a
    quietly dropped choice).
    """

    @abstractmethod
    async def _generate(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None,
                        tools: ToolRequest | None = None, chunks: tuple[str, ...] | None = None) -> Generation:
        """All n completions of a checked text prompt or conversation (``tools``: only with a
        conversation; ``chunks``: the retrieved chunks' texts, checked)."""

    @abstractmethod
    def _stream(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None,
                tools: ToolRequest | None = None, chunks: tuple[str, ...] | None = None) -> AsyncIterator[Generation]:
        """The one completion (n == 1) of a checked prompt as it is generated (see
        ``Generation`` for the pieces). Closing the iterator early aborts the request."""

    @abstractmethod
    async def _warm(self, prompts: list[Prompt], cache_salt: str | None,
                    chunks: tuple[str, ...] | None) -> WarmSummary:
        """Run the checked prompts with WARM_PARAMS, then wait until the engine's KV tiers
        hold their blocks."""

    @abstractmethod
    async def astats(self) -> dict[str, Any]:
        """The engine's counters, keyed as ``pagedrag.LLM.stats()`` keys them."""

    @abstractmethod
    async def ainfo(self) -> EngineInfo:
        """The served model's name and context window."""

    @abstractmethod
    async def atokenize(self, text: str) -> list[int]:
        """The token ids of ``text`` as the engine's tokenizer reads it (no special tokens added)."""

    @property
    @abstractmethod
    def known_model_name(self) -> str | None:
        """The model's name where it is known without asking (a server's, once it was asked)."""

    # ---- any prompt, async ---------------------------------------------------------------
    async def agenerate(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None = None, *,
                        tools: list[dict] | None = None, tool_choice: str | dict | None = None,
                        parallel_tool_calls: bool | None = None, chunks: Sequence[str] | None = None) -> Generation:
        """The whole generation of a text prompt or a conversation (with its tools, see
        ToolRequest; ``chunks``: the retrieved chunks' texts, see the module doc): all n
        completions."""
        checked, chunks = _checked(prompt), _chunks(chunks)
        return await self._generate(checked, params, cache_salt,
                                    ToolRequest.of(tools, tool_choice, parallel_tool_calls), chunks)

    def astream(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None = None, *,
                tools: list[dict] | None = None, tool_choice: str | dict | None = None,
                parallel_tool_calls: bool | None = None, chunks: Sequence[str] | None = None
                ) -> AsyncIterator[Generation]:
        """The one completion of a text prompt or a conversation, as it is generated; tool
        calls (if any) come with the last piece."""
        checked, chunks = _checked(prompt), _chunks(chunks)
        check_single(params, "a stream")
        return self._stream(checked, params, cache_salt, ToolRequest.of(tools, tool_choice, parallel_tool_calls),
                            chunks)

    # ---- completion and chat, async -------------------------------------------------
    async def acomplete(self, prompt: str, params: SamplingParams, cache_salt: str | None = None, *,
                        chunks: Sequence[str] | None = None) -> Generation:
        check_single(params)
        return await self.agenerate(_text(prompt), params, cache_salt, chunks=chunks)

    async def achat(self, messages: Messages, params: SamplingParams, cache_salt: str | None = None, *,
                    chunks: Sequence[str] | None = None, **tools: Any) -> Generation:
        """One reply to a conversation; with ``tools`` (tools, tool_choice, parallel_tool_calls:
        see ToolRequest) it may be tool calls."""
        check_single(params)
        return await self.agenerate(_conversation(messages), params, cache_salt, chunks=chunks, **tools)

    def astream_complete(self, prompt: str, params: SamplingParams, cache_salt: str | None = None, *,
                         chunks: Sequence[str] | None = None) -> AsyncIterator[Generation]:
        return self.astream(_text(prompt), params, cache_salt, chunks=chunks)

    def astream_chat(self, messages: Messages, params: SamplingParams, cache_salt: str | None = None, *,
                     chunks: Sequence[str] | None = None, **tools: Any) -> AsyncIterator[Generation]:
        """The reply as it is generated; tool calls (if any) come with the last piece."""
        return self.astream(_conversation(messages), params, cache_salt, chunks=chunks, **tools)

    async def abatch(self, prompts: Sequence[Prompt], params: SamplingParams,
                     cache_salt: str | None = None) -> list[Generation]:
        """All prompts submitted at once (one engine batch), results (all n completions
        each) in their order. Every prompt is checked before any is submitted."""
        return await self._generate_all([_checked(prompt) for prompt in prompts], params, cache_salt)

    async def awarm(self, prompts: Prompt | Sequence[Prompt], cache_salt: str | None = None,
                    chunks: Sequence[str] | None = None) -> WarmSummary:
        """Compute and store the KV of ``prompts`` (a text, or a sequence of texts and
        conversations; every one checked before any is submitted) without generating, so that
        later requests sharing them hit the cache, and with KV tiers find them after a restart
        or in another engine on the same disk tier. ``chunks``: the retrieved chunks' texts
        these prompts hold (with chunk reuse, each one's KV is stored for reuse at any position).
        Returns once the engine's tiers hold every block."""
        return await self._warm([_checked(prompt) for prompt in _warm_prompts(prompts)], cache_salt, _chunks(chunks))

    async def _generate_all(self, checked: Sequence[Prompt], params: SamplingParams, cache_salt: str | None,
                            chunks: tuple[str, ...] | None = None) -> list[Generation]:
        """The checked prompts submitted at once (one engine batch), results in their order;
        if one fails (or the caller gives up), the others are aborted."""
        return await gather_or_cancel(self._generate(prompt, params, cache_salt, None, chunks) for prompt in checked)

    # ---- synchronous forms ------------------------------------------------------------
    def generate(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None = None, *,
                 chunks: Sequence[str] | None = None, **tools: Any) -> Generation:
        return run_sync(self.agenerate(prompt, params, cache_salt, chunks=chunks, **tools))

    def stream(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None = None, *,
               chunks: Sequence[str] | None = None, **tools: Any) -> Iterator[Generation]:
        return iterate_sync(self.astream(prompt, params, cache_salt, chunks=chunks, **tools))

    def complete(self, prompt: str, params: SamplingParams, cache_salt: str | None = None, *,
                 chunks: Sequence[str] | None = None) -> Generation:
        return run_sync(self.acomplete(prompt, params, cache_salt, chunks=chunks))

    def chat(self, messages: Messages, params: SamplingParams, cache_salt: str | None = None, *,
             chunks: Sequence[str] | None = None, **tools: Any) -> Generation:
        """``achat``, synchronously (``tools``: its tools, tool_choice, parallel_tool_calls)."""
        return run_sync(self.achat(messages, params, cache_salt, chunks=chunks, **tools))

    def stream_complete(self, prompt: str, params: SamplingParams, cache_salt: str | None = None, *,
                        chunks: Sequence[str] | None = None) -> Iterator[Generation]:
        return iterate_sync(self.astream_complete(prompt, params, cache_salt, chunks=chunks))

    def stream_chat(self, messages: Messages, params: SamplingParams, cache_salt: str | None = None, *,
                    chunks: Sequence[str] | None = None, **tools: Any) -> Iterator[Generation]:
        """``astream_chat``, synchronously."""
        return iterate_sync(self.astream_chat(messages, params, cache_salt, chunks=chunks, **tools))

    def batch(self, prompts: Sequence[Prompt], params: SamplingParams,
              cache_salt: str | None = None) -> list[Generation]:
        return run_sync(self.abatch(prompts, params, cache_salt))

    def warm(self, prompts: Prompt | Sequence[Prompt], cache_salt: str | None = None,
             chunks: Sequence[str] | None = None) -> WarmSummary:
        """``awarm``, synchronously."""
        return run_sync(self.awarm(prompts, cache_salt, chunks))

    def stats(self) -> dict[str, Any]:
        return run_sync(self.astats())

    def info(self) -> EngineInfo:
        return run_sync(self.ainfo())

    def tokenize(self, text: str) -> list[int]:
        return run_sync(self.atokenize(text))


def _checked(prompt: Any) -> Prompt:
    """A text as it is, a conversation once ``check_conversation`` accepts it."""
    return prompt if isinstance(prompt, str) else _conversation(prompt)


def _warm_prompts(prompts: Any) -> list:
    """warm's prompts as a list: one text, or a sequence of texts and conversations; a TypeError
    for anything else (a dict would be taken key by key)."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, dict):
        raise TypeError("warm takes a text or a sequence of texts and conversations, got a dict "
                        "(a prompt dict is pagedrag.LLM.warm's form; pass its text)")
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise TypeError(f"warm takes a text or a sequence of texts and conversations, got {type(prompts).__name__}")
    return list(prompts)


def _chunks(chunks: Any) -> tuple[str, ...] | None:
    """The retrieved chunks' texts as a tuple (None: none); TypeError for anything but a
    sequence of strings (one string is refused: it would be taken letter by letter)."""
    if chunks is None:
        return None
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Sequence):
        raise TypeError(f"chunks must be a sequence of texts (the retrieved chunks), got {type(chunks).__name__}")
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, str):
            raise TypeError(f"chunks[{index}] must be a text, got {type(chunk).__name__}")
    return tuple(chunks)


def _text(prompt: Any) -> str:
    if not isinstance(prompt, str):
        raise TypeError(f"a completion prompt must be a string, got {type(prompt).__name__}")
    return prompt


def _conversation(messages: Any) -> Messages:
    """The messages as a list, once ``check_conversation`` accepts them (ValueError otherwise)."""
    check_conversation(messages)
    return list(messages)
