"""What the OpenAI endpoints share: model names, admission, cache salts, and a Run
(the engine requests behind one HTTP request, as per-choice deltas)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from pagedrag.entrypoints.async_engine import AsyncLLMEngine
from pagedrag.deltas import ChoiceCursor, ChoiceDelta
from pagedrag.engine.inputs import InputProcessor, ProcessedPrompt, check_cache_salt
from pagedrag.kv_tiers.store import tier_hits
from pagedrag.outputs import RequestOutput
from pagedrag.sampling_params import SamplingParams
from pagedrag.server.auth import bearer_token, tenant_cache_salt
from pagedrag.server.errors import APIError, as_api_error, engine_dead
from pagedrag.server.logprobs import LogprobFormatter
from pagedrag.server.chat_template import RequestTemplateRenderer
from pagedrag.server.protocol import (ChatCompletionRequest, CompletionRequest, PromptTokensDetails, SamplingRequest,
                                      Usage, named)
from pagedrag.server.streams import merge_streams, unless_disconnected
from pagedrag.tools import ToolPlan


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    max_queue: int | None = None  # most sequences in flight (waiting + running, n counted); None: no limit
    salt_by_api_key: bool = False
    max_request_bytes: int = 4 * 1024 * 1024  # larger bodies get 413 before they are parsed
    trust_request_chat_template: bool = False  # accept a chat template sent with a request
    chat_template: str | None = None  # the operator's template (--chat-template), else the model's

    def __post_init__(self) -> None:
        if any(not isinstance(key, str) or not key.strip() for key in self.api_keys):
            raise ValueError("an API key is empty (an unset variable in --api-key \"$KEY\"?): requests "
                             "without a key would match it; give a key or leave --api-key out")


@dataclass(frozen=True)
class Envelope:
    """The id, creation time and model every object of one response carries."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str, request_id: str | None = None) -> "Envelope":
        """A response's envelope: its id is the prefix and the client's request_id (vLLM's), or a
        random one."""
        return cls(f"{prefix}-{request_id or uuid.uuid4().hex}", int(time.time()), model)

    @property
    def fields(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}


class Run:
    """The engine requests of one HTTP request, one per prompt; choice ``p * n + j`` is
    completion j of prompt p. Engine errors come out of it as APIErrors."""

    def __init__(self, outputs: AsyncIterator[tuple[int, RequestOutput]], params: SamplingParams):
        self._outputs = outputs
        self._params = params
        self._first: tuple[int, RequestOutput] | None = None  # set by prime()
        self._last: dict[int, RequestOutput] = {}
        self._cursors: dict[int, ChoiceCursor] = {}

    async def prime(self, http_request: Request) -> None:
        """Wait for the first output: bad input shows up here, before any response is sent."""
        self._first = await unless_disconnected(http_request, self._next())

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Per-choice deltas as the engine produces tokens (for streaming)."""
        async for prompt_index, output in self._each():
            for completion in output.outputs:
                delta = self._cursor(prompt_index, completion.index).advance(completion, self.wants_logprobs)
                if delta is not None:
                    yield delta

    async def final(self) -> list[ChoiceDelta]:
        """One delta per choice holding all of it, in choice order (for whole responses)."""
        async for _ in self._each():
            pass
        return [self._cursor(p, c.index).advance(c, self.wants_logprobs)
                for p in sorted(self._last) for c in sorted(self._last[p].outputs, key=lambda c: c.index)]

    def usage(self) -> Usage:
        """Token counts so far (prompt tokens and their cache figures once per prompt,
        whatever n is)."""
        outputs = self._last.values()
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        hits = tier_hits(*(o.num_tier_hit_tokens for o in outputs))
        details = PromptTokensDetails.of(prompt, sum(o.num_cached_tokens for o in outputs),
                                         sum(o.num_chunk_hit_tokens for o in outputs),
                                         sum(o.num_recomputed_tokens for o in outputs), hits)
        return Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated,
                     prompt_tokens_details=details)

    def prompt_logprobs(self) -> list[dict[str, dict] | None] | None:
        """The first prompt's prompt logprobs in vLLM's JSON shape, when they were asked for."""
        if self._params.prompt_logprobs is None or not self._last:
            return None
        entries = self._last[min(self._last)].prompt_logprobs or []
        return [None if entry is None else {str(token): dataclasses.asdict(lp) for token, lp in entry.items()}
                for entry in entries]

    @property
    def wants_logprobs(self) -> bool:
        return self._params.logprobs is not None

    async def close(self) -> None:
        """Abort whatever has not finished."""
        await self._outputs.aclose()

    async def _next(self) -> tuple[int, RequestOutput] | None:
        try:
            return await anext(self._outputs, None)
        except Exception as error:
            raise as_api_error(error) from error

    async def _each(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The primed first output, then the rest; remembers each prompt's latest."""
        item = self._first
        while item is not None:
            self._last[item[0]] = item[1]
            yield item
            item = await self._next()

    def _cursor(self, prompt_index: int, completion_index: int) -> ChoiceCursor:
        index = prompt_index * self._params.n + completion_index
        if index not in self._cursors:
            self._cursors[index] = ChoiceCursor(index)
        return self._cursors[index]


class Serving:
    """The engine, the server's own tokenizer (the engine thread keeps its own), and the
    policies every endpoint applies before generating."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.max_model_len = engine.model_info.max_model_len
        inputs = engine.get_input_processor()
        self.tokenizer = inputs.tokenizer
        self.tool_parser = inputs.tool_parser
        self._plan_tools = inputs.plan_tools
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.templates = RequestTemplateRenderer()
        self.special_tokens = _special_tokens(self.tokenizer)

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def resolve_model(self, requested: str | None) -> str:
        """The model a request names (None: the first served name); 404 if not served."""
        if requested is None:
            return self.model_name
        if requested not in self.config.served_model_names:
            raise APIError(404, f"The model `{requested}` does not exist; this server serves "
                                f"{self.config.served_model_names}", param="model", code="model_not_found")
        return requested

    def plan_tools(self, request: ChatCompletionRequest, params: SamplingParams
                   ) -> tuple[ToolPlan | None, SamplingParams]:
        """The request's tools checked (400 for bad ones), and the parameters with the grammar
        of a forced tool choice."""
        try:
            plan = self._plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls)
            if plan is None:
                return None, params
            return plan, plan.constrain(params)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), param=getattr(error, "param", "tools")) from error

    async def chat_prompt(self, request: ChatCompletionRequest, salt: str | None,
                          tools: ToolPlan | None = None) -> ProcessedPrompt:
        """A conversation (with its ``tools``) through the model's chat template, cut around
        the request's prompt_chunks (with chunk reuse), or through the request's own template
        (only with --trust-request-chat-template, in the sandboxed renderer; never cut, so
        prompt_chunks are then refused), off the event loop; cut to its last
        truncate_prompt_tokens tokens before its length is checked."""
        conversation = request.conversation()
        try:
            template = request.request_chat_template()
            if template is None:
                kwargs = request.template_kwargs()
                if self.config.chat_template is not None:
                    kwargs["chat_template"] = self.config.chat_template
                return await self.engine.preprocess(lambda inputs: inputs.render_chat(
                    conversation, request.add_generation_prompt, salt, tools, chunks=request.prompt_chunks,
                    truncate_prompt_tokens=request.truncate_prompt_tokens, **kwargs))
            if tools is not None:
                raise APIError(400, "tools cannot be combined with a chat template sent with the request",
                               param="tools")
            if request.prompt_chunks is not None:
                raise APIError(400, "prompt_chunks cannot be combined with a chat template sent with the request "
                                    "(its rendering is never cut into segments)", param="prompt_chunks")
            if request.continue_final_message:
                raise APIError(400, "continue_final_message needs the model's chat template, not one sent with the "
                                    "request", param="continue_final_message")
            text = await self._render_request_template(template, request)
            return await self.engine.preprocess(
                lambda inputs: inputs.process_chat_text(text, salt, truncate_prompt_tokens=request.truncate_prompt_tokens))
        except APIError:
            raise
        except Exception as error:  # jinja raises its own TemplateError types
            raise APIError(400, f"cannot apply the chat template: {error}", param="messages") from error

    async def _render_request_template(self, template: str, request: ChatCompletionRequest) -> str:
        if not self.config.trust_request_chat_template:
            raise APIError(400, "this server does not accept chat templates sent with a request "
                                "(the operator can allow them with --trust-request-chat-template)",
                           param="chat_template")
        return await self.templates.render(template, request.conversation(), request.add_generation_prompt,
                                           self.special_tokens, request.template_kwargs())

    async def completion_prompts(self, request: CompletionRequest, salt: str | None) -> list[ProcessedPrompt]:
        """Each prompt of a (possibly batched) completion request (each text one cut around
        the request's prompt_chunks, with chunk reuse), tokenized off the event loop and cut to
        its last truncate_prompt_tokens tokens before its length is checked."""
        chunks, truncate = request.prompt_chunks, request.truncate_prompt_tokens
        try:
            prompts = request.engine_prompts()
            return [await self.engine.preprocess(
                        lambda inputs, p=p: inputs.process(_without_special_tokens(inputs, p, request), salt,
                                                           truncate, chunks=chunks)) for p in prompts]
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), param=request.prompt_field) from error

    def cache_salt(self, http_request: Request, request: SamplingRequest) -> str | None:
        """The request's cache_salt (400 naming it if bad), joined with its API key's under
        --salt-by-api-key."""
        try:
            check_cache_salt(request.cache_salt)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), param="cache_salt") from error
        if not self.config.salt_by_api_key:
            return request.cache_salt
        return tenant_cache_salt(bearer_token(http_request.headers), request.cache_salt)

    def check(self, request: SamplingRequest, copies: int = 1) -> tuple[Envelope, SamplingParams]:
        """Check what needs no tokenizing: the model, the sampling parameters and room in the
        queue for ``copies`` requests like this one that arrive together (a warm-up's
        conversations). Raises APIError: 404 unknown model, 400 bad parameters, 503 over
        --max-queue."""
        model = self.resolve_model(request.model)
        try:
            params = request.sampling_params()
            self.engine.check_params(params)
        except (ValueError, TypeError) as error:
            raise _parameter_error(request, error) from error
        try:
            num_prompts = request.num_prompts()
        except ValueError as error:
            raise APIError(400, str(error), param=request.prompt_field) from error
        self._admit(copies * num_prompts * params.n)
        return Envelope.new(request.PREFIX, model, request.request_id), params

    async def start(self, http_request: Request, params: SamplingParams, prompts: list[ProcessedPrompt],
                    envelope: Envelope, request: SamplingRequest) -> Run:
        """Queue the checked prompts (together: one engine batch) and wait for the first output
        (400 if a prompt leaves no room for max_tokens, or the constraint cannot compile, named as
        ``request``'s fields; ClientDisconnected if the client leaves first)."""
        for prompt in prompts:
            self._check_room(len(prompt.token_ids), params.max_tokens, request.max_tokens_field)
        if params.structured_outputs is not None:
            await unless_disconnected(http_request, self._compile_constraint(params, request.constraint_field))
        streams = self.engine.generate_batch([(prompt, params) for prompt in prompts],
                                             [f"{envelope.id}-{index}" for index in range(len(prompts))])
        run = Run(merge_streams(streams), params)
        await run.prime(http_request)
        return run

    async def _compile_constraint(self, params: SamplingParams, field: str) -> None:
        """Compile the output constraint on an input thread (400 naming ``field`` if it cannot
        be): never on the event loop, nor on the engine thread, which then finds it cached."""
        try:
            await self.engine.preprocess(lambda inputs: inputs.compile_constraint(params))
        except (ValueError, TypeError) as error:
            raise APIError(400, named(field, error), param=field) from error

    def _check_room(self, num_prompt_tokens: int, max_tokens: int | None, field: str) -> None:
        """As vLLM's server: the prompt plus max_tokens (the request's ``field``) must fit max_model_len."""
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                                f"({num_prompt_tokens} in the prompt, {max_tokens} for the completion). "
                                f"Please reduce the length of the prompt or {field}.", param=field)

    def _admit(self, num_sequences: int) -> None:
        """Each of a request's n completions of each prompt counts as one sequence."""
        limit = self.config.max_queue
        if self.engine.dead_reason is not None:
            raise engine_dead(self.engine.dead_reason)
        if limit is not None and num_sequences > limit:  # a retry could never succeed
            raise APIError(400, f"the request asks for {num_sequences} sequences (n completions of each prompt or "
                                f"conversation), more than the server's limit of {limit} in flight (--max-queue)")
        if limit is not None and self.engine.num_in_flight + num_sequences > limit:
            raise APIError(503, f"the server is at its limit of {limit} sequences in flight "
                                "(--max-queue); retry later", code="queue_full")


def _parameter_error(request: SamplingRequest, error: ValueError | TypeError) -> APIError:
    """The 400 for a bad sampling parameter, naming the field the client sent (a chat's
    max_completion_tokens, not the engine's max_tokens) in its param and its message."""
    param = getattr(error, "param", None)
    field = request.field_named(param)
    return APIError(400, str(error) if field == param else f"{field}: {error}", param=field)


def _special_tokens(tokenizer) -> dict[str, str]:
    """The special tokens a chat template may use (bos_token, eos_token, ...)."""
    if tokenizer is None:
        return {}
    return {name: value for name, value in tokenizer.special_tokens_map.items() if isinstance(value, str)}


def _without_special_tokens(inputs: InputProcessor, prompt, request: CompletionRequest):
    """A text prompt tokenized without the tokenizer's special tokens where the request says so
    (vLLM's add_special_tokens=false); any other prompt as it is. Prompt_chunks then have no text
    left to cut (a 400, as for a prompt of token ids)."""
    if request.add_special_tokens or not isinstance(prompt, str) or inputs.tokenizer is None:
        return prompt
    inputs.check_prompt_chars(len(prompt))
    return {"prompt": prompt, "prompt_token_ids": inputs.tokenizer.encode(prompt, add_special_tokens=False)}
