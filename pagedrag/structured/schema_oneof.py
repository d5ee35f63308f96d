"""Whether a ``oneOf``'s branches can both match one value, as far as a static look sees.

The grammar backend enforces ``oneOf`` as ``anyOf`` (a value of two branches passes), so
``oneOf`` holds only where no value matches two branches. Two branches are known disjoint
when their ``type`` sets do not meet, their ``const`` / ``enum`` values do not meet, or
both are objects only (``"type": "object"``) and require one property whose ``const`` /
``enum`` values do not meet (a discriminated union, as pydantic writes it). Anything else may
overlap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from pagedrag.structured.json_values import value_key


def overlapping_pair(branches: list, root: Any) -> tuple[int, int] | None:
    """The first (i, j) of ``branches`` not known to be disjoint; None when all are."""
    resolved = [resolve(branch, root) for branch in branches]
    for i in range(len(resolved)):
        for j in range(i + 1, len(resolved)):
            if not _disjoint(resolved[i], resolved[j], root):
                return i, j
    return None


def resolve(schema: Any, root: Any) -> Any:
    """``schema`` with local ``$ref`` pointers (``#/...``) followed; a ref that does not
    resolve is left as it is (compiling it fails)."""
    seen = 0
    while isinstance(schema, Mapping) and isinstance(schema.get("$ref"), str) and seen < 64:
        target = pointer(root, schema["$ref"])
        if target is None:
            return schema
        schema, seen = target, seen + 1
    return schema


def pointer(root: Any, ref: str) -> Any:
    """The value a local JSON pointer ``ref`` ("#" or "#/...") names in ``root``; None when
    it names none."""
    found = locate(root, ref)
    return None if found is None else found[1]


def locate(root: Any, ref: str) -> tuple[tuple[str | int, ...], Any] | None:
    """(its steps from ``root``, the value) for a local JSON pointer ``ref``, as xgrammar
    reads it: a URI fragment, so percent-escapes are decoded first ("%20" is a space), then
    "~1" is "/", "~0" is "~", and a step into a list is an index (a step an int). None when
    ``ref`` is not local or names nothing."""
    if ref == "#":
        return (), root
    if not ref.startswith("#/"):
        return None
    node, steps = root, []
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            step = int(part)
        elif isinstance(node, Mapping) and part in node:
            step = part
        else:
            return None
        node = node[step]
        steps.append(step)
    return tuple(steps), node


def _disjoint(a: Any, b: Any, root: Any) -> bool:
    if not isinstance(a, Mapping) or not isinstance(b, Mapping):
        return False
    return _types_disjoint(a, b) or _values_disjoint(a, b) or _discriminated(a, b, root)


def _types_disjoint(a: Mapping, b: Mapping) -> bool:
    ta, tb = _types(a), _types(b)
    return ta is not None and tb is not None and not ta & tb


def _types(schema: Mapping) -> set[str] | None:
    """The JSON types a schema's ``type`` allows ("integer" also counts as "number")."""
    kind = schema.get("type")
    if kind is None:
        return None
    kinds = {name for name in (kind if isinstance(kind, list) else [kind]) if isinstance(name, str)}
    return kinds | {"number"} if "integer" in kinds else kinds


def _values(schema: Mapping) -> set[str] | None:
    """The values a const / enum allows, as ``value_key`` s (1 and 1.0 are one value)."""
    if "const" in schema:
        return {value_key(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {value_key(value) for value in schema["enum"]}
    return None


def _values_disjoint(a: Mapping, b: Mapping) -> bool:
    va, vb = _values(a), _values(b)
    return va is not None and vb is not None and not va & vb


def _discriminated(a: Mapping, b: Mapping, root: Any) -> bool:
    """Both are objects only (a nullable one also matches null, where "required" holds
    vacuously) and require a property whose const / enum values do not meet."""
    if _types(a) != {"object"} or _types(b) != {"object"}:
        return False
    for name in _required(a) & _required(b):
        pa, pb = resolve(_property(a, name), root), resolve(_property(b, name), root)
        if isinstance(pa, Mapping) and isinstance(pb, Mapping) and _values_disjoint(pa, pb):
            return True
    return False


def _required(schema: Mapping) -> set[str]:
    names = schema.get("required")
    return {name for name in names if isinstance(name, str)} if isinstance(names, list) else set()


def _property(schema: Mapping, name: str) -> Any:
    properties = schema.get("properties")
    return properties.get(name) if isinstance(properties, Mapping) else None
