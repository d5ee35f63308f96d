"""LlamaIndex's function calling in the engine's terms: tools as OpenAI specs, LlamaIndex's
tool_choice forms as OpenAI's, and the calls of a response as ToolSelections."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import ChatResponse
from llama_index.core.llms.llm import ToolSelection

from .messages import message_tool_calls

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

TOOL_KWARGS = ("tools", "tool_choice", "parallel_tool_calls")
"""The chat keywords that go to the engine's tool request, not to SamplingParams."""
OPENAI_CHOICES = ("none", "auto", "required")


def openai_tools(tools: Sequence[BaseTool], strict: bool | None = None) -> list[dict]:
    """Each tool as an OpenAI function spec (``{"type": "function", "function": {"name",
    "description", "parameters"}}``), with ``strict`` when it is given."""
    specs = [tool.metadata.to_openai_tool(skip_length_check=True) for tool in tools]
    if strict is not None:
        for spec in specs:
            spec["function"]["strict"] = strict
    return specs


def openai_tool_choice(tool_choice: str | dict | None, tool_required: bool) -> str | dict:
    """OpenAI's tool_choice for LlamaIndex's: None is "required" when a call is required,
    else "auto"; a tool's name is that function forced; OpenAI's forms are kept."""
    if tool_choice is None:
        return "required" if tool_required else "auto"
    if isinstance(tool_choice, str) and tool_choice not in OPENAI_CHOICES:
        return {"type": "function", "function": {"name": tool_choice}}
    return tool_choice


def tool_selections(response: ChatResponse) -> list[ToolSelection]:
    """The calls of a response's message (see ``message_tool_calls``), arguments decoded."""
    return [ToolSelection(tool_id=call.get("id", ""), tool_name=call["function"]["name"],
                          tool_kwargs=json.loads(call["function"]["arguments"]))
            for call in message_tool_calls(response.message)]


def keep_first_call(response: ChatResponse) -> ChatResponse:
    """The response, its message trimmed in place to its first tool call (when it made several)."""
    calls = response.message.additional_kwargs.get("tool_calls")
    if calls and len(calls) > 1:
        response.message.additional_kwargs["tool_calls"] = calls[:1]
    return response


def no_call_error(response: ChatResponse) -> ValueError:
    """What a response that had to hold a tool call but holds none says, and the two remedies."""
    finish_reason = response.additional_kwargs.get("finish_reason")
    return ValueError(f"Expected at least one tool call, but the response holds none (finish_reason "
                      f"{finish_reason!r}); its text: {response.message.content!r:.300}. Force a call with "
                      "tool_required=True or tool_choice=<a tool's name>; a forced call cut short by max_tokens "
                      "comes back as text (finish_reason 'length'): raise max_tokens.")


def split_tool_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tool request keywords, the others) of a chat call's keywords."""
    tools = {name: value for name, value in kwargs.items() if name in TOOL_KWARGS}
    return tools, {name: value for name, value in kwargs.items() if name not in TOOL_KWARGS}
