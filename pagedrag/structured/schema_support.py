"""Which JSON Schema (draft 2020-12) keywords the grammar backend enforces, checked before
a schema compiles.

Invariant: every constraint keyword of a schema that ``check_schema`` passes is enforced
by xgrammar where it stands, so each output the grammar allows validates against the
schema; any other constraint keyword is a ValueError naming the keyword and its JSON path
(``$.properties.tags``). Keywords that constrain nothing (annotations, identifiers,
formats no validator knows, keywords unknown to 2020-12) pass. The check reads every
schema xgrammar reads: the subschemas at their positions (``subschemas``) and whatever a
local ``$ref`` names, wherever it sits (``schema_nodes``). The unique_items rewrite runs
before it (params._schema_text); what it leaves of uniqueItems is refused. minLength /
maxLength hold JSON's string rules through the compiler (compiler.py: xgrammar's own
bounded strings admit raw control characters). The rules come from
experiments on xgrammar 0.2.9: tests/test_schema_keywords.py holds them, keyword by
keyword; docs/structured_outputs_keywords.md is the table.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from typing import Any

from pagedrag.structured.schema_oneof import locate, overlapping_pair

try:  # Python 3.11+
    from re import _constants as regex_constants, _parser as regex_parser
except ImportError:  # Python 3.10
    import sre_constants as regex_constants
    import sre_parse as regex_parser

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
# Decimal places of the numbers xgrammar writes for a bounded "number" (0 for "integer").
NUMBER_PLACES = {"number": 6, "integer": 0}
# Letters xgrammar reads after a backslash as the letter itself (with only a warning).
LITERAL_ESCAPES = frozenset("ghijlmoqyzACEFGHIJKLMNOQRTUVXYZ")
# Classes xgrammar reads as ASCII: broader than the validator's Unicode ones (Python's re).
ASCII_CLASSES = {"W": "[^a-zA-Z0-9_]", "D": "[^0-9]", "S": "[^ \\t\\n\\r\\f\\v]"}
# Characters a JSON string holds only escaped (code points): a quote, a backslash, controls.
JSON_ESCAPED = frozenset(range(0x20)) | {ord('"'), ord("\\")}


def check_schema(schema: Any) -> None:
    """Raise ValueError for the first constraint of ``schema`` the backend would not enforce."""
    for node, steps, keyword in schema_nodes(schema):
        if keyword == "propertyNames":
            node = {"type": "string", **node}  # it applies to names: strings, whether or not it says so
        _check_node(node, json_path(steps), schema)


def schema_nodes(root: Any) -> Iterator[tuple[Mapping, tuple[str | int, ...], str | None]]:
    """(schema, its steps from ``root``, the keyword it sits under) for each schema object
    xgrammar reads in ``root``: the root, every subschema at its position (``subschemas``),
    and every target of a local ``$ref`` wherever it sits (``#/components/schemas/Pet``),
    its keyword None. Each is given once (once more when it is also read as
    ``propertyNames``, where it describes strings), so recursive refs end."""
    pending: list[tuple[tuple[str | int, ...], Any, str | None]] = [((), root, None)]
    seen: set[tuple[tuple[str | int, ...], bool]] = set()
    while pending:
        steps, node, keyword = pending.pop()
        if not isinstance(node, Mapping) or (steps, keyword == "propertyNames") in seen:
            continue
        seen.add((steps, keyword == "propertyNames"))
        yield node, steps, keyword
        for child_keyword, key, child in subschemas(node):
            pending.append((steps + ((child_keyword,) if key is None else (child_keyword, key)), child, child_keyword))
        target = locate(root, node["$ref"]) if isinstance(node.get("$ref"), str) else None
        if target is not None:
            pending.append((*target, None))


def json_path(steps: tuple[str | int, ...]) -> str:
    """``$.properties.tags``, ``$.anyOf[0]``, ``$['a b']`` for steps from the root."""
    return "$" + "".join(f"[{step}]" if isinstance(step, int) else _key(step) for step in steps)


def _check_node(node: Mapping, path: str, root: Any) -> None:
    for keyword in node:
        if keyword in NEVER and not (keyword == "uniqueItems" and node[keyword] is False):
            raise refused(keyword, path, NEVER[keyword])
    _check_exclusive(node, path)
    _check_typed(node, path)
    _check_strings(node, path)
    _check_number_range(node, path)
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
    return all(any(_has_type(value, kind) for kind in schema_types(node)) for value in values)


def _has_type(value: Any, kind: str) -> bool:
    if kind in ("number", "integer"):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and (kind == "number" or float(value).is_integer())
    expected = JSON_TYPES.get(kind)
    return expected is not None and isinstance(value, expected)


def schema_types(node: Mapping) -> set[str]:
    """The type names a schema's "type" lists (none when it has no type)."""
    kind = node.get("type")
    return {name for name in (kind if isinstance(kind, list) else [kind]) if isinstance(name, str)}


def _check_typed(node: Mapping, path: str) -> None:
    types = schema_types(node)
    if "integer" in types:
        types.add("number")
    for keyword in node:
        needed = TYPED.get(keyword)
        if needed is not None and needed not in types and not _annotation_format(node, keyword):
            raise refused(keyword, path, f'without "type": "{needed}" in the same schema (xgrammar drops it)')


def _annotation_format(node: Mapping, keyword: str) -> bool:
    return keyword == "format" and node["format"] not in ENFORCED_FORMATS | UNENFORCED_FORMATS


def _string_shape(node: Mapping) -> str | None:
    """"format" when ``node`` has a format xgrammar enforces, else "pattern" when it has a
    pattern, else None: xgrammar drops minLength / maxLength beside either (and a pattern
    beside such a format)."""
    return "format" if node.get("format") in ENFORCED_FORMATS else "pattern" if "pattern" in node else None


def _check_strings(node: Mapping, path: str) -> None:
    """A standard format must be one xgrammar has; beside a format or a pattern, xgrammar
    drops minLength / maxLength (and a pattern beside a format); each regex must be one
    xgrammar reads as Python's re does."""
    fmt = node.get("format")
    if fmt in UNENFORCED_FORMATS:
        raise refused("format", path, f"for {fmt!r} (xgrammar accepts any string)")
    shaped_by = _string_shape(node)
    if shaped_by == "format" and "pattern" in node:
        raise refused("pattern", path, "beside 'format' (xgrammar drops it)")
    for keyword in ("minLength", "maxLength"):
        if shaped_by and keyword in node:
            raise refused(keyword, path, f"beside {shaped_by!r} (xgrammar drops it)")
    if isinstance(node.get("pattern"), str):
        check_json_pattern(node["pattern"], f"JSON schema keyword 'pattern' at {path}")
    for pattern in node.get("patternProperties") or ():
        check_json_pattern(pattern, f"JSON schema keyword 'patternProperties' at {path}")


def check_json_pattern(pattern: str, where: str) -> None:
    """``check_regex``, and a ValueError where the pattern, a JSON string's, can write a
    character JSON holds only escaped (a quote, a backslash, a control character): xgrammar
    writes a pattern's literal characters, positive classes and ``\\s`` as they are, which is
    not JSON. (``.`` and negated classes it keeps from writing them: narrower, still valid.)"""
    check_regex(pattern, where)
    character = _unescaped_json_character(pattern)
    if character is not None:
        raise _bad_regex(pattern, where, f"it can match {character!r}, which xgrammar writes unescaped into the "
                                         "JSON string (not JSON); leave quotes, backslashes and control characters "
                                         "out of it (printable ASCII without them: [ !#-\\[\\]-~])")


def _unescaped_json_character(pattern: str) -> str | None:
    """The first character JSON holds only escaped that a literal, a positive class or \\s
    of ``pattern`` matches (as Python's re parses it); None for none, or for a pattern Python
    cannot parse (check_regex has judged xgrammar's reading of it)."""
    try:
        pending = [regex_parser.parse(pattern)]
    except (re.error, RecursionError, OverflowError):
        return None
    while pending:
        for op, argument in pending.pop():
            if op is regex_constants.LITERAL and argument in JSON_ESCAPED:
                return chr(argument)
            if op is regex_constants.IN and argument[:1] != [(regex_constants.NEGATE, None)]:
                found = next(filter(None, map(_escaped_in_class_item, argument)), None)
                if found is not None:
                    return found
            pending.extend(_nested_patterns(argument))
    return None


def _escaped_in_class_item(item: tuple) -> str | None:
    kind, value = item
    if kind is regex_constants.LITERAL:
        return chr(value) if value in JSON_ESCAPED else None
    if kind is regex_constants.RANGE:
        return next((chr(code) for code in sorted(JSON_ESCAPED) if value[0] <= code <= value[1]), None)
    if kind is regex_constants.CATEGORY and value is regex_constants.CATEGORY_SPACE:
        return "\t"
    return None


def _nested_patterns(argument: Any) -> Iterator[Any]:
    """The parsed subpatterns inside a parsed item's argument (a repeat's, a group's, a branch's)."""
    for part in argument if isinstance(argument, (tuple, list)) else ():
        if isinstance(part, regex_parser.SubPattern):
            yield part
        elif isinstance(part, (tuple, list)):
            yield from _nested_patterns(part)


def check_regex(pattern: str, where: str) -> None:
    """ValueError naming the feature (lookahead, lookbehind, backreference, ...) when
    xgrammar's regex dialect cannot take ``pattern``, or an escape xgrammar reads otherwise
    than the validator (Python's re): an unknown letter escape (``\\Z``, ``\\A``, ...),
    which xgrammar matches as the letter itself, or ``\\W`` / ``\\D`` / ``\\S``, which
    xgrammar reads as ASCII classes (they match "é" and Unicode digits and spaces)."""
    import xgrammar
    for letter in _escaped(pattern):
        if letter in LITERAL_ESCAPES:
            anchor = {"A": " (use ^)", "Z": " (use $)"}.get(letter, "")
            raise _bad_regex(pattern, where, f"xgrammar reads the escape '\\{letter}' as the letter {letter!r} "
                                             f"itself{anchor}")
        if letter in ASCII_CLASSES:
            raise _bad_regex(pattern, where, f"xgrammar's '\\{letter}' is ASCII-only, wider than the validator's "
                                             f"Unicode one; write the class out, such as {ASCII_CLASSES[letter]}")
    try:
        xgrammar.Grammar.from_regex(pattern)
    except Exception as error:  # xgrammar raises RuntimeError with the position and the feature
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip().splitlines()[0])
        raise _bad_regex(pattern, where, message) from None


def _bad_regex(pattern: str, where: str, why: str) -> ValueError:
    return ValueError(f"structured outputs: {where}: the regex {pattern!r} is not supported by the grammar "
                      f"backend: {why}")


def _escaped(pattern: str) -> Iterator[str]:
    """The character after each escaping backslash of ``pattern`` (in ``\\\\Z`` the
    second backslash is escaped, so Z is not)."""
    index = pattern.find("\\")
    while 0 <= index < len(pattern) - 1:
        yield pattern[index + 1]
        index = pattern.find("\\", index + 2)


def _check_number_range(node: Mapping, path: str) -> None:
    """Some number xgrammar can write must lie within the bounds: an integer for
    "integer", a decimal of at most 6 places for "number". Where none does, xgrammar's
    grammar for the value is empty text (invalid JSON), so such a range is refused."""
    bounds = _numeric_bounds(node)
    for kind, places in NUMBER_PLACES.items():
        if kind in schema_types(node) and not _range_holds(bounds, places):
            written = ", ".join(f"{keyword} {node[keyword]!r}" for keyword in bounds)
            numbers = "integer" if kind == "integer" else "number of at most 6 decimal places"
            raise refused(next(iter(bounds)), path, f"with {written}: no {numbers} lies in that range (xgrammar "
                          f"writes only such {kind}s, so its grammar would be empty, which is not JSON)")


def _numeric_bounds(node: Mapping) -> dict[str, Decimal]:
    """The finite number bounds of ``node``, lower ones first, as Decimals of their JSON text."""
    bounds = {}
    for keyword in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        value = node.get(keyword)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and Decimal(repr(value)).is_finite():
            bounds[keyword] = Decimal(repr(value))
    return bounds


def _range_holds(bounds: dict[str, Decimal], places: int) -> bool:
    """Whether a multiple of 10**-places lies within ``bounds``: the least such multiple
    that every lower bound allows is allowed by every upper bound."""
    step = Decimal(1).scaleb(-places)
    with localcontext() as context:
        context.prec = 5000  # exact: more digits than any number json.loads reads (ints stop at 4300)
        lowest = []
        if "minimum" in bounds:
            lowest.append((bounds["minimum"] / step).to_integral_value(ROUND_CEILING))
        if "exclusiveMinimum" in bounds:
            lowest.append((bounds["exclusiveMinimum"] / step).to_integral_value(ROUND_FLOOR) + 1)
        if not lowest:
            return True
        least = max(lowest) * step
        return least <= bounds.get("maximum", least) and ("exclusiveMaximum" not in bounds
                                                          or least < bounds["exclusiveMaximum"])


def _check_multiple_of(node: Mapping, path: str) -> None:
    """xgrammar enforces multipleOf on integers by an integer only."""
    if "multipleOf" not in node:
        return
    value = node["multipleOf"]
    if "number" in schema_types(node) or not isinstance(value, int) or isinstance(value, bool):
        raise refused("multipleOf", path, 'except an integer multipleOf on "type": "integer"')


def _check_objects(node: Mapping, path: str) -> None:
    """Every required name must be a named property (xgrammar makes only those mandatory),
    patternProperties must not cover a named property, and propertyNames applies only
    where no property is named or patterned (xgrammar checks neither of those)."""
    properties = node.get("properties") if isinstance(node.get("properties"), Mapping) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    unnamed = next((name for name in required if not isinstance(name, str) or name not in properties), None)
    if unnamed is not None:
        raise refused("required", path, f"naming {unnamed!r}, which is not in 'properties' (xgrammar does not make "
                      "it mandatory; add it to properties)")
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


def map_subschemas(node: Mapping, rewrite: Callable[[str, Any], Any]) -> dict:
    """A copy of ``node`` with each of its subschemas (``subschemas``) replaced by
    ``rewrite(keyword, subschema)``. ``node`` is left unchanged: each mapping or list
    holding a subschema is copied."""
    result = dict(node)
    for keyword, key, child in subschemas(node):
        if key is None:
            result[keyword] = rewrite(keyword, child)
            continue
        if result[keyword] is node[keyword]:  # properties, anyOf, ...: copied before its first child changes
            result[keyword] = dict(node[keyword]) if isinstance(node[keyword], Mapping) else list(node[keyword])
        result[keyword][key] = rewrite(keyword, child)
    return result


def _key(name: str) -> str:
    return f".{name}" if re.fullmatch(r"[A-Za-z_$][\w$-]*", name) else f"[{name!r}]"
