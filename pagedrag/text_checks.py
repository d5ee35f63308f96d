"""Checks every value a request carries goes through before it can reach a step."""

from __future__ import annotations

import math
from numbers import Integral, Real


class InvalidUTF8(ValueError):
    """Text that is not valid UTF-8; ``where`` names it (a field, or a path into one). Made
    from a message alone too, as callers that prefix a ValueError's message remake it."""

    def __init__(self, message: str, where: str = ""):
        super().__init__(message)
        self.where = where


def check_utf8(name: str, text: str) -> None:
    """Refuse text that cannot be encoded as UTF-8 (a lone surrogate, e.g. from a JSON
    escape like "\\ud800"): hashing, tokenizing or echoing it would fail later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidUTF8(f"{name} is not valid UTF-8 text: a lone surrogate "
                          f"{text[error.start]!r} at character {error.start}", where=name) from None


def check_utf8_within(value: object, path: str) -> None:
    """Refuse any string, key or value, at any depth of lists and dicts, that is not valid
    UTF-8 (check_utf8, naming where it is). Iterative: nesting as deep as a JSON parser allows
    never exhausts the stack."""
    pending = [(value, path)]
    while pending:
        item, where = pending.pop()
        if isinstance(item, str):
            check_utf8(where, item)
        elif isinstance(item, dict):
            for key, inner in item.items():
                pending.append((key, f"a key of {where}"))
                pending.append((inner, f"{where}.{key}" if isinstance(key, str) else where))
        elif isinstance(item, (list, tuple)):
            pending.extend((inner, f"{where}[{index}]") for index, inner in enumerate(item))


def check_int(name: str, value: object) -> int:
    """An int (a numpy integer becomes one), never a bool (True is an int to Python, not to a
    JSON client)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def check_float(name: str, value: object) -> float:
    """A finite real number (int or float, never a bool)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {type(value).__name__} {value!r}")
    return value
