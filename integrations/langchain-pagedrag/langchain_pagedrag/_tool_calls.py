"""LangChain's tool calling in the engine's terms (OpenAI's): the forms of ``tool_choice``,
the calls a reply makes (``AIMessage.tool_calls``, stream ``tool_call_chunks``) and the
calls a conversation sends back (an assistant message's ``tool_calls``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage
from langchain_core.messages.tool import ToolCallChunk, invalid_tool_call, tool_call, tool_call_chunk

from pagedrag.tools import ToolCall
from pagedrag.tools.plan import json_object

# Call keywords that go to the engine client beside the sampling (see bind_tools)
TOOL_KEYWORDS = ("tools", "tool_choice", "parallel_tool_calls")
_OPENAI_CHOICES = ("auto", "none", "required")


def tool_request(tool_choice: str | bool | dict | None, parallel_tool_calls: bool | None,
                 names: Sequence[str]) -> dict[str, Any]:
    """LangChain's ``tool_choice`` and ``parallel_tool_calls`` for tools named ``names``, as
    the engine's OpenAI-style keywords.

    None or False say nothing (the engine's "auto"); a bound tool's name (looked up first)
    forces that function; "any" and True are "required" (as ChatOpenAI reads them), and
    with one tool bound they also default ``parallel_tool_calls`` to False: exactly one
    call of it, as ChatAnthropic reads True (a small model, free to add calls, may never
    stop). "auto", "none", "required" and OpenAI's dict ``{"type": "function", "function":
    {"name": ...}}`` stay as they are (the engine checks the dict); any other string is a
    ValueError naming the bound tools.
    """
    choice = _openai_choice(tool_choice, names)
    if choice == "required" and tool_choice != "required" and len(names) == 1 and parallel_tool_calls is None:
        parallel_tool_calls = False  # "any" or True, one tool: exactly one call of it
    return {"tool_choice": choice, "parallel_tool_calls": parallel_tool_calls}


def _openai_choice(tool_choice: str | bool | dict | None, names: Sequence[str]) -> str | dict | None:
    """OpenAI's tool_choice for LangChain's (see tool_request)."""
    if tool_choice is None or tool_choice is False:
        return None
    if isinstance(tool_choice, dict):
        return tool_choice
    if tool_choice is not True and not isinstance(tool_choice, str):
        raise TypeError(f"tool_choice must be a string, a bool or a dict, got {type(tool_choice).__name__}")
    if tool_choice in names:
        return {"type": "function", "function": {"name": tool_choice}}
    if tool_choice in (True, "any"):
        return "required"
    if tool_choice in _OPENAI_CHOICES:
        return tool_choice
    raise ValueError(f"tool_choice {tool_choice!r} is neither a bound tool ({', '.join(names) or 'none bound'}) "
                     f"nor one of {', '.join(_OPENAI_CHOICES)}, any")


def message_tool_calls(calls: Sequence[ToolCall]) -> dict[str, list]:
    """The engine's calls as AIMessage fields: ``tool_calls`` for those whose arguments are
    the JSON text of an object (parsed), ``invalid_tool_calls`` for the others (their text
    kept, with the reason)."""
    valid, invalid = [], []
    for call in calls:
        arguments = json_object(call.arguments)
        if arguments is None:
            invalid.append(invalid_tool_call(name=call.name, args=call.arguments, id=call.id,
                                             error="the arguments are not the JSON text of an object"))
        else:
            valid.append(tool_call(name=call.name, args=arguments, id=call.id))
    return {"tool_calls": valid, "invalid_tool_calls": invalid}


def stream_tool_call_chunks(calls: Sequence[ToolCall]) -> list[ToolCallChunk]:
    """The calls as a stream's last chunk carries them: one chunk per call, whole (its
    arguments' full text), indexed in order; summed chunks read them as ``tool_calls``."""
    return [tool_call_chunk(name=call.name, args=call.arguments, id=call.id, index=index)
            for index, call in enumerate(calls)]


def openai_tool_calls(message: AIMessage) -> list[dict[str, Any]]:
    """An AIMessage's calls as an OpenAI assistant message's ``tool_calls``: valid ones with
    their arguments as JSON text, invalid ones with the text they came with (which the
    engine refuses unless it is an object's JSON), in that order."""
    valid = [(call["id"], call["name"], json.dumps(call["args"], ensure_ascii=False)) for call in message.tool_calls]
    invalid = [(call["id"], call["name"], call["args"]) for call in message.invalid_tool_calls]
    return [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            for call_id, name, arguments in (*valid, *invalid)]
