"""/tokenize and /detokenize as vLLM serves them, plus /version and /ping.

Tokenizing runs on the engine's input threads (AsyncLLMEngine.preprocess), never on the
event loop, with the same prompt checks as generation (the prompt may not exceed
max_model_len tokens there, and here: count answers how long a prompt is, so the
only limit is the request body size).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.requests import Request

from pagedrag import __version__
from pagedrag.server.errors import APIError
from pagedrag.server.openapi import error_responses
from pagedrag.server.protocol import ChatMessage, StrictRequest
from pagedrag.server.serving import Serving

router = APIRouter()


class TokenizeRequest(StrictRequest):
    """A text prompt, or chat messages rendered through the chat template first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[int]


@router.post("/tokenize", responses=error_responses(400, 404))
async def tokenize(body: TokenizeRequest, http_request: Request) -> JSONResponse:
    serving: Serving = http_request.app.state.serving
    serving.resolve_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    try:
        token_ids = await serving.engine.preprocess(lambda inputs: _token_ids(inputs, body, serving.config.chat_template))
    except (ValueError, TypeError) as error:  # a conversation the chat template cannot take
        raise APIError(400, str(error), param="messages") from error
    answer: dict[str, Any] = {"count": len(token_ids), "max_model_len": serving.max_model_len, "tokens": token_ids}
    if body.return_token_strs:
        answer["token_strs"] = serving.tokenizer.convert_ids_to_tokens(token_ids)
    return JSONResponse(answer)


def _token_ids(inputs, body: TokenizeRequest, chat_template: str | None) -> list[int]:
    """The prompt's tokens, or the messages' through the chat template the chat route uses (the
    operator's --chat-template, else the model's)."""
    if body.prompt is not None:
        return inputs.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    conversation = [message.model_dump(exclude_none=True) for message in body.messages]
    template = {} if chat_template is None else {"chat_template": chat_template}
    text = inputs.render_chat_text(conversation, body.add_generation_prompt, **template)
    return inputs.tokenizer.encode(text, add_special_tokens=False)


@router.post("/detokenize", responses=error_responses(400, 404))
async def detokenize(body: DetokenizeRequest, http_request: Request) -> JSONResponse:
    serving: Serving = http_request.app.state.serving
    serving.resolve_model(body.model)
    vocab_size = len(serving.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param="tokens")
    text = await serving.engine.preprocess(lambda inputs: inputs.tokenizer.decode(body.tokens))
    return JSONResponse({"prompt": text})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.api_route("/ping", methods=["GET", "POST"])
async def ping() -> JSONResponse:
    """Liveness for load balancers that probe /ping (SageMaker, as vLLM serves it)."""
    return JSONResponse({})
