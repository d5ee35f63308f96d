"""LLM: the offline API, shaped as vLLM's (generate, chat, beam_search) plus stats()."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from tqdm.auto import tqdm

from pagedrag.entrypoints.beam_search import BeamSearchOutput, run_beam_search
from pagedrag.config import EngineArgs
from pagedrag.engine.llm_engine import LLMEngine
from pagedrag.engine.inputs import Conversation, PromptType
from pagedrag.outputs import RequestOutput
from pagedrag.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("pagedrag")


class LLM:
    """An in-process engine.

    ``LLM()`` runs the embedded SmolLM2-135M-Instruct offline; every EngineArgs
    field is a keyword argument (gpu_memory_utilization is the fraction of device
    memory left after the weights that the KV pool may take).

    Calls from several threads (a sync web app, a thread pool) run one after another, each
    to completion: the engine steps in one thread at a time. Requests of several threads
    batch together through ``AsyncLLMEngine`` or the LlamaIndex / LangChain integrations.
    """

    def __init__(self, model: str | None = None, **engine_kwargs):
        unknown = set(engine_kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments {sorted(unknown)}; see pagedrag.EngineArgs")
        engine_kwargs.setdefault("disable_log_stats", True)  # as vLLM's LLM: no periodic stats line
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_kwargs))
        self._engine_lock = threading.RLock()  # held while a call adds requests and steps the engine

    @contextmanager
    def _engine_held(self) -> Iterator[None]:
        """The engine, for this call alone. In a forked child it fails at once, before the lock
        (a thread of the parent may have held it at the fork, and no thread here releases it)."""
        self.llm_engine.check_not_forked()
        with self._engine_lock:
            yield

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def stats(self) -> dict:
        with self._engine_held():
            return self.llm_engine.stats()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts), self.llm_engine.default_params)
        with self._engine_held():
            return self._run(self._add_all(prompts, params), use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat
        template or ``chat_template``; ``continue_final_message`` extends the last message
        instead of opening a new one (then add_generation_prompt must be False). ``tools``
        (OpenAI's format) are rendered into the prompt, as vLLM's LLM.chat does; the replies
        are text (the server and the clients read tool calls out of it)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = _per_prompt(sampling_params, len(conversations), self.llm_engine.default_params)
        with self._engine_held():  # the engine's input processor is one thread's at a time
            inputs = self.llm_engine.inputs
            kwargs = {**(chat_template_kwargs or {}), "continue_final_message": continue_final_message,
                      "tools": inputs.plan_tools(tools, "none")}  # rendered, never parsed
            if chat_template is not None:
                kwargs["chat_template"] = chat_template
            prompts = [inputs.render_chat(c, add_generation_prompt, truncate_prompt_tokens=p.truncate_prompt_tokens,
                                          **kwargs)  # keeps the segments of chunk reuse
                       for c, p in zip(conversations, params)]
            return self.generate(prompts, params, use_tqdm)

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True,
                            **kwargs) -> dict:
        """A prompt dict (text and token ids) for one conversation."""
        with self._engine_held():
            prompt = self.llm_engine.inputs.render_chat(conversation, add_generation_prompt, **kwargs)
        return {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams used when none are given: the model's generation_config
        (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens), as vLLM's."""
        return self.llm_engine.default_params

    def warm(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True) -> dict[str, int]:
        """Compute and store the KV of ``prompts`` (texts, token-id dicts, ``prompt_segments`` for
        chunk reuse; each may carry its ``cache_salt``) so that later requests sharing them hit
        the cache, and with KV tiers (kv_offloading_size, kv_disk_path) find them after the pool
        let them go, after a restart, or in another engine on the same disk tier. Returns once
        the tiers hold every block: the prompts, their prompt tokens and those already cached.

        The answer is one token per prompt, sampled greedily and thrown away: the prompt's last
        token is computed anyway, as for every request, so the cost is one sampling step."""
        with self._engine_held():
            outputs = self.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm)
            self.llm_engine.flush_tiers()
        return {"prompts": len(outputs), "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
                "cached_tokens": sum(o.num_cached_tokens + o.num_chunk_hit_tokens for o in outputs)}

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (for measurements that start cold). True, as vLLM's answers
        on success: here it always succeeds (blocks still in use keep their data, not their hash)."""
        with self._engine_held():
            self.llm_engine.reset_prefix_cache()
        return True

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        return run_beam_search(self.llm_engine, lambda batch, step_params: self.generate(
            batch, step_params, use_tqdm=False), _as_prompt_list(prompts), params)

    # ---- internals -----------------------------------------------------------
    def _add_all(self, prompts: list[PromptType], params: list[SamplingParams]) -> list[str]:
        """Queue every prompt, or none: a bad one withdraws those queued before it."""
        engine = self.llm_engine
        added = []
        try:
            for prompt, p in zip(prompts, params):
                added.append(engine.add_request(None, prompt, p))
        except Exception:
            for request_id in added:
                engine.abort_request(request_id)
            raise
        return added

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(done) < len(request_ids):
                for output in engine.step():
                    if output.finished:
                        _warn_if_failed(output)
                        done[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [done[request_id] for request_id in request_ids]


def _warn_if_failed(output: RequestOutput) -> None:
    """A request that failed alone comes back finished with an error; the others go on."""
    if output.error:
        logger.error("request %s: %s", output.request_id, output.error)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a prompt or a sequence of prompts, got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        raise ValueError("pass token ids as {'prompt_token_ids': [...]} (a bare list of ints is ambiguous)")
    return prompts


def _per_prompt(params, count: int, default: SamplingParams) -> list[SamplingParams]:
    if params is None:
        return [default] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
