"""Tool calls in free text, one parser per model family (tool_choice "auto").

A parser reads the calls a family writes (``parse``), tells a stream how much of the
output so far might begin a call (``holdback``), and, for chat templates that cannot
render tools themselves, writes the family's tool instructions (``system_prompt``) and
its past calls (``render_calls``) as text. Parsers hold no state; ``PARSERS`` has one of
each under the name a ``--tool-call-parser`` option gives (vLLM's for the first two):

- "hermes": ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, once per
  call (Hermes 2 Pro / 3, Qwen 2 / 2.5 / 3 and many others);
- "llama3_json": the whole output is ``{"name": ..., "parameters": {...}}``, several
  joined by ";", maybe after ``<|python_tag|>`` (Llama 3.1 / 3.2 / 3.3);
- "smollm2": ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`` (SmolLM2,
  the embedded model).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod

from pagedrag.tools.plan import ToolCall, calls_from_json, loads
from pagedrag.tools.prompting import chat_template_text

TOOL_CALL_TAG, TOOL_CALL_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_LLAMA3_ARGUMENT_KEYS = ("parameters", "arguments")
_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


class ToolParser(ABC):
    """One model family's way of writing tool calls as text.

    Invariants: ``parse`` never raises, and a call it cannot read stays in the content,
    where the client sees it. For any output ``t`` so far, ``t[:len(t) - holdback(t)]``
    holds no part of a call and only grows as ``t`` grows, so a stream may send it as
    content at once.
    """

    name: str

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls). Text the parser reads nothing from comes back unchanged as
        the content; otherwise the content is the text around what it read, stripped,
        None if that is empty."""

    @abstractmethod
    def holdback(self, text: str) -> int:
        """How many trailing characters of the output so far may belong to a call."""

    @abstractmethod
    def system_prompt(self, tools: tuple[dict, ...]) -> str:
        """The family's instructions for calling ``tools`` (checked OpenAI tools)."""

    @abstractmethod
    def render_calls(self, calls: list[dict]) -> str:
        """Past calls (``{"name", "arguments": dict}``) as the family writes them; ``parse``
        reads the text back as the same calls."""


class _TaggedParser(ToolParser):
    """Calls inside ``<tool_call>...</tool_call>``. The closing tag may be missing at the
    very end of the output (generation stopped on it). A tag whose body ``_calls_in``
    cannot read stays in the content, tags and all."""

    _TAGGED = re.compile(re.escape(TOOL_CALL_TAG) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", re.DOTALL)

    @abstractmethod
    def _calls_in(self, body: str) -> list[ToolCall] | None:
        """The calls one tag's body holds, or None when it is not the family's calls."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, outside, start, read = [], [], 0, False
        for match in self._TAGGED.finditer(text):
            found = self._calls_in(match.group(1))
            if found is not None:
                outside.append(text[start:match.start()])
                calls.extend(found)
                start, read = match.end(), True
        if not read:
            return text, []
        outside.append(text[start:])
        return "".join(outside).strip() or None, calls

    def holdback(self, text: str) -> int:
        """From the first ``<tool_call>`` to the end, else the longest end of the text
        that begins the tag."""
        start = text.find(TOOL_CALL_TAG)
        if start >= 0:
            return len(text) - start
        return next((size for size in range(len(TOOL_CALL_TAG) - 1, 0, -1)
                     if text.endswith(TOOL_CALL_TAG[:size])), 0)


class HermesParser(_TaggedParser):
    """One JSON call object per ``<tool_call>`` tag."""

    name = "hermes"

    def _calls_in(self, body: str) -> list[ToolCall] | None:
        call = ToolCall.from_json(loads(body))
        return None if call is None else [call]

    def system_prompt(self, tools: tuple[dict, ...]) -> str:
        signatures = "\n".join(_dumps(tool) for tool in tools)
        return ("# Tools\n\nYou may call one or more functions to help with the user's request. Their signatures "
                f"are inside <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n\n"
                "For each call, write a JSON object with the function's name and arguments inside "
                "<tool_call></tool_call> XML tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_calls(self, calls: list[dict]) -> str:
        return "\n".join(f"{TOOL_CALL_TAG}\n{_dumps(_call(call))}\n{TOOL_CALL_END}" for call in calls)


class SmolLM2Parser(_TaggedParser):
    """A JSON list of call objects (or one object) in one ``<tool_call>`` tag; an empty
    list, the model card's "no call needed", is read as no calls."""

    name = "smollm2"

    def _calls_in(self, body: str) -> list[ToolCall] | None:
        value = loads(body)
        return calls_from_json([value] if isinstance(value, dict) else value)

    def system_prompt(self, tools: tuple[dict, ...]) -> str:
        functions = _dumps([tool["function"] for tool in tools])
        return ("You compose function calls. Given a question and a set of possible functions, make one or more "
                "function calls when they serve the question. If none of the functions fits, or the question "
                "lacks parameters a function needs, say so in plain text.\n"
                f"You have access to the following tools:\n<tools>{functions}</tools>\n"
                "To call functions, answer with nothing but the calls, in this format, with arguments of the "
                "types the parameters declare:\n"
                '<tool_call>[\n{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},'
                "\n... (more tool calls as required)\n]</tool_call>")

    def render_calls(self, calls: list[dict]) -> str:
        return f"{TOOL_CALL_TAG}{_dumps([_call(call) for call in calls])}{TOOL_CALL_END}"


class Llama3JsonParser(ToolParser):
    """The whole stripped output is calls ``{"name", "parameters" (or "arguments")}``
    joined by ";", maybe after ``<|python_tag|>``; any other output is content."""

    name = "llama3_json"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        calls = _json_calls(body)
        return (None, calls) if calls else (text, [])

    def holdback(self, text: str) -> int:
        """All of it while the stripped text so far begins, or is the beginning of, "{"
        or ``<|python_tag|>``; none otherwise."""
        start = text.lstrip()
        maybe_call = any(start.startswith(opener) or opener.startswith(start) for opener in ("{", PYTHON_TAG))
        return len(text) if maybe_call else 0

    def system_prompt(self, tools: tuple[dict, ...]) -> str:
        signatures = "\n\n".join(_dumps(tool) for tool in tools)
        return ("You have access to the following functions. To call one, respond with nothing but a JSON object "
                '{"name": function name, "parameters": dictionary of argument name and its value}; separate '
                'several calls with "; ". Do not use variables.\n\n' + signatures)

    def render_calls(self, calls: list[dict]) -> str:
        return "; ".join(_dumps({"name": call["name"], "parameters": call["arguments"]}) for call in calls)


def _json_calls(body: str) -> list[ToolCall] | None:
    """The calls of a whole text of JSON call objects joined by ";", or None."""
    calls, position = [], 0
    while True:
        try:
            value, position = _DECODER.raw_decode(body, position)
        except (ValueError, RecursionError):
            return None
        call = ToolCall.from_json(value, _LLAMA3_ARGUMENT_KEYS)
        if call is None:
            return None
        calls.append(call)
        position = _SPACE.match(body, position).end()
        if position == len(body):
            return calls
        if body[position] != ";":
            return None
        position = _SPACE.match(body, position + 1).end()


def _call(call: dict) -> dict:
    return {"name": call["name"], "arguments": call["arguments"]}


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


PARSERS: dict[str, ToolParser] = {parser.name: parser
                                  for parser in (HermesParser(), Llama3JsonParser(), SmolLM2Parser())}

# (marker, parser name), first match wins: Hermes models built on Llama 3 write Hermes calls.
_TEMPLATE_MARKERS = ((TOOL_CALL_TAG, "hermes"), (PYTHON_TAG, "llama3_json"),
                     ("Environment: ipython", "llama3_json"), ("<|start_header_id|>", "llama3_json"))
_NAME_MARKERS = (("hermes", "hermes"), ("qwen", "hermes"), ("llama-3", "llama3_json"), ("llama3", "llama3_json"))


def parser_for(tokenizer, model_name: str | None = None) -> ToolParser:
    """The parser of the model's family, read from its chat template's markers, else from
    its name; SmolLM2's (plain ChatML, the embedded model's) when neither tells."""
    template = chat_template_text(tokenizer)
    name = (model_name or "").lower()
    found = next((parser for marker, parser in _TEMPLATE_MARKERS if marker in template),
                 next((parser for marker, parser in _NAME_MARKERS if marker in name), "smollm2"))
    return PARSERS[found]
