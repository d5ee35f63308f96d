"""What the OpenAI endpoints share: model names, admission, cache salts, and a Run
(the engine requests behind one HTTP request, as per-choice deltas)."""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from ..async_engine import AsyncLLMEngine
from ..detokenizer import StopChecker
from ..engine import PromptType
from ..llm import render_chat
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .auth import bearer_token, tenant_cache_salt
from .choices import ChoiceCursor, ChoiceDelta
from .errors import APIError, as_api_error, engine_dead
from .logprobs import LogprobFormatter
from .protocol import ChatCompletionRequest, PromptTokensDetails, SamplingRequest, Usage
from .streams import merge_streams, unless_disconnected


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    max_queue: int | None = None  # most requests in flight (waiting + running); None: no limit
    salt_by_api_key: bool = False


@dataclass(frozen=True)
class Envelope:
    """The id, creation time and model every object of one response carries."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> "Envelope":
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

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
        """Token counts so far (prompt tokens once per prompt, whatever n is)."""
        prompt = sum(len(o.prompt_token_ids) for o in self._last.values())
        generated = sum(len(c.token_ids) for o in self._last.values() for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in self._last.values())
        return Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

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
            stops = StopChecker(self._params.stop, self._params.include_stop_str_in_output)
            self._cursors[index] = ChoiceCursor(index, stops)
        return self._cursors[index]


class Serving:
    """The engine, the server's own tokenizer (the engine thread keeps its own), and the
    policies every endpoint applies before generating."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.max_model_len = engine.engine.max_model_len
        self.tokenizer = copy.deepcopy(engine.engine.tokenizer)
        self.logprobs = LogprobFormatter(self.tokenizer)

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

    def chat_prompt(self, request: ChatCompletionRequest) -> dict:
        """The prompt dict of a conversation, rendered by pagedrag.llm.render_chat."""
        try:
            return render_chat(self.tokenizer, request.conversation(), request.add_generation_prompt,
                               **(request.chat_template_kwargs or {}))
        except Exception as error:  # jinja raises its own TemplateError types
            raise APIError(400, f"cannot apply the chat template: {error}", param="messages") from error

    async def start(self, http_request: Request, request: SamplingRequest, prompts: list[PromptType],
                    prefix: str) -> tuple[Envelope, Run]:
        """Check the request, queue its prompts and wait for the first output.

        Raises APIError: 404 unknown model, 400 bad parameters or prompt, 503 over
        --max-queue; ClientDisconnected if the client leaves first.
        """
        envelope = Envelope.new(prefix, self.resolve_model(request.model))
        try:
            params = request.sampling_params()
        except ValueError as error:
            raise APIError(400, str(error)) from error
        self._admit(len(prompts))
        salt = self._cache_salt(http_request, request.cache_salt)
        streams = [self.engine.generate(prompt, params, f"{envelope.id}-{index}", salt)
                   for index, prompt in enumerate(prompts)]
        run = Run(merge_streams(streams), params)
        await run.prime(http_request)
        return envelope, run

    def _admit(self, count: int) -> None:
        limit = self.config.max_queue
        if self.engine.dead_reason is not None:
            raise engine_dead(self.engine.dead_reason)
        if limit is not None and self.engine.num_in_flight + count > limit:
            raise APIError(503, f"the server is at its limit of {limit} requests in flight "
                                "(--max-queue); retry later", code="queue_full")

    def _cache_salt(self, http_request: Request, request_salt: str | None) -> str | None:
        if not self.config.salt_by_api_key:
            return request_salt
        return tenant_cache_salt(bearer_token(http_request.headers), request_salt)
