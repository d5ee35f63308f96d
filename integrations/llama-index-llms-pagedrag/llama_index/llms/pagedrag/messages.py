"""LlamaIndex chat messages as the engine takes them: OpenAI's chat message dicts.

Invariants: every message becomes ``{"role", "content"}`` with its text blocks joined; an
assistant message that made tool calls also carries them as OpenAI ``tool_calls`` (each
``{"id", "type": "function", "function": {"name", "arguments"}}`` with the arguments as
JSON text), its content None when it has no text; a "tool" message carries its
``tool_call_id``. A block that is neither text nor (in an assistant message) a tool call
is a TypeError, never dropped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock
from llama_index.core.bridge.pydantic import BaseModel

from pagedrag.client import Messages

try:  # llama-index-core's tool-call blocks (0.14.x); messages of earlier versions hold none
    from llama_index.core.base.llms.types import ToolCallBlock
    CALL_BLOCKS: tuple[type, ...] = (ToolCallBlock,)
except ImportError:
    CALL_BLOCKS = ()


def engine_messages(messages: Sequence[ChatMessage]) -> Messages:
    """The conversation as the engine's message dicts (see the module's invariants)."""
    return [_engine_message(index, message) for index, message in enumerate(messages)]


def message_tool_calls(message: ChatMessage) -> list[dict]:
    """The calls an assistant message made, in OpenAI's shape with JSON-text arguments:
    ``additional_kwargs["tool_calls"]`` where PagedRAG (and llama-index's OpenAI LLM)
    keep them, as dicts or as the openai package's objects; else its ToolCallBlocks."""
    stored = message.additional_kwargs.get("tool_calls")
    if stored:
        return [_openai_call(call.model_dump() if isinstance(call, BaseModel) else call) for call in stored]
    return [_block_call(block) for block in message.blocks if isinstance(block, CALL_BLOCKS)]


def _engine_message(index: int, message: ChatMessage) -> dict[str, Any]:
    role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
    _check_blocks(index, message, role)
    text = message.content or ""
    calls = message_tool_calls(message) if role == MessageRole.ASSISTANT.value else []
    if calls:
        return {"role": role, "content": text or None, "tool_calls": calls}
    converted = {"role": role, "content": text}
    if role == MessageRole.TOOL.value and "tool_call_id" in message.additional_kwargs:
        converted["tool_call_id"] = message.additional_kwargs["tool_call_id"]
    return converted


def _check_blocks(index: int, message: ChatMessage, role: str) -> None:
    """Text blocks, and tool-call blocks in an assistant message; anything else a TypeError."""
    allowed = (TextBlock, *CALL_BLOCKS) if role == MessageRole.ASSISTANT.value else (TextBlock,)
    for block in message.blocks:
        if not isinstance(block, allowed):
            raise TypeError(f"messages[{index}] ({role}) holds a {type(block).__name__}; PagedRAG takes text "
                            "(and an assistant's tool calls) only")


def _openai_call(call: dict) -> dict:
    function = call["function"]
    return _call(call.get("id"), function["name"], function.get("arguments"))


def _block_call(block: Any) -> dict:
    """A ToolCallBlock's call."""
    return _call(block.tool_call_id, block.tool_name, block.tool_kwargs)


def _call(call_id: str | None, name: str, arguments: Any) -> dict:
    """One call in OpenAI's shape; arguments as JSON text (text kept, a dict encoded, None: no
    arguments); no "id" key when it has none."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
    call = {"type": "function", "function": {"name": name, "arguments": text}}
    return call if call_id is None else {"id": call_id, **call}
