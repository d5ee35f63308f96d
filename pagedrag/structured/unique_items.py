"""``uniqueItems: true`` over a small enum, enforced by rewriting the array's schema into the
distinct sequences it allows.

xgrammar ignores ``uniqueItems`` (an array of ``{"enum": ["a", "b", "c"]}`` repeated ``"a"``
until max_tokens). An array whose items are one of a few values has few distinct sequences:
``{"type": "array", "items": {"enum": [a, b, c]}, "uniqueItems": true}`` becomes an ``anyOf``
of one exact-length array per ordered selection of distinct values (``[]``, ``[a]``, ...,
``[c, b, a]``: 16 for three values), each written with ``prefixItems`` of ``const`` s, which
xgrammar enforces. ``minItems`` / ``maxItems`` keep the lengths they allow.

Invariant: a rewritten schema accepts the arrays the original accepts (distinct items, each
one of the values, within the length bounds), written with each value as the enum lists it
(of values JSON counts as equal, such as 1 and 1.0, the first: json_values.value_key).
The walk goes only to subschemas at their positions (schema_support's ``subschemas``):
data (the values of ``enum``, ``const``, ``default``, ``examples``) is never rewritten, and
a property named ``default`` or ``enum`` is a schema like any other. A ``uniqueItems: true``
that is not of that form, or that only a ``$ref`` reaches (``#/components/...``), is left
alone, and schema_support refuses it by name.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from pagedrag.structured.json_values import is_count, value_key
from pagedrag.structured.schema_support import map_subschemas

MAX_UNIQUE_VALUES = 5  # 326 sequences: the grammar stays small and compiles in milliseconds
ARRAY_KEYWORDS = frozenset({"type", "items", "uniqueItems", "minItems", "maxItems"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated",
                         "readOnly", "writeOnly"})


def enforce_unique_items(schema: Any) -> Any:
    """``schema`` with every ``uniqueItems: true`` array of at most MAX_UNIQUE_VALUES enum or
    const values at a schema position rewritten into its distinct sequences; everything else
    as it was. ``schema`` itself is left unchanged: each mapping or list on the way is copied."""
    if not isinstance(schema, Mapping):
        return schema
    rewritten = _sequences(schema)
    if rewritten is not None:
        return rewritten
    return map_subschemas(schema, lambda keyword, child: enforce_unique_items(child))


def _sequences(node: Mapping) -> dict | None:
    """The anyOf of distinct sequences ``node`` allows, or None when it is not a uniqueItems
    array of a small enum."""
    if node.get("uniqueItems") is not True or node.get("type") != "array":
        return None
    if not set(node) <= ARRAY_KEYWORDS | ANNOTATIONS:
        return None
    values = _values(node.get("items"))
    lowest, highest = node.get("minItems", 0), node.get("maxItems", len(values or ()))
    if values is None or not is_count(lowest) or not is_count(highest):
        return None
    branches = [{"type": "array", "prefixItems": [{"const": value} for value in chosen], "items": False,
                 "minItems": length, "maxItems": length}
                for length in range(lowest, min(highest, len(values)) + 1)
                for chosen in itertools.permutations(values, length)]
    annotations = {key: value for key, value in node.items() if key in ANNOTATIONS}
    # No branch (minItems above the number of values): nothing validates, as in the original.
    return {**annotations, "anyOf": branches} if branches else {**annotations, "enum": []}


def _values(items: Any) -> list | None:
    """The distinct values an ``items`` schema of only enum / const (and a type they all have)
    allows, when there are at most MAX_UNIQUE_VALUES of them."""
    if not isinstance(items, Mapping) or not set(items) <= {"enum", "const", "type"} | ANNOTATIONS:
        return None
    if "const" in items and "enum" not in items:
        values = [items["const"]]
    elif "enum" in items and "const" not in items and isinstance(items["enum"], list):
        values = items["enum"]
    else:
        return None
    if "type" in items and not all(_json_type(value) == items["type"] for value in values):
        return None
    distinct: dict[str, Any] = {}
    for value in values:
        distinct.setdefault(value_key(value), value)
    return list(distinct.values()) if len(distinct) <= MAX_UNIQUE_VALUES else None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "")

