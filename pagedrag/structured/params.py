"""What shape a request's output must take: ``StructuredOutputsParams``, as vLLM names it.

Exactly one kind of constraint per request: a JSON schema (``json``), any JSON object
(``json_object``), a regular expression (``regex``), one of fixed strings (``choice``) or
a grammar (``grammar``: EBNF as xgrammar and llama.cpp's GBNF write it, or Lark). The
constraint is compiled by pagedrag.structured.compiler; here it is only checked for
shape, so that a bad one fails when the request is made, never in a step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pagedrag.structured.schema_support import check_schema
from pagedrag.structured.unique_items import enforce_unique_items
from pagedrag.text_checks import check_bool, check_utf8

logger = logging.getLogger("pagedrag")

MAX_SPEC_CHARS = 1 << 17  # a schema, regex or grammar as text (128 Ki characters)
MAX_CHOICES = 1024
# Nesting of a schema document (objects and lists): real schemas stay far below it, and
# xgrammar's compile time grows faster than linearly with depth (an array of arrays 900
# deep takes a minute).
MAX_SCHEMA_DEPTH = 128
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's ``StructuredOutputsParams``; ``GuidedDecodingParams``
    is its older name).

    ``json`` takes a schema as a dict, a JSON string or a pydantic model class, and holds
    the schema's JSON text after construction (equal texts compile once).
    ``disable_any_whitespace`` makes JSON compact (no free whitespace between tokens).
    ``disable_fallback`` and ``disable_additional_properties`` are accepted as in vLLM:
    there is one backend (xgrammar), which never falls back, and which already refuses
    properties a schema does not name unless it allows them.
    """

    json: str | dict | Any | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.whitespace_pattern is not None:
            raise ValueError("structured outputs: whitespace_pattern is an outlines option that xgrammar does not "
                             "take; use disable_any_whitespace=True for compact JSON")
        if self.structural_tag is not None:
            raise ValueError("structured outputs: structural_tag is not supported; use json, regex, choice or "
                             "grammar (tool calls: the chat API's tools and tool_choice)")
        for name in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
            check_bool(name, getattr(self, name))
        if self.json is not None:
            self.json = _schema_text(self.json)
        if self.json_object is not None:
            check_bool("json_object", self.json_object)
        self._check_texts()
        if self.choice is not None:
            self.choice = _choices(self.choice)
        chosen = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError("structured outputs need exactly one of json, json_object, regex, choice or grammar, "
                             f"got {chosen or 'none'}")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> tuple:
        """Equal for two params that compile to the same grammar."""
        value = getattr(self, self.kind)
        return self.kind, tuple(value) if isinstance(value, list) else value, self.disable_any_whitespace

    @classmethod
    def from_any(cls, value: StructuredOutputsParams | Mapping | None) -> StructuredOutputsParams | None:
        """Params from themselves or a dict of their fields (as JSON bodies carry them)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"structured_outputs must be StructuredOutputsParams or a dict, got {type(value).__name__}")
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown structured_outputs fields {sorted(unknown)}; use {', '.join(KINDS)}")
        return cls(**value)

    def _check_texts(self) -> None:
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise TypeError(f"structured outputs: {name} must be a non-empty string")
            check_utf8(f"the {name}", value)
            if len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"structured outputs: the {name} has {len(value)} characters, "
                                 f"more than {MAX_SPEC_CHARS}")


GuidedDecodingParams = StructuredOutputsParams


def response_format_fields(response_format: Mapping | None) -> dict | None:
    """OpenAI's ``response_format`` as StructuredOutputsParams fields: {"type": "json_object"}
    -> json_object, {"type": "json_schema", "json_schema": {"schema": ...}} -> json; None for
    {"type": "text"} or no response_format. ValueError for anything else."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise TypeError(f"response_format must be an object such as {{'type': 'json_object'}}, "
                        f"got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), (Mapping, bool)):
            raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        return {"json": spec["schema"]}
    raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


def _schema_text(schema: Any) -> str:
    """A JSON schema as JSON text. Key order is kept: xgrammar writes an object's
    properties in the order its schema lists them."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    elif isinstance(schema, str):
        check_utf8("the JSON schema", schema)
        if len(schema) > MAX_SPEC_CHARS:
            raise ValueError(f"structured outputs: the JSON schema has {len(schema)} characters, "
                             f"more than {MAX_SPEC_CHARS}")
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"structured outputs: the JSON schema is not valid JSON: {error}") from None
        except RecursionError:
            raise ValueError(f"structured outputs: the JSON schema is nested more than {MAX_SCHEMA_DEPTH} "
                             "levels deep") from None
    _check_depth(schema)
    if not isinstance(schema, (Mapping, bool)):
        raise TypeError("structured outputs: json must be a JSON schema (an object), its JSON text, or a "
                        f"pydantic model class, got {type(schema).__name__}")
    schema = enforce_unique_items(schema)
    check_schema(schema)
    text = json.dumps(schema, ensure_ascii=False)
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"structured outputs: the JSON schema has {len(text)} characters, more than {MAX_SPEC_CHARS}")
    return text


def _check_depth(schema: Any) -> None:
    """Refuse a schema nested deeper than MAX_SCHEMA_DEPTH (iteratively: any depth is safe)."""
    pending = [(schema, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"structured outputs: the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        children = value.values() if isinstance(value, Mapping) else value if isinstance(value, list) else ()
        pending.extend((child, depth + 1) for child in children if isinstance(child, (Mapping, list)))


def _choices(choice: Any) -> list[str]:
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
        raise TypeError("structured outputs: choice must be a non-empty list of strings")
    if len(choice) > MAX_CHOICES:
        raise ValueError(f"structured outputs: at most {MAX_CHOICES} choices, got {len(choice)}")
    for option in choice:
        if not isinstance(option, str) or not option:
            raise TypeError("structured outputs: each choice must be a non-empty string")
        check_utf8("a choice", option)
        if len(option) > MAX_SPEC_CHARS:
            raise ValueError(f"structured outputs: a choice may hold at most {MAX_SPEC_CHARS} characters")
    return list(choice)
