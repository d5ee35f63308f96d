"""The in-process back end: an AsyncLLMEngine shared by every client of the same engine
arguments, so a second LLM object with the same arguments reuses the loaded model and its
prefix cache instead of loading again."""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

from pagedrag.entrypoints.async_engine import AsyncLLMEngine, RequestStream
from pagedrag.config import EngineArgs
from pagedrag.deltas import ChoiceCursor, ChoiceDelta
from pagedrag.engine.inputs import ProcessedPrompt
from pagedrag.outputs import CompletionOutput, Logprob, RequestOutput
from pagedrag.sampling_params import RequestOutputKind, SamplingParams
from pagedrag.client.bridge import run_sync
from pagedrag.client.types import (WARM_PARAMS, EngineClient, EngineInfo, Generation, Prompt, TokenLogprob,
                                   ToolRequest, WarmSummary, tier_hits)
from pagedrag.text_checks import check_utf8
from pagedrag.tools import ToolCallSplitter, ToolParser, ToolPlan, whole_choice

_Submission = tuple[ProcessedPrompt, SamplingParams, "asyncio.Future[RequestStream]"]


class SharedEngine:
    """An AsyncLLMEngine shared by every client of the same engine arguments.

    Requests submitted during one turn of an event loop enter the engine together,
    between two of its steps, so a batch (``abatch``, LangChain's ``batch``, any
    ``asyncio.gather``) is one engine batch rather than a trickle. For that, prompts are
    tokenized, rendered and checked on the callers' side (``engine_prompt``) with an
    InputProcessor of their own, before they are queued.
    """

    def __init__(self, args: EngineArgs):
        self.engine = AsyncLLMEngine.from_engine_args(args)
        self.inputs = self.engine.get_input_processor()
        self.tokenizer = self.inputs.tokenizer
        self._inputs_lock = threading.Lock()  # callers on several threads share self.inputs
        self._pending: dict[asyncio.AbstractEventLoop, list[_Submission]] = {}  # per loop: this turn's

    def engine_prompt(self, prompt: Prompt, cache_salt: str | None = None) -> ProcessedPrompt:
        """Text, or a conversation rendered as ``LLM.chat`` renders it, tokenized and checked
        (ValueError / TypeError for bad input)."""
        return self.engine_request(prompt, SamplingParams(), cache_salt, None)[0]

    def engine_request(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None,
                       tools: ToolRequest | None, chunks: tuple[str, ...] | None = None
                       ) -> tuple[ProcessedPrompt, SamplingParams, ToolPlan | None]:
        """The engine's prompt and parameters for a request: the prompt is cut around
        ``chunks`` (with chunk reuse), a chat's tools are checked and rendered, a forced tool
        choice becomes the parameters' grammar, and the grammar is compiled here, on the
        caller's thread, not on the engine's. The parameters' ``truncate_prompt_tokens`` cuts
        the prompt (to its last tokens) before its length is checked."""
        truncate = params.truncate_prompt_tokens  # applied before the length check, as vLLM
        # The client yields pieces of its own (streams) or whole completions: it reads the
        # engine's outputs cumulative, whatever output_kind the caller's parameters carry
        params = dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE)
        with self._inputs_lock:
            if isinstance(prompt, str):
                if tools is not None:
                    raise ValueError("tools need a chat (a list of messages), not a text prompt")
                return self.inputs.process(prompt, cache_salt, truncate, chunks=chunks), params, None
            plan = None if tools is None else self.inputs.plan_tools(tools.tools, tools.tool_choice,
                                                                     tools.parallel_tool_calls)
            params = params if plan is None else plan.constrain(params)
            self.inputs.compile_constraint(params)
            chat = self.inputs.render_chat(prompt, cache_salt=cache_salt, tools=plan, chunks=chunks,
                                           truncate_prompt_tokens=truncate)
            return chat, params, plan

    async def submit(self, prompt: ProcessedPrompt, params: SamplingParams) -> RequestStream:
        """Queue a request at the end of this loop turn; its stream of RequestOutputs."""
        loop = asyncio.get_running_loop()
        pending = self._pending.get(loop)
        if pending is None:
            pending = self._pending[loop] = []
            loop.call_soon(self._flush, loop)
        started = loop.create_future()
        pending.append((prompt, params, started))
        return await started

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Queue this turn's submissions (those whose caller still waits) as one engine batch."""
        submissions = [submission for submission in self._pending.pop(loop) if not submission[2].cancelled()]
        streams = self.engine.generate_batch([(prompt, params) for prompt, params, _ in submissions])
        for (_, _, started), stream in zip(submissions, streams, strict=True):
            started.set_result(stream)


_engines: dict[str, SharedEngine] = {}  # by the engine arguments as JSON
_engines_lock = threading.Lock()


def engine_args(model: str | None, engine_kwargs: dict[str, Any]) -> EngineArgs:
    """EngineArgs for a model and keyword arguments; a TypeError names every keyword that
    is not an EngineArgs field, a ValueError says which value EngineArgs refuses."""
    unknown = set(engine_kwargs) - (EngineArgs.field_names() - {"model"})
    if unknown:
        raise TypeError(f"unknown engine arguments {sorted(unknown)}: the model is an argument of its own, "
                        "the rest are pagedrag.EngineArgs fields (vLLM's names)")
    return EngineArgs(model=model, **engine_kwargs)


def shared_engine(model: str | None, engine_kwargs: dict[str, Any]) -> SharedEngine:
    """The engine for these arguments, loaded on first use and shared afterwards.

    Arguments are compared after EngineArgs fills in defaults, so ``{}`` and
    ``{"block_size": 16}`` name the same engine.
    """
    args = engine_args(model, engine_kwargs)
    key = json.dumps(dataclasses.asdict(args), sort_keys=True, default=repr)  # dict values too (speculative_config)
    with _engines_lock:
        if key not in _engines:
            _engines[key] = SharedEngine(args)
        return _engines[key]


def shutdown_shared_engines() -> int:
    """Shut down every shared engine and forget it, which frees its weights and KV pool; returns
    how many there were. Each engine's thread is stopped and joined (AsyncLLMEngine.shutdown)
    before this returns. Clients made before hold a dead engine (their requests fail with
    EngineDeadError); clients made after load a new one."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for shared in engines:
        shared.engine.shutdown()
    return len(engines)


def _forget_engines_after_fork() -> None:
    """In a forked child the shared engines' threads stayed in the parent: clients made here
    load engines of their own (those made before fail with EngineDeadError, saying why)."""
    global _engines_lock
    _engines.clear()
    _engines_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_engines_after_fork)


# At exit, the shared engines stop while the interpreter still runs threads: an engine thread
# left stepping (a request in flight) while torch tears down aborts the process ("terminate
# called without an active exception"). Registered at import, before the bridge's portal is
# started (on first use), so it runs after the portal has stopped (atexit runs last-in first-out):
# the portal's callers are cancelled first, their requests aborted, then the engines stop.
atexit.register(shutdown_shared_engines)


class InProcessClient(EngineClient):
    """A client of a shared in-process engine."""

    def __init__(self, shared: SharedEngine):
        self.shared = shared

    async def _generate(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None,
                        tools: ToolRequest | None = None, chunks: tuple[str, ...] | None = None) -> Generation:
        engine_prompt, params, plan = self.shared.engine_request(prompt, params, cache_salt, tools, chunks)
        stream = await self.shared.submit(engine_prompt, params)
        final = None
        try:
            async for output in stream:
                final = output
        finally:
            await stream.aclose()
        return _whole(final, params.logprobs, plan, self.shared.inputs.tool_parser)

    async def _stream(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None,
                      tools: ToolRequest | None = None, chunks: tuple[str, ...] | None = None
                      ) -> AsyncIterator[Generation]:
        engine_prompt, params, plan = self.shared.engine_request(prompt, params, cache_salt, tools, chunks)
        stream = await self.shared.submit(engine_prompt, params)
        cursor = ChoiceCursor(0)
        splitter = ToolCallSplitter(plan, self.shared.inputs.tool_parser)
        try:
            async for output in stream:
                delta = cursor.advance(output.outputs[0], wants_logprobs=params.logprobs is not None)
                if delta is not None:
                    yield _piece(delta, output, params.logprobs, splitter)
        finally:
            await stream.aclose()

    async def _warm(self, prompts: list[Prompt], cache_salt: str | None,
                    chunks: tuple[str, ...] | None) -> WarmSummary:
        """The prompts as one engine batch, then the tiers' writes waited for on the engine thread."""
        generations = await self._generate_all(prompts, WARM_PARAMS, cache_salt, chunks)
        await self.shared.engine.flush_tiers()
        return WarmSummary.of(generations)

    async def astats(self) -> dict[str, Any]:
        return await self.shared.engine.stats()

    async def ainfo(self) -> EngineInfo:
        info = self.shared.engine.model_info
        return EngineInfo(info.name, info.max_model_len)

    @property
    def known_model_name(self) -> str:
        return self.shared.engine.model_info.name

    async def atokenize(self, text: str) -> list[int]:
        return await self.shared.engine.preprocess(lambda inputs: _encoded(inputs.tokenizer, text))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (for measurements that start cold)."""
        run_sync(self.shared.engine.reset_prefix_cache())


def _piece(delta: ChoiceDelta, output: RequestOutput, top: int | None, splitter: ToolCallSplitter) -> Generation:
    """A stream's piece: new content (and the new tokens' logprobs, when asked for); the last
    piece also carries the finish reason, the tool calls and the request's token counts."""
    logprobs = None if top is None else _logprobs(delta.token_ids, delta.logprobs, top)
    finished = delta.finish_reason is not None
    text, calls = splitter.feed(delta.text, finished)
    if not finished:
        return Generation(text, logprobs=logprobs)
    return Generation(text, "tool_calls" if calls else delta.finish_reason, logprobs=logprobs,
                      tool_calls=tuple(calls), completion_tokens=len(output.outputs[0].token_ids),
                      **_prompt_counts(output))


def _whole(output: RequestOutput, top: int | None, plan: ToolPlan | None, parser: ToolParser) -> Generation:
    """A finished request: its first completion with the request's counts, the others in ``more``."""
    completions = sorted(output.outputs, key=lambda completion: completion.index)
    first, *more = (_choice(completion, top, plan, parser) for completion in completions)
    return dataclasses.replace(first, completion_tokens=sum(len(c.token_ids) for c in completions),
                               more=tuple(more), **_prompt_counts(output))


def _prompt_counts(output: RequestOutput) -> dict[str, Any]:
    """The Generation fields that count a request's prompt tokens and their cache hits (by
    tier too)."""
    return {"prompt_tokens": len(output.prompt_token_ids), "cached_tokens": output.num_cached_tokens,
            "chunk_cache_hits": output.num_chunk_hit_tokens,
            "chunk_tokens_recomputed": output.num_recomputed_tokens,
            "tier_cache_hits": tier_hits(output.num_tier_hit_tokens)}


def _choice(completion: CompletionOutput, top: int | None, plan: ToolPlan | None, parser: ToolParser) -> Generation:
    """One finished completion's content, tool calls, finish reason and logprobs (no counts)."""
    logprobs = None if top is None else _logprobs(completion.token_ids, completion.logprobs, top)
    content, calls, finish_reason = whole_choice(plan, parser, completion.text, completion.finish_reason)
    return Generation(content or "", finish_reason, logprobs=logprobs, tool_calls=tuple(calls))


def _logprobs(token_ids: list[int], entries: list[dict[int, Logprob]] | None,
              top: int) -> tuple[TokenLogprob, ...]:
    """The engine's per-token entries (the sampled token and the top ones, decoded on the
    engine thread) as TokenLogprobs with the ``top`` best alternatives."""
    return tuple(TokenLogprob(_token_text(entry[token_id]), entry[token_id].logprob,
                              tuple((_token_text(lp), lp.logprob)
                                    for lp in sorted(entry.values(), key=lambda lp: -lp.logprob)[:top]))
                 for token_id, entry in zip(token_ids, entries or ()))


def _token_text(entry: Logprob) -> str:
    return entry.decoded_token or ""


def _encoded(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer")
    check_utf8("text", text)
    return tokenizer.encode(text, add_special_tokens=False)
