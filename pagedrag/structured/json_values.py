"""JSON values compared as JSON Schema compares them (``const``, ``enum``, ``uniqueItems``).

Invariant: ``value_key(a) == value_key(b)`` exactly when JSON Schema counts ``a`` and ``b``
as equal: numbers by value (1 and 1.0 are equal), objects whatever their key order;
booleans are never numbers (``true`` is not ``1``).
"""

from __future__ import annotations

import json
from typing import Any


def canonical(value: Any) -> Any:
    """``value`` with integral floats as integers: JSON Schema counts 1 and 1.0 as equal."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [canonical(item) for item in value]
    if isinstance(value, dict):
        return {key: canonical(item) for key, item in value.items()}
    return value


def value_key(value: Any) -> str:
    """A text equal for two values exactly when JSON Schema counts them as equal."""
    return json.dumps(canonical(value), sort_keys=True)


def is_count(value: Any) -> bool:
    """A non-negative integer (never a bool), as minItems, maxLength and the like take."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
