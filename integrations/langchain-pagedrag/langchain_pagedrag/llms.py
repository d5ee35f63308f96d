"""PagedRAGLLM: pagedrag as a LangChain text-completion LLM."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation as LCGeneration
from langchain_core.outputs import GenerationChunk, LLMResult
from langchain_core.prompt_values import PromptValue

from pagedrag.client import Generation

from ._engine import LangChainSettings, generation_info


class PagedRAGLLM(LangChainSettings, BaseLLM):
    """A pagedrag engine as a LangChain completion model: prompts are sent as they are
    (no chat template; use ChatPagedRAG for chats).

    Same settings as ChatPagedRAG. Each generation's ``generation_info`` holds the
    finish reason and the cache figures (prompt_tokens, completion_tokens, cached_tokens,
    cache_hit_rate); ``llm_output["token_usage"]`` sums them over the prompts. ``batch``
    and ``generate`` submit every prompt before collecting any (one engine batch).
    """

    @property
    def _llm_type(self) -> str:
        return "pagedrag"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._with_model_name(super()._get_ls_params(stop=stop, **kwargs), kwargs)

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        return self._result(self.client.batch(prompts, self.sampling(kwargs, stop), self.cache_salt))

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        return self._result(await self.client.abatch(prompts, self.sampling(kwargs, stop), self.cache_salt))

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        for piece in self.client.stream_complete(prompt, self.sampling(kwargs, stop), self.cache_salt):
            chunk = self._chunk(piece)
            if run_manager:
                run_manager.on_llm_new_token(piece.text, chunk=chunk)
            yield chunk

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        async for piece in self.client.astream_complete(prompt, self.sampling(kwargs, stop), self.cache_salt):
            chunk = self._chunk(piece)
            if run_manager:
                await run_manager.on_llm_new_token(piece.text, chunk=chunk)
            yield chunk

    def engine_prompt(self, prompt: PromptValue) -> str:
        """A rendered prompt as this model sends it: its text."""
        return prompt.to_string()

    def _result(self, generations: list[Generation]) -> LLMResult:
        infos = [generation_info(g, self.model_label) for g in generations]
        usage = {key: sum(info[key] for info in infos) for key in ("prompt_tokens", "completion_tokens",
                                                                   "cached_tokens")}
        return LLMResult(generations=[[LCGeneration(text=g.text, generation_info=info)]
                                      for g, info in zip(generations, infos)],
                         llm_output={"token_usage": usage, "model_name": self.model_label})

    def _chunk(self, piece: Generation) -> GenerationChunk:
        """A stream chunk; the last one carries the finish reason and the cache figures."""
        info = generation_info(piece, self.model_label) if piece.finish_reason is not None else None
        return GenerationChunk(text=piece.text, generation_info=info)
