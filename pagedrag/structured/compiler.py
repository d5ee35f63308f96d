"""Compile output constraints into grammars, with xgrammar, once per constraint.

One ``GrammarCompiler`` serves one tokenizer (the vocabulary the masks are over). It is
thread-safe and shared by every InputProcessor copy of an engine, so a constraint
compiled while a request is checked (on any thread) is a cache hit when the engine
makes the request's matcher. The tokenizer's vocabulary is read on first use (a
quarter of a second for 50k tokens), not at engine start.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict

from pagedrag.structured.params import StructuredOutputsParams
from pagedrag.text_checks import check_utf8

CACHE_ENTRIES = 512  # compiled grammars kept, least recently used first out
# JSON may hold free whitespace between tokens (as vLLM's default), but at most this many
# characters in a row: enough for pretty-printed JSON nested eight deep, and small models
# can no longer fill max_tokens with newlines.
MAX_JSON_WHITESPACE = 16
ANY_OBJECT = '{"type": "object"}'
# xgrammar 0.2.9's rule for one character of a length-bounded string, as it prints it, and
# the character JSON holds unescaped that replaces it (compiler.json_grammar)
BOUNDED_STRING_CHARACTER = re.compile(r'^(\S+ ::= )\(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
JSON_STRING_CHARACTER = r'(([^\0-\x1f\"\\]))'


class GrammarCompiler:
    """``compile(params)`` -> xgrammar CompiledGrammar; ``matcher(params)`` -> a fresh
    GrammarMatcher. A constraint xgrammar cannot take is a ValueError naming it.

    ``stop_token_ids`` end a completed grammar (the model's EOS tokens): once the output
    is complete, only they are allowed.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._special_token_ids: frozenset[int] = frozenset()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self.num_compiled = 0
        self.compile_seconds = 0.0

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Tokens no grammar of this compiler accepts: xgrammar refuses a special token, and
        writes a warning to stderr for every one it is asked to accept (speculative drafts
        copied from a chat transcript hold them)."""
        if self._compiler is None:
            self._xgrammar_compiler()
        return self._special_token_ids

    def matcher(self, params: StructuredOutputsParams):
        import xgrammar
        return xgrammar.GrammarMatcher(self.compile(params))

    def compile(self, params: StructuredOutputsParams):
        key = params.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        started = time.perf_counter()
        compiled = self._compile(params)
        _check_accepts_something(compiled, params, self._vocab_size)
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += time.perf_counter() - started
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._xgrammar_compiler()
        kind = params.kind
        try:
            if kind == "json":
                return compiler.compile_grammar(json_grammar(params.json, not params.disable_any_whitespace))
            if kind == "json_object":  # an object, as OpenAI and vLLM mean it (not any JSON value)
                return compiler.compile_json_schema(ANY_OBJECT, any_whitespace=not params.disable_any_whitespace,
                                                    max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            if "::=" in params.grammar:
                return compiler.compile_grammar(params.grammar)
            return compiler.compile_lark(params.grammar)
        except Exception as error:  # xgrammar raises RuntimeError / its own types for bad input
            raise ValueError(f"structured outputs: the {_kind_name(params)} cannot be compiled: "
                             f"{_first_line(error)}") from None

    def _xgrammar_compiler(self):
        if self._tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        with self._lock:
            if self._compiler is None:
                import xgrammar
                info = tokenizer_info(self._tokenizer, self._vocab_size, self._stop_token_ids)
                self._special_token_ids = frozenset(info.special_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the vocabulary, in which the tokenizer's special tokens (its added
    tokens marked special, but the stop tokens) are never allowed, as xgrammar treats a token
    whose text is empty. xgrammar alone reads <|im_start|> as text a JSON string may hold, and
    the detokenizer then drops it, so the output's text would not be what the grammar accepted
    (a minLength short, a pattern broken). Where the vocabulary rebuilt that way would read any
    other token otherwise than xgrammar's own reading, that reading is kept."""
    import xgrammar
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    special = {index for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
               if token.special and index < vocab_size} - set(stop_token_ids)
    if not special:
        return info
    encoded = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in special:
            encoded[index] = token
    narrowed = xgrammar.TokenizerInfo.from_vocab_and_metadata(encoded, info.dump_metadata())
    ours, theirs = narrowed.decoded_vocab, info.decoded_vocab
    if any(ours[index] != theirs[index] for index in range(vocab_size) if index not in special):
        return info
    return narrowed


def json_grammar(schema: str, any_whitespace: bool) -> str:
    """xgrammar's EBNF grammar for a JSON schema, with the character of its length-bounded
    strings narrowed to what JSON holds unescaped.

    xgrammar writes ``minLength`` / ``maxLength`` as a rule of one character
    ``[^"\\\r\n]`` repeated m to n times, which admits raw control characters (a tab,
    \x01, ESC): text that is not JSON. Each such rule here excludes every control
    character (U+0000-U+001F), as xgrammar's unbounded strings do; quotes and backslashes
    stay out, so the string's characters are its raw text and the bound counts them.
    """
    import xgrammar
    grammar = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=any_whitespace,
                                                   max_whitespace_cnt=MAX_JSON_WHITESPACE))
    return BOUNDED_STRING_CHARACTER.sub(lambda rule: rule[1] + JSON_STRING_CHARACTER, grammar)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON string escapes are
    EBNF string escapes). Characters past ASCII stay themselves: an escaped one outside
    the BMP would be two surrogate escapes, which xgrammar reads as two characters (bytes
    no UTF-8 text holds). A lone surrogate is a ValueError: no UTF-8 text holds it."""
    for choice in choices:
        check_utf8("a choice", choice)
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _check_accepts_something(compiled, params: StructuredOutputsParams, vocab_size: int) -> None:
    """ValueError for a grammar no token can start (``root ::= root``): its requests could not
    write a first token. One mask at the start, a fraction of a millisecond, once a constraint."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    if not bitmask.any():
        raise ValueError(f"structured outputs: the {_kind_name(params)} accepts no output (no token can start it)")


def _kind_name(params: StructuredOutputsParams) -> str:
    return {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[params.kind]


def _first_line(error: Exception) -> str:
    """The error's message, without xgrammar's "[time] source.cc:line: " prefix."""
    text = str(error).strip() or type(error).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:500]
