"""PagedRAGLLM: pagedrag as a LangChain text-completion LLM."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation as LCGeneration
from langchain_core.outputs import GenerationChunk, LLMResult
from langchain_core.prompt_values import PromptValue
from pydantic import Field

from pagedrag.client import Generation, gather_or_cancel, run_sync, tier_hits
from pagedrag.rag.chunk_reuse_support import chunk_reuse_figures
from pagedrag.sampling_params import SamplingParams

from ._engine import LangChainSettings, generation_info, openai_logprobs

# The figures llm_output["token_usage"] sums over the prompts (and tier_cache_hits, tier by tier)
_SUMMED = ("prompt_tokens", "completion_tokens", "cached_tokens", "prefix_cache_hits", "chunk_cache_hits",
           "chunk_tokens_recomputed", "prompt_tokens_computed")


class PagedRAGLLM(LangChainSettings, BaseLLM):
    """A pagedrag engine as a LangChain completion model: prompts are sent as they are
    (no chat template; use ChatPagedRAG for chats).

    Same settings as ChatPagedRAG (ChatOpenAI's names; pagedrag.rag.aliases). Each
    generation's ``generation_info`` holds the finish reason and the request's figures
    (prompt_tokens, completion_tokens, cached_tokens, cache_hit_rate, tier_cache_hits
    ({"host": m, "disk": n}: of the cache hits, those loaded from each KV tier),
    prefix_cache_hits, chunk_cache_hits, chunk_tokens_recomputed, prompt_tokens_computed;
    ``logprobs`` when asked for); ``llm_output["token_usage"]`` sums the counts over the
    prompts (tier_cache_hits tier by tier). With n > 1 each prompt has n generations.
    ``batch`` and ``generate`` submit every prompt before collecting any (one engine
    batch); with ``streaming=True`` each prompt is streamed instead (callbacks see every
    token). With chunk reuse, each prompt's call passes its
    ``chunks`` (``call_chunks``: a call's ``chunks=`` keyword, else the documents
    CanonicalDocuments(llm=this) told of that the prompt holds).

    ``logprobs`` follows the completion LLMs it replaces (langchain_community's VLLM,
    langchain_openai's OpenAI): an int, the number of alternatives per token (0: the sampled
    token's only), in the constructor or per call; ChatOpenAI's ``logprobs=True`` with
    ``top_logprobs`` is accepted too. ``batch`` / ``abatch`` with ``return_exceptions=True``
    fail only the inputs that fail (ChatPagedRAG's batch).
    """

    logprobs: bool | int | None = Field(default=None, description="Alternatives per generated token "
                                                                    "(VLLM's / OpenAI's int; True: ChatOpenAI's).")

    @property
    def _llm_type(self) -> str:
        return "pagedrag"

    def sampling_logprobs(self, logprobs: bool | int | None, top_logprobs: int | None) -> int | None:
        """The completion LLMs' rule: an int ``logprobs`` is SamplingParams.logprobs itself
        (then ``top_logprobs``, ChatOpenAI's other half, must be left out); a bool or None
        is ChatOpenAI's switch (``LangChainSettings.sampling_logprobs``)."""
        if logprobs is None or isinstance(logprobs, bool):
            return super().sampling_logprobs(logprobs, top_logprobs)
        if top_logprobs is not None:
            raise ValueError(f"logprobs={logprobs} already counts the alternatives per token; top_logprobs "
                             "goes with logprobs=True (ChatOpenAI's form)")
        return logprobs

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._with_model_name(super()._get_ls_params(stop=stop, **kwargs), kwargs)

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        params, chunks = self.call_sampling(kwargs, stop), self._prompt_chunks(prompts, kwargs)
        if self.streaming:
            return self._result([self._streamed(prompt, params, each, run_manager)
                                 for prompt, each in zip(prompts, chunks)])
        return self._result(run_sync(self._abatch(prompts, params, chunks)))

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        params, chunks = self.call_sampling(kwargs, stop), self._prompt_chunks(prompts, kwargs)
        if self.streaming:
            return self._result([await self._astreamed(prompt, params, each, run_manager)
                                 for prompt, each in zip(prompts, chunks)])
        return self._result(await self._abatch(prompts, params, chunks))

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        params, usage = self.call_sampling(kwargs, stop), self.wants_stream_usage(kwargs)
        chunks = self.call_chunks(prompt, kwargs.get("chunks"))
        for piece in self.client.stream(prompt, params, self.cache_salt, chunks=chunks):
            chunk = self._chunk(piece, usage)
            if run_manager:
                run_manager.on_llm_new_token(piece.text, chunk=chunk)
            yield chunk

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        params, usage = self.call_sampling(kwargs, stop), self.wants_stream_usage(kwargs)
        chunks = self.call_chunks(prompt, kwargs.get("chunks"))
        async for piece in self.client.astream(prompt, params, self.cache_salt, chunks=chunks):
            chunk = self._chunk(piece, usage)
            if run_manager:
                await run_manager.on_llm_new_token(piece.text, chunk=chunk)
            yield chunk

    def engine_prompt(self, prompt: PromptValue) -> str:
        """A rendered prompt as this model sends it: its text."""
        return prompt.to_string()

    def _prompt_chunks(self, prompts: list[str], kwargs: dict[str, Any]) -> list[Sequence[str] | None]:
        """The ``chunks`` of each prompt's call (``call_chunks``)."""
        return [self.call_chunks(prompt, kwargs.get("chunks")) for prompt in prompts]

    async def _abatch(self, prompts: list[str], params: SamplingParams,
                      chunks: list[Sequence[str] | None]) -> list[Generation]:
        """Every prompt submitted before any is collected (one engine batch), results in
        order. The client's abatch takes no chunks, so prompts with chunks go one
        ``agenerate`` each, gathered; if one fails (or the caller gives up) the others are
        aborted."""
        if all(each is None for each in chunks):
            return await self.client.abatch(prompts, params, self.cache_salt)
        return await gather_or_cancel(self.client.agenerate(prompt, params, self.cache_salt, chunks=each)
                                      for prompt, each in zip(prompts, chunks))

    def _streamed(self, prompt: str, params: SamplingParams, chunks: Sequence[str] | None,
                  run_manager: CallbackManagerForLLMRun | None) -> Generation:
        """One prompt's generation through the stream, each piece reported as a new token."""
        pieces = []
        for piece in self.client.stream(prompt, params, self.cache_salt, chunks=chunks):
            if run_manager:
                run_manager.on_llm_new_token(piece.text, chunk=self._chunk(piece, True))
            pieces.append(piece)
        return Generation.joined(pieces)

    async def _astreamed(self, prompt: str, params: SamplingParams, chunks: Sequence[str] | None,
                         run_manager: AsyncCallbackManagerForLLMRun | None) -> Generation:
        pieces = []
        async for piece in self.client.astream(prompt, params, self.cache_salt, chunks=chunks):
            if run_manager:
                await run_manager.on_llm_new_token(piece.text, chunk=self._chunk(piece, True))
            pieces.append(piece)
        return Generation.joined(pieces)

    def _result(self, wholes: list[Generation]) -> LLMResult:
        generations = [[LCGeneration(text=choice.text, generation_info=generation_info(choice, whole, self.model_label))
                        for choice in whole.choices] for whole in wholes]
        counts = [{**whole.cache_figures(), **chunk_reuse_figures(whole)} for whole in wholes]
        usage = {**{key: sum(each[key] for each in counts) for key in _SUMMED},
                 "tier_cache_hits": tier_hits(*(whole.tier_cache_hits for whole in wholes))}
        return LLMResult(generations=generations, llm_output={"token_usage": usage, "model_name": self.model_label})

    def _chunk(self, piece: Generation, with_usage: bool) -> GenerationChunk:
        """A stream chunk (its logprobs, when asked for); the last one carries the finish
        reason, and the token and cache figures unless ``with_usage`` is false."""
        info = {} if piece.logprobs is None else {"logprobs": openai_logprobs(piece)}
        if piece.finish_reason is not None:
            figures = generation_info(piece, piece, self.model_label)
            info = figures if with_usage else {**info, "finish_reason": piece.finish_reason,
                                               "model_name": self.model_label}
        return GenerationChunk(text=piece.text, generation_info=info or None)
