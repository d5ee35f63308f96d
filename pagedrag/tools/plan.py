"""Which tool calls a chat request allows, and how its output is read back as calls.

``plan_tools`` checks OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` once,
when the request is made, and returns a ``ToolPlan``. As in vLLM, ``tool_choice``
"required" and a named function are enforced by a JSON-schema grammar
(``ToolPlan.structured_outputs``), so the output is the calls themselves as JSON; "auto"
leaves the text free and a model family's ToolParser reads the calls out of it; "none"
reads no calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedrag.sampling_params import ParameterError
from pagedrag.structured.params import StructuredOutputsParams
from pagedrag.structured.schema_oneof import resolve
from pagedrag.structured.schema_support import EXCLUSIVE, schema_nodes
from pagedrag.text_checks import check_bool

if TYPE_CHECKING:
    from pagedrag.sampling_params import SamplingParams
    from pagedrag.tools.parsers import ToolParser

MAX_TOOLS = 128  # OpenAI's limit on one request's tools
NAME_PATTERN = r"[a-zA-Z0-9_-]{1,64}"  # OpenAI's function names
_NAME = re.compile(NAME_PATTERN)
_ID_ALPHABET = string.ascii_letters + string.digits
_ID_CHARS = 24
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made.

    ``arguments`` is always the JSON text of an object (re-serialized with
    ensure_ascii=False, whatever spacing the model used); ``id`` is "call_" followed by 24
    random letters and digits, fresh for every call.
    """

    id: str
    name: str
    arguments: str

    @classmethod
    def new(cls, name: str, arguments: dict) -> ToolCall:
        """A call with a fresh id."""
        suffix = "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_CHARS))
        return cls(id="call_" + suffix, name=name, arguments=json.dumps(arguments, ensure_ascii=False))

    @classmethod
    def from_json(cls, value: Any, argument_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
        """The call a decoded JSON value spells, or None when it spells none.

        A call is an object with a non-empty string "name" and, under the first of
        ``argument_keys`` it has, an object or the JSON text of one (models write both);
        a call without arguments has the empty object.
        """
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        key = next((key for key in argument_keys if key in value), None)
        arguments = {} if key is None else json_object(value[key])
        return None if arguments is None else cls.new(value["name"], arguments)

    def to_openai(self) -> dict:
        """The call as an OpenAI chat message's ``tool_calls`` item."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def calls_from_json(value: Any) -> list[ToolCall] | None:
    """The calls a decoded JSON list spells, or None unless it is a list whose every item
    is a call ``{"name", "arguments"}`` (``ToolCall.from_json``)."""
    if not isinstance(value, list):
        return None
    calls = [ToolCall.from_json(item) for item in value]
    return None if None in calls else calls


def json_object(value: Any) -> dict | None:
    """``value`` if it is a dict, the object a string holds as JSON text, else None."""
    if isinstance(value, str):
        value = loads(value)
    return value if isinstance(value, dict) else None


def loads(text: str) -> Any:
    """The JSON value ``text`` holds, or None when it holds none (never raises)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        return None


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's checked tools and what it allows.

    ``tools`` are OpenAI tools, ``{"type": "function", "function": {"name",
    "description"?, "parameters", "strict"?}}``, each with unique name and with
    ``parameters`` a JSON schema of objects (the empty-object schema where none was
    given): of type "object", or whose root ``$ref``, ``anyOf``, ``oneOf``, ``allOf``,
    ``enum`` or ``const`` allows only objects. ``choice`` is "none", "auto", "required"
    or "named"; ``named`` is the declared function a "named" choice forces, else None.
    ``parallel`` False: at most one call ("required": by the grammar; "auto": the first of
    the calls the model wrote, as vLLM trims them).
    """

    tools: tuple[dict, ...]
    choice: str
    named: str | None
    parallel: bool

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar that enforces the choice: for "named" the function's arguments
        object, for "required" a non-empty JSON array of ``{"name", "arguments"}`` calls
        (at most one unless parallel); None (free text) for "auto" and "none". The JSON is
        compact: no reader sees it as written, and free whitespace only spends tokens."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self._parameters(self.named), disable_any_whitespace=True)
        if self.choice == "required":
            return StructuredOutputsParams(json=self._calls_schema(), disable_any_whitespace=True)
        return None

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with this plan's grammar (required / named); a request that already
        constrains its output (response_format, structured_outputs) cannot also force a call."""
        forced = self.structured_outputs()
        if forced is None:
            return params
        if params.structured_outputs is not None:
            raise ValueError(f"tool_choice {self.choice!r} shapes the output as the call's JSON; it cannot be "
                             "combined with response_format or structured outputs")
        return dataclasses.replace(params, structured_outputs=forced)

    def parse(self, text: str, parser: ToolParser) -> tuple[str | None, list[ToolCall]]:
        """The output as (content, calls). Never raises: output a forced choice cannot read
        (cut short by max_tokens, say) comes back as content with no calls."""
        if self.choice == "auto":
            content, calls = parser.parse(text)
            return content, calls if self.parallel else calls[:1]
        if self.choice == "none":
            return text, []
        calls = self._forced_calls(text)
        return (None, calls) if calls else (text, [])

    def _forced_calls(self, text: str) -> list[ToolCall] | None:
        if self.choice == "named":
            arguments = json_object(text)
            return None if arguments is None else [ToolCall.new(self.named, arguments)]
        return calls_from_json(loads(text))

    def _parameters(self, name: str) -> dict:
        return next(tool["function"]["parameters"] for tool in self.tools if tool["function"]["name"] == name)

    def _calls_schema(self) -> dict:
        calls = [_call_schema(index, tool["function"]) for index, tool in enumerate(self.tools)]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def _call_schema(index: int, function: dict) -> dict:
    """The schema of one call of ``function``, the ``index``-th alternative of the calls
    array's items: its parameters' local references ("#/...") are rebased onto where the
    parameters now sit, so pydantic-style ``$defs`` keep resolving. A root ``$id`` is
    dropped: it would make the parameters a resource of their own, which their rebased
    references no longer need (the named tool's grammar takes it, at the root, as an
    annotation)."""
    rebased = _rebase_refs(function["parameters"], f"#/items/anyOf/{index}/properties/arguments")
    parameters = {keyword: value for keyword, value in rebased.items() if keyword != "$id"}
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [function["name"]]}, "arguments": parameters},
            "required": ["name", "arguments"]}


def _rebase_refs(schema: dict, root: str) -> dict:
    """A copy of ``schema`` with the "$ref" to its own root ("#" or "#/...") of each schema
    in it pointing under ``root``. Schemas are what the grammar reads (schema_nodes:
    subschemas at their positions and $ref targets); data, such as a ``const`` or
    ``default`` value that holds a "$ref" key, is copied as it is."""
    rebased = json.loads(json.dumps(schema))
    for node, steps, _ in schema_nodes(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            _at(rebased, steps)["$ref"] = root + ref[1:]
    return rebased


def _at(value: Any, steps: tuple[str | int, ...]) -> Any:
    for step in steps:
        value = value[step]
    return value


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any = True) -> ToolPlan | None:
    """Check a chat request's tool fields (OpenAI's forms only); None when the request
    involves no tools (none given, and tool_choice absent, "none" or "auto").

    ``tool_choice`` None means "auto". ``parallel_tool_calls`` None means True (JSON
    bodies send null for absent). Bad fields raise TypeError (wrong kind of value) or
    ValueError (wrong value), naming the field.
    """
    declared = _check_tools(tools)
    choice, named = _check_choice(tool_choice, [tool["function"]["name"] for tool in declared])
    parallel = True if parallel_tool_calls is None else check_bool("parallel_tool_calls", parallel_tool_calls)
    if not declared and choice in ("none", "auto"):
        return None
    return ToolPlan(tools=declared, choice=choice, named=named, parallel=parallel)


def _check_tools(tools: Any) -> tuple[dict, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be a list of {{'type': 'function', 'function': {{...}}}} objects, "
                        f"got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools, got {len(tools)}")
    checked = tuple(_check_tool(f"tools[{index}]", tool) for index, tool in enumerate(tools))
    names = [tool["function"]["name"] for tool in checked]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"tool names must be unique; {repeated} appear more than once")
    return checked


def _check_tool(where: str, tool: Any) -> dict:
    if not isinstance(tool, Mapping):
        raise TypeError(f"{where} must be an object {{'type': 'function', 'function': {{...}}}}, "
                        f"got {type(tool).__name__}")
    if tool.get("type") != "function":
        raise ValueError(f"{where}.type must be 'function', got {tool.get('type')!r}")
    _check_keys(where, tool, _TOOL_KEYS)
    return {"type": "function", "function": _check_function(f"{where}.function", tool.get("function"))}


def _check_function(where: str, function: Any) -> dict:
    """The function's fields, checked; an optional field that is None counts as absent."""
    if not isinstance(function, Mapping):
        raise TypeError(f"{where} must be an object with a 'name', got {type(function).__name__}")
    _check_keys(where, function, _FUNCTION_KEYS)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}.name must match ^{NAME_PATTERN}$, got {name!r}")
    checked = {"name": name}
    if function.get("description") is not None:
        if not isinstance(function["description"], str):
            raise TypeError(f"{where}.description must be a string, got {type(function['description']).__name__}")
        checked["description"] = function["description"]
    checked["parameters"] = _check_parameters(f"{where}.parameters", function.get("parameters"))
    if function.get("strict") is not None:
        checked["strict"] = check_bool(f"{where}.strict", function["strict"])
    return checked


def _check_parameters(where: str, schema: Any) -> dict:
    """A private copy of an object schema, its "type" made explicit; except beside a root
    ``$ref``, ``anyOf``, ``oneOf``, ``allOf``, ``enum`` or ``const`` (the grammar would
    drop a "type" there), where every alternative must be an object already."""
    if schema is None:
        return dict(_NO_PARAMETERS)
    if not isinstance(schema, Mapping):
        raise TypeError(f"{where} must be a JSON schema object (a dict), got {type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where} must be the schema of an object (type 'object'), got type {schema['type']!r}")
    try:
        copy = json.loads(json.dumps(schema, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} is not JSON: {error}") from None
    primary = next((keyword for keyword in EXCLUSIVE if keyword in copy), None)
    if primary is None:
        return {"type": "object", **copy}
    if "type" not in copy and not _objects_only(copy, copy):
        raise ValueError(f"{where} must be the schema of an object: its root {primary!r} must allow only objects "
                         "(each alternative of type 'object')")
    return copy


def _objects_only(schema: Any, root: Any, depth: int = 0) -> bool:
    """Whether ``schema`` allows objects only, as its type, const, enum, local $ref and
    combinators (every branch, at most 16 deep) show; False where they do not show it."""
    schema = resolve(schema, root)
    if not isinstance(schema, Mapping) or depth > 16:
        return False
    if "type" in schema:
        return schema["type"] == "object"
    if "const" in schema:
        return isinstance(schema["const"], dict)
    if "enum" in schema:
        return isinstance(schema["enum"], list) and all(isinstance(value, dict) for value in schema["enum"])
    branches = next((schema[keyword] for keyword in ("anyOf", "oneOf", "allOf") if keyword in schema), None)
    return isinstance(branches, list) and bool(branches) and all(
        _objects_only(branch, root, depth + 1) for branch in branches)


def _check_keys(where: str, value: Mapping, known: frozenset[str]) -> None:
    unknown = sorted(map(str, set(value) - known))
    if unknown:
        raise ValueError(f"{where} has unknown fields {unknown}; it takes {sorted(known)}")


def _check_choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    """(choice, named) for a tool_choice, given the declared function names."""
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ParameterError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or "
                                                f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")
        if tool_choice == "required" and not names:
            raise ParameterError("tool_choice", "tool_choice 'required' needs tools, and none were given")
        return tool_choice, None
    name = _named_function(tool_choice)
    if name not in names:
        raise ParameterError("tool_choice", f"tool_choice names function {name!r}, which is not among the tools "
                                            f"({', '.join(names) or 'none were given'})")
    return "named", name


def _named_function(tool_choice: Any) -> str:
    """The name in ``{"type": "function", "function": {"name": N}}``."""
    shape = "{'type': 'function', 'function': {'name': ...}}"
    if not isinstance(tool_choice, Mapping):
        raise TypeError(f"tool_choice must be a string or {shape}, got {type(tool_choice).__name__}")
    function = tool_choice.get("function")
    if tool_choice.get("type") != "function" or set(tool_choice) != _TOOL_KEYS or not isinstance(function, Mapping) \
            or set(function) != {"name"} or not isinstance(function["name"], str):
        raise ParameterError("tool_choice", f"a named tool_choice must be {shape}, got {tool_choice!r:.200}")
    return function["name"]
