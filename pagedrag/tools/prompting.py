"""How a chat request's tools and its past calls and results reach the chat template.

A template that renders tools itself (it reads the ``tools`` variable: Qwen, Llama 3.1+,
Hermes, Mistral...) gets them as ``apply_chat_template(..., tools=...)`` and the history
in OpenAI's shape, with each call's arguments as a dict (those templates ``tojson`` them,
and a JSON string would come out encoded twice). A template that does not (plain ChatML,
as SmolLM2-135M's) gets the model family's tool instructions in the system message, past
calls written into the assistant's content the way the family writes them, and results
wrapped in ``<tool_response>`` tags (the Hermes / SmolLM2 convention). Every message is
copied, never changed in place; list-of-parts content is left for
``pagedrag.engine.inputs.normalize_conversation`` to join.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pagedrag.tools.plan import json_object

if TYPE_CHECKING:
    from pagedrag.tools.parsers import ToolParser
    from pagedrag.tools.plan import ToolPlan

TOOL_RESPONSE_TAG, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
_TOOLS_VARIABLE = re.compile(r"\btools\b")
_CALL_SHAPE = "{'type': 'function', 'function': {'name': str, 'arguments': JSON text of an object}}"


def chat_template_text(tokenizer) -> str:
    """The tokenizer's chat template text; named templates (a dict) joined; "" for none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        return "\n".join(text for text in template.values() if isinstance(text, str))
    return template if isinstance(template, str) else ""


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template reads the ``tools`` variable."""
    return _TOOLS_VARIABLE.search(chat_template_text(tokenizer)) is not None


def prepare_conversation(messages: list[dict], plan: ToolPlan | None, parser: ToolParser,
                         supports_tools: bool) -> tuple[list[dict], dict]:
    """(messages, extra ``apply_chat_template`` kwargs) for a conversation that may carry
    tools (``plan``; rendered for tool_choice "none" too, as vLLM does), past
    ``tool_calls`` and "tool" results. Raises ValueError for malformed tool_calls or tool
    results; leaves other malformed messages to ``normalize_conversation``."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("a conversation must be a non-empty list of {'role', 'content'} messages")
    prepared = [_prepare_message(message, parser, supports_tools) for message in messages]
    if plan is None:
        return prepared, {}
    if supports_tools:
        return prepared, {"tools": list(plan.tools)}
    return _with_system_text(prepared, parser.system_prompt(plan.tools)), {}


def _prepare_message(message: Any, parser: ToolParser, supports_tools: bool) -> Any:
    if not isinstance(message, Mapping):
        return message
    if message.get("role") == "tool":
        return _tool_result(message, supports_tools)
    if "tool_calls" in message:
        return _assistant_calls(message, parser, supports_tools)
    return dict(message)


def _tool_result(message: Mapping, supports_tools: bool) -> dict:
    content = message.get("content")
    if not isinstance(content, (str, list)):
        raise ValueError(f"a tool message's content must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    if supports_tools:
        return dict(message)
    if isinstance(content, str):
        return {**message, "content": f"{TOOL_RESPONSE_TAG}\n{content}\n{TOOL_RESPONSE_END}"}
    parts = [_text_part(TOOL_RESPONSE_TAG), *content, _text_part(TOOL_RESPONSE_END)]  # joined with newlines later
    return {**message, "content": parts}


def _assistant_calls(message: Mapping, parser: ToolParser, supports_tools: bool) -> dict:
    """The message with its calls in the template's form: kept (arguments as dicts, null
    content as "") where the template renders tools, else written into the content."""
    if message.get("role") != "assistant":
        raise ValueError(f"only assistant messages carry tool_calls, got one with role {message.get('role')!r}")
    calls = _checked_calls(message["tool_calls"])
    prepared = {key: value for key, value in message.items() if key != "tool_calls"}
    if supports_tools:
        if calls:
            prepared["tool_calls"] = calls
        if prepared.get("content") is None:
            prepared["content"] = ""
    elif calls:
        prepared["content"] = _with_text(prepared.get("content"), parser.render_calls(
            [call["function"] for call in calls]))
    return prepared


def _checked_calls(tool_calls: Any) -> list[dict]:
    """Copies of OpenAI ``tool_calls`` (None: none), each function's arguments a dict."""
    if tool_calls is None:
        return []
    if not isinstance(tool_calls, (list, tuple)):
        raise ValueError(f"an assistant message's tool_calls must be a list of {_CALL_SHAPE}, "
                         f"got {type(tool_calls).__name__}")
    return [_checked_call(f"tool_calls[{index}]", call) for index, call in enumerate(tool_calls)]


def _checked_call(where: str, call: Any) -> dict:
    if not isinstance(call, Mapping) or call.get("type") != "function" or not isinstance(call.get("function"), Mapping):
        raise ValueError(f"{where} must be {_CALL_SHAPE}, got {call!r:.200}")
    function = call["function"]
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}.function.name must be a non-empty string, got {function.get('name')!r:.100}")
    return {**call, "function": {**function, "arguments": _arguments(where, function.get("arguments"))}}


def _arguments(where: str, arguments: Any) -> dict:
    checked = json_object(arguments)
    if checked is None:
        raise ValueError(f"{where}.function.arguments must be the JSON text of an object (or an object), "
                         f"got {arguments!r:.200}")
    return checked


def _with_system_text(messages: list, text: str) -> list:
    """``text`` appended to the first message where it is a system message, else as a
    new system message before the others."""
    first = messages[0]
    if isinstance(first, Mapping) and first.get("role") == "system":
        return [{**first, "content": _with_text(first.get("content"), text)}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _with_text(content: Any, text: str) -> str | list:
    """``text`` on a new line after a message's content (a string, a list of text parts,
    or nothing)."""
    if not content:
        return text
    if isinstance(content, str):
        return f"{content}\n{text}"
    if isinstance(content, list):
        return [*content, _text_part(text)]  # joined with newlines later
    raise ValueError(f"chat message content must be a string or a list of text parts, got {type(content).__name__}")


def _text_part(text: str) -> dict:
    return {"type": "text", "text": text}
