"""Which JSON Schema (draft 2020-12) keywords the grammar backend enforces, checked before
a schema compiles.

Invariant: every constraint keyword of a schema that ``check_schema`` passes is enforced
by xgrammar where it stands, so each output the grammar allows validates against the
schema; any other constraint keyword is a ValueError naming the keyword and its JSON path
(``$.properties.tags``). Keywords that constrain nothing (annotations, identifiers,
formats no validator knows, keywords unknown to 2020-12) pass. The rules come from
experiments on xgrammar 0.2.9: tests/test_schema_keywords.py holds them, keyword by
keyword; docs/structured_outputs_keywords.md is the table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pagedrag.structured.schema_oneof import overlapping_pair

# Constraints the backend never enforces (it ignores them), with why they are refused.
NEVER = {
    "uniqueItems": "(xgrammar ignores it; pagedrag enforces it on an array of an enum or const of at most "
                   "5 values, with only minItems / maxItems beside: pagedrag.structured.unique_items)",
    "contains": "", "minContains": "", "maxContains": "", "not": "", "if": "",
    "dependentRequired": "", "dependentSchemas": "", "dependencies": "",
    "$dynamicRef": "", "$recursiveRef": "",
}
# Constraints that hold only on values of one JSON type: xgrammar drops them unless the
# schema's "type" names that type ("integer" counts for "number").
TYPED = {
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), "number"),
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), "string"),
    **dict.fromkeys(("items", "prefixItems", "additionalItems", "unevaluatedItems", "minItems", "maxItems"),
                    "array"),
    **dict.fromkeys(("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                     "minProperties", "maxProperties", "unevaluatedProperties"), "object"),
}
CONSTRAINTS = frozenset(NEVER) | frozenset(TYPED) | {"type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf"}
# Keywords beside which xgrammar drops every other constraint of the same schema.
EXCLUSIVE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
ENFORCED_FORMATS = frozenset({
    "date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
    "uri-template", "uuid", "json-pointer", "relative-json-pointer"})
UNENFORCED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})
JSON_TYPES = {"null": type(None), "boolean": bool, "object": Mapping, "array": list, "string": str}


def check_schema(schema: Any) -> None:
    """Raise ValueError for the first constraint of ``schema`` the backend would not enforce."""
    pending = [(schema, "$")]
    while pending:
        node, path = pending.pop()
        if isinstance(node, Mapping):
            _check_node(node, path, schema)
            pending.extend(_subschemas(node, path))


def _check_node(node: Mapping, path: str, root: Any) -> None:
    for keyword in node:
        if keyword in NEVER and not (keyword == "uniqueItems" and node[keyword] is False):
            raise refused(keyword, path, NEVER[keyword])
    _check_exclusive(node, path)
    _check_typed(node, path)
    _check_strings(node, path)
    _check_multiple_of(node, path)
    _check_objects(node, path)
    _check_identifiers(node, path)
    _check_combinators(node, path, root)


def refused(keyword: str, path: str, why: str = "") -> ValueError:
    return ValueError(f"structured outputs: JSON schema keyword {keyword!r} at {path} is not enforced by the "
                      f"grammar backend{' ' + why if why else ''}")


def _check_exclusive(node: Mapping, path: str) -> None:
    """$ref, const, enum, anyOf, oneOf and allOf stand alone: xgrammar drops their siblings
    (a "type" that every const / enum value has is redundant, hence fine)."""
    primary = next((keyword for keyword in EXCLUSIVE if keyword in node), None)
    if primary is None:
        return
    for keyword in node:
        if keyword == primary or keyword not in CONSTRAINTS:
            continue
        if keyword == "type" and primary in ("const", "enum") and _values_have_type(node, primary):
            continue
        raise refused(keyword, path, f"beside {primary!r} (xgrammar drops it; move it into {primary!r})")


def _values_have_type(node: Mapping, primary: str) -> bool:
    values = [node["const"]] if primary == "const" else node["enum"] if isinstance(node["enum"], list) else []
    return all(any(_has_type(value, kind) for kind in _types(node)) for value in values)


def _has_type(value: Any, kind: str) -> bool:
    if kind in ("number", "integer"):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and (kind == "number" or float(value).is_integer())
    expected = JSON_TYPES.get(kind)
    return expected is not None and isinstance(value, expected)


def _types(node: Mapping) -> set[str]:
    kind = node.get("type")
    return {name for name in (kind if isinstance(kind, list) else [kind]) if isinstance(name, str)}


def _check_typed(node: Mapping, path: str) -> None:
    types = _types(node)
    if "integer" in types:
        types.add("number")
    for keyword in node:
        needed = TYPED.get(keyword)
        if needed is not None and needed not in types and not _annotation_format(node, keyword):
            raise refused(keyword, path, f'without "type": "{needed}" in the same schema (xgrammar drops it)')


def _annotation_format(node: Mapping, keyword: str) -> bool:
    return keyword == "format" and node["format"] not in ENFORCED_FORMATS | UNENFORCED_FORMATS


def _check_strings(node: Mapping, path: str) -> None:
    """A standard format must be one xgrammar has; beside a format or a pattern, xgrammar
    drops minLength / maxLength (and a pattern beside a format); each regex must parse."""
    fmt = node.get("format")
    if fmt in UNENFORCED_FORMATS:
        raise refused("format", path, f"for {fmt!r} (xgrammar accepts any string)")
    shaped_by = "format" if fmt in ENFORCED_FORMATS else "pattern" if "pattern" in node else None
    for keyword in ("minLength", "maxLength", "pattern"):
        if shaped_by and keyword in node and keyword != shaped_by:
            raise refused(keyword, path, f"beside {shaped_by!r} (xgrammar drops it)")
    if isinstance(node.get("pattern"), str):
        check_regex(node["pattern"], f"JSON schema keyword 'pattern' at {path}")
    for pattern in node.get("patternProperties") or ():
        check_regex(pattern, f"JSON schema keyword 'patternProperties' at {path}")


def check_regex(pattern: str, where: str) -> None:
    """ValueError naming the feature (lookahead, lookbehind, backreference, ...) when
    xgrammar's regex dialect cannot take ``pattern``."""
    import xgrammar
    try:
        xgrammar.Grammar.from_regex(pattern)
    except Exception as error:  # xgrammar raises RuntimeError with the position and the feature
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip().splitlines()[0])
        raise ValueError(f"structured outputs: {where}: the regex {pattern!r} is not supported by the "
                         f"grammar backend: {message}") from None


def _check_multiple_of(node: Mapping, path: str) -> None:
    """xgrammar enforces multipleOf on integers by an integer only."""
    if "multipleOf" not in node:
        return
    value = node["multipleOf"]
    if "number" in _types(node) or not isinstance(value, int) or isinstance(value, bool):
        raise refused("multipleOf", path, 'except an integer multipleOf on "type": "integer"')


def _check_objects(node: Mapping, path: str) -> None:
    """patternProperties must not cover a named property, and propertyNames applies only
    where no property is named or patterned (xgrammar checks neither of those)."""
    properties = node.get("properties") if isinstance(node.get("properties"), Mapping) else {}
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), Mapping) else {}
    for pattern in patterns:
        name = next((name for name in properties if _search(pattern, name)), None)
        if name is not None:
            raise refused("patternProperties", path, f"where it matches the named property {name!r}")
    if "propertyNames" in node and (properties or patterns):
        raise refused("propertyNames", path, "beside properties or patternProperties (xgrammar skips their names)")


def _search(pattern: str, name: str) -> bool:
    """JSON Schema's pattern semantics (a match anywhere), by Python's close dialect; a
    pattern Python cannot read counts as matching (refusing is the safe side)."""
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True


def _check_identifiers(node: Mapping, path: str) -> None:
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        raise refused("$ref", path, "other than a local JSON pointer (#/...): anchors and URIs are not resolved")
    if "$id" in node and path != "$":
        raise refused("$id", path, "below the root (it would move where $ref resolves)")


def _check_combinators(node: Mapping, path: str, root: Any) -> None:
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise refused("allOf", path, "with more than one schema (xgrammar keeps none of them)")
    one_of = node.get("oneOf")
    pair = overlapping_pair(one_of, root) if isinstance(one_of, list) else None
    if pair is not None:
        raise refused("oneOf", path, f"where branches {pair[0]} and {pair[1]} may both match (xgrammar enforces "
                      "anyOf); make them disjoint by type, const / enum or a required const property, or use anyOf")


def subschemas(node: Mapping) -> list[tuple[str, str | int | None, Any]]:
    """(keyword, key, subschema) for each subschema directly in ``node`` that the backend reads:
    ``node[keyword][key]`` (key a property name or pattern, a $defs name, or a list index), or
    ``node[keyword]`` where key is None. Nothing else is a schema position: the values of enum,
    const, default and examples are data, a name under properties is never a keyword, and the
    subschemas of keywords refused by name (not, if, contains, ...) never reach the backend."""
    found: list[tuple[str, str | int | None, Any]] = []
    for keyword in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(node.get(keyword), Mapping):
            found += [(keyword, name, child) for name, child in node[keyword].items()]
    for keyword in ("prefixItems", "anyOf", "oneOf", "allOf"):
        if isinstance(node.get(keyword), list):
            found += [(keyword, i, child) for i, child in enumerate(node[keyword])]
    for keyword in ("items", "additionalItems", "unevaluatedItems", "additionalProperties",
                    "unevaluatedProperties", "propertyNames"):
        if keyword in node:
            found.append((keyword, None, node[keyword]))
    return found


def _subschemas(node: Mapping, path: str) -> list[tuple[Any, str]]:
    """(subschema, its path) for every place the walk goes on from ``node``."""
    found = []
    for keyword, key, child in subschemas(node):
        step = "" if key is None else f"[{key}]" if isinstance(key, int) else _key(key)
        if keyword == "propertyNames" and isinstance(child, Mapping):
            child = {"type": "string", **child}  # it applies to names: strings, whether or not it says so
        found.append((child, f"{path}.{keyword}{step}"))
    return found


def _key(name: str) -> str:
    return f".{name}" if re.fullmatch(r"[A-Za-z_$][\w$-]*", name) else f"[{name!r}]"
