"""``speculative_config``: vLLM's keys for the ``ngram`` and ``suffix`` methods, validated by name.

``disable_by_batch_size`` (vLLM's key too) stops drafting while more requests run. A key of
another method (a draft model, EAGLE, MTP) or a misspelt one is refused with a ValueError
that names it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix")
# Above this many running requests nobody drafts: a verification row costs 1 + k tokens of
# compute, which a large batch no longer hides behind its weight reads. Measured (RESULTS.md,
# "Speculative decoding"): on 2 CPU cores drafting paid at every concurrency up to 8 (1.07-1.54x,
# no break-even found); on the H200 at 32 concurrent requests it paid at the prompt-and-output
# acceptance profile (1.17-1.22x) and lost at the prompt-only one (0.87-0.90x). 8 is inside
# the range measured to pay on both.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# The longest n-gram ngram looks up: its index keeps prompt_lookup_max - prompt_lookup_min + 1
# n-grams of up to prompt_lookup_max tokens for every token of a request, so memory grows with
# the square of it (a limit of 10**9 made a 1,500-token request's index 1.6 GB).
MAX_PROMPT_LOOKUP = 16
_COMMON_KEYS = {"method", "num_speculative_tokens", "disable_by_batch_size"}
_METHOD_KEYS = {
    "ngram": {"prompt_lookup_min", "prompt_lookup_max"},
    "suffix": {"suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"},
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """A validated speculative_config. ``num_speculative_tokens`` is the most tokens drafted
    for a row in one step (k); ngram matches suffixes of ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens; suffix's keys mean what they mean in vLLM (spec_decode.suffix)."""

    method: str
    num_speculative_tokens: int
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def parse(cls, value: dict | str) -> SpeculativeConfig:
        """From a dict or its JSON text (``pagedrag serve --speculative-config``)."""
        if isinstance(value, str):
            value = loads(value)
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or JSON object), got {type(value).__name__}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {method!r}")
        unknown = sorted(set(value) - _COMMON_KEYS - _METHOD_KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown} for method {method!r}")
        if method == "ngram" and "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: method 'ngram' needs num_speculative_tokens")
        _check_types(value)
        settings = dict(value)  # suffix drafts up to its tree depth by default, as in vLLM
        settings.setdefault("num_speculative_tokens", value.get("suffix_decoding_max_tree_depth", 24))
        config = cls(**settings)
        config._validate()
        return config

    def _validate(self) -> None:
        checks = [  # the tree depth first: num_speculative_tokens defaults to it
            (self.suffix_decoding_max_tree_depth >= 1, "suffix_decoding_max_tree_depth must be at least 1"),
            (self.num_speculative_tokens >= 1, "num_speculative_tokens must be at least 1"),
            (self.disable_by_batch_size >= 1, "disable_by_batch_size must be at least 1"),
            (1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max"),
            (self.prompt_lookup_max <= MAX_PROMPT_LOOKUP,
             f"prompt_lookup_max must be at most {MAX_PROMPT_LOOKUP} (its index grows with its square), "
             f"got {self.prompt_lookup_max}"),
            (self.suffix_decoding_max_cached_requests >= 0, "suffix_decoding_max_cached_requests must be >= 0"),
            (0 < self.suffix_decoding_max_spec_factor < math.inf,
             f"suffix_decoding_max_spec_factor must be a positive, finite number, got {self.suffix_decoding_max_spec_factor}"),
            (0 <= self.suffix_decoding_min_token_prob <= 1, "suffix_decoding_min_token_prob must be in [0, 1]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"speculative_config: {message}")


def loads(text: str):
    """speculative_config's JSON text, parsed; a ValueError that names it otherwise."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"speculative_config is not valid JSON ({error}): {text!r}") from None


def _check_types(value: dict) -> None:
    """Every number given is an int (or, for a float field, an int or a float); never a bool."""
    types = {item.name: item.type for item in fields(SpeculativeConfig)}
    for name, given in value.items():
        wanted = (int, float) if types[name] == "float" else int
        if name != "method" and (isinstance(given, bool) or not isinstance(given, wanted)):
            raise ValueError(f"speculative_config: {name} must be a number ({types[name]}), got {given!r}")
