"""The prefix-miss explainer: where two prompts' token streams part, and why.

The prefix cache hits whole blocks of ``block_size`` tokens, chained from the first one,
so a prompt reuses an earlier prompt's blocks up to the first token where the two differ.
``explain`` finds that token, the block it falls in, the text around it, and a likely
cause; ``explain_against_engine`` does the same against what an engine has cached.
``add_arguments`` and ``run`` are the hooks of ``pagedrag explain``.

Block sizes come from the engine: ``explain_against_engine`` reads the engine's own
configuration, ``explain`` and the CLI default to ``EngineArgs().block_size``.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pagedrag.rag.canonical import CachedPrefixSource, detect_volatile
from pagedrag.config import EngineArgs
from pagedrag.core.kv_cache_manager import POOL
from pagedrag.rag.tokenizer import load_tokenizer
from pagedrag.text_checks import check_utf8

_WINDOW = 20  # characters of context shown on each side of the divergence
_SNIPPET = 32  # characters after the divergence looked for elsewhere (reordering)
_MAX_INSERTION = 160  # longer insertions are chunks moved or added, not a volatile field
_MIN_SNIPPET = 12  # shorter snippets say too little to call it a reordering
_TIME_KINDS = {"timestamp", "date", "time"}

ADVICE = {
    "none": "every full block is reused",
    "extension": "one prompt continues the other, so every shared full block hits",
    "timestamp": "a timestamp or date changes between requests; move it after the retrieved chunks "
                 "(the canonicalizer's volatile fields)",
    "id": "an id (uuid, hex or number) changes between requests; move it after the retrieved chunks "
          "(the canonicalizer's volatile fields)",
    "reordered": "the text here appears elsewhere in the other prompt: the retrieved chunks come in a "
                 "different order (or one was added or removed); put them in canonical order (order='stable')",
    "whitespace": "the prompts differ only in whitespace here; normalize whitespace "
                  "(the canonicalizer strips it at chunk boundaries)",
    "tokenization": "the text is the same but its tokens differ: it was tokenized in pieces or with "
                    "different special tokens; tokenize the whole prompt at once",
    "content": "the prompts have different content here",
    "uncached": "the engine holds no block from here on: it has not seen this text after this point, or "
                "evicted it; compare with the earlier prompt (explain(prompt, reference)) to see what changed",
}
"""Every cause an explanation can give, with what to do about it."""


class ConfiguredEngine(CachedPrefixSource, Protocol):
    """An engine that says what it caches, where and how: ``LLMEngine`` (``LLM.llm_engine``)."""

    args: EngineArgs

    def cached_prefix(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> dict[str, int]:
        """The leading tokens it would not compute, by where their blocks are ("pool", a KV tier)."""


def default_block_size() -> int:
    """The block size an engine runs with unless told otherwise."""
    return EngineArgs().block_size


@dataclass(frozen=True)
class PrefixMissExplanation:
    """Where prompt A (the new request) stops reusing the cache of B (or of an engine).

    Invariants: ``matched_blocks = min(matched_tokens, num_tokens - 1) // block_size`` (the
    last prompt token is always computed); ``block_index = token_offset // block_size``;
    ``token_offset`` is None exactly when nothing is missed (cause "none" or "extension").
    ``before`` is A's text just before ``char_offset``, ``after`` A's text from there;
    ``reference_after`` B's text from there (None against an engine). ``tier_tokens``: of the
    matched tokens, those that KV tiers under an engine's pool hold, by tier (a request loads them
    rather than computing them, unless reading one fails: the probe reads nothing).
    """

    cause: str
    block_size: int
    num_tokens: int
    matched_tokens: int
    matched_blocks: int
    token_offset: int | None = None
    block_index: int | None = None
    char_offset: int | None = None
    before: str = ""
    after: str = ""
    reference_after: str | None = None
    tier_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return self.token_offset is not None

    @property
    def advice(self) -> str:
        return ADVICE[self.cause]

    def __str__(self) -> str:
        hits = (f"{self.matched_blocks} full block{'s' * (self.matched_blocks != 1)} of {self.block_size} "
                f"tokens ({self.matched_blocks * self.block_size} tokens) hit{_from_tiers(self.tier_tokens)}")
        if not self.diverged:
            return f"no prefix cache miss: {self.advice}; {hits}"
        where = (f"prefix cache miss at block {self.block_index} "
                 f"(token {self.token_offset} of {self.num_tokens}, character {self.char_offset})")
        if self.reference_after is None:
            seen = f"cached up to {_show(self.before, '')}, not from {_show('', self.after)}"
        else:
            seen = (f"prompt A has {_show(self.before, self.after)} "
                    f"where B has {_show(self.before, self.reference_after)}")
        return f"{where}: {seen} — {self.advice}; {hits}"


def _from_tiers(tier_tokens: dict[str, int]) -> str:
    """" (of those tokens, N in the host tier and M in the disk tier: ...)", for the tiers that
    hold any; "" for none."""
    held = [f"{tokens} in the {tier} tier" for tier, tokens in tier_tokens.items() if tokens]
    return f" (of those tokens, {' and '.join(held)}: a request loads them, unless a read fails)" if held else ""


def _show(before: str, after: str) -> str:
    """A quoted excerpt, newlines and tabs escaped, ellipses where text was cut."""
    text = (before + after).translate({10: "\\n", 9: "\\t", 13: "\\r"})
    return f"'{'...' * bool(before)}{text}{'...' * bool(after)}'"


# ---- tokens and text --------------------------------------------------------------------

def _tokens_and_text(prompt: str | list[int], tokenizer: Any, name: str = "prompt") -> tuple[list[int], str]:
    """(token ids, text) of a prompt given as text (encoded as the engine does) or as ids.
    Raises TypeError or ValueError (text that is not valid UTF-8) naming the prompt."""
    if isinstance(prompt, str):
        check_utf8(name, prompt)
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(token, int) and not isinstance(token, bool)
                                                   for token in prompt):
        ids = list(prompt)
        outside = [token for token in ids if not 0 <= token < len(tokenizer)]
        if outside:
            raise ValueError(f"{name}: token ids {outside[:5]} are outside the vocabulary [0, {len(tokenizer)})")
    else:
        raise TypeError(f"{name} must be a str or a list of token ids, got {type(prompt).__name__}")
    return ids, _decode(tokenizer, ids)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _common_prefix_len(a: str | list[int], b: str | list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


# ---- causes ---------------------------------------------------------------------------------

def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _moved(text: str, other: str, offset: int) -> bool:
    """Whether the text from ``offset`` on appears elsewhere in the other prompt."""
    snippet = text[offset:offset + _SNIPPET]
    return len(snippet) >= _MIN_SNIPPET and snippet in other


def _inserted(text: str, other: str, offset: int) -> str:
    """A short insertion (at most _MAX_INSERTION characters) that ``text`` has at
    ``offset``, after which ``other``'s continuation resumes; "" if there is none."""
    snippet = other[offset:offset + _SNIPPET]
    resume = text.find(snippet, offset + 1) if len(snippet) >= _MIN_SNIPPET else -1
    return text[offset:resume] if 0 < resume - offset <= _MAX_INSERTION else ""


def _volatile_kind(text: str, offset: int) -> str | None:
    """The kind of volatile-looking content covering ``offset``, if any."""
    for kind, match in detect_volatile(text):
        if match.start() <= offset < match.end():
            return kind
    return None


def _numeric_word_at(text: str, offset: int) -> bool:
    """Whether the character at ``offset`` belongs to a word (letters, digits, - and _)
    that holds a digit, like an order number or a request id."""
    if offset >= len(text) or not (text[offset].isalnum() or text[offset] in "-_"):
        return False
    words = (match.group() for match in re.finditer(r"[\w-]+", text) if match.start() <= offset < match.end())
    return any(char.isdigit() for char in next(words))


def classify(text_a: str, text_b: str, offset: int) -> str:
    """The likely cause of two different texts parting at character ``offset``.

    Checked in this order: "whitespace" (the texts agree from there once whitespace is
    ignored), "reordered" (the text after the point appears elsewhere in the other
    prompt), "timestamp" or "id" (volatile-looking content at the point, see
    ``detect_volatile``, or a word with digits on both sides), else "content".
    """
    tail_a, tail_b = text_a[offset:], text_b[offset:]
    if _squeeze(tail_a)[:_SNIPPET] == _squeeze(tail_b)[:_SNIPPET]:
        return "whitespace"
    if _moved(text_a, text_b, offset) or _moved(text_b, text_a, offset):
        inserted = _inserted(text_a, text_b, offset) + " " + _inserted(text_b, text_a, offset)
        kinds = [kind for kind, _ in detect_volatile(inserted)]
        if kinds:
            return "timestamp" if kinds[0] in _TIME_KINDS else "id"
        return "reordered"
    kind = _volatile_kind(text_a, offset) or _volatile_kind(text_b, offset)
    if kind is not None:
        return "timestamp" if kind in _TIME_KINDS else "id"
    if _numeric_word_at(text_a, offset) and _numeric_word_at(text_b, offset):
        return "id"
    return "content"


# ---- explanations -----------------------------------------------------------------------------

def _explanation(cause: str, block_size: int, num_tokens: int, matched: int, text: str = "",
                 char: int | None = None, reference_text: str | None = None,
                 tier_tokens: dict[str, int] | None = None) -> PrefixMissExplanation:
    """The explanation of a prompt of num_tokens whose first ``matched`` tokens hit; a miss
    (``char`` given) at token ``matched``, character ``char`` of ``text``."""
    hits = max(min(matched, num_tokens - 1), 0) // block_size  # the last token is always computed
    tier_tokens = tier_tokens or {}
    if char is None:
        return PrefixMissExplanation(cause, block_size, num_tokens, matched, hits, tier_tokens=tier_tokens)
    return PrefixMissExplanation(
        cause, block_size, num_tokens, matched, hits, token_offset=matched, block_index=matched // block_size,
        char_offset=char, before=text[max(char - _WINDOW, 0):char], after=text[char:char + _WINDOW],
        reference_after=None if reference_text is None else reference_text[char:char + _WINDOW],
        tier_tokens=tier_tokens)


def explain(prompt: str | list[int], reference: str | list[int], tokenizer: Any,
            block_size: int | None = None) -> PrefixMissExplanation:
    """Why ``prompt`` (A, the new request) misses blocks that ``reference`` (B, an earlier
    request whose blocks are cached) left. Prompts are texts or token id lists;
    ``block_size`` is the engine's (None: ``default_block_size()``)."""
    block_size = default_block_size() if block_size is None else block_size
    _check_block_size(block_size)
    ids_a, text_a = _tokens_and_text(prompt, tokenizer, "prompt")
    ids_b, text_b = _tokens_and_text(reference, tokenizer, "reference")
    common = _common_prefix_len(ids_a, ids_b)
    if common == min(len(ids_a), len(ids_b)):
        return _explanation("none" if ids_a == ids_b else "extension", block_size, len(ids_a), common)
    if text_a == text_b:
        cause, char = "tokenization", len(_decode(tokenizer, ids_a[:common]))
    else:
        char = _common_prefix_len(text_a, text_b)
        cause = classify(text_a, text_b, char)
    return _explanation(cause, block_size, len(ids_a), common, text_a, char, text_b)


def explain_against_engine(prompt: str | list[int], engine: ConfiguredEngine, tokenizer: Any,
                           cache_salt: str | None = None) -> PrefixMissExplanation:
    """Where ``engine``'s prefix cache stops covering ``prompt``, and what text is there.

    The engine's ``cached_prefix`` (of the prompt but its last token, which is always
    computed) and block size are all that is asked; with no earlier prompt to compare with,
    the cause is "timestamp" or "id" when such content sits in the first missed block, else
    "uncached". Blocks a KV tier holds are hits (``tier_tokens``), as a request would load them.
    """
    block_size = engine.args.block_size
    ids, text = _tokens_and_text(prompt, tokenizer)
    where = engine.cached_prefix(ids[:-1], cache_salt)
    cached, tiers = sum(where.values()), {tier: tokens for tier, tokens in where.items() if tier != POOL}
    if cached >= (len(ids) - 1) // block_size * block_size:
        return _explanation("none", block_size, len(ids), cached, tier_tokens=tiers)
    char = len(_decode(tokenizer, ids[:cached]))
    missed_block_end = len(_decode(tokenizer, ids[:cached + block_size]))
    return _explanation(_missed_block_cause(text, char, missed_block_end), block_size, len(ids), cached, text, char,
                        tier_tokens=tiers)


def _missed_block_cause(text: str, start: int, end: int) -> str:
    """"timestamp" or "id" if volatile-looking content overlaps text[start:end], else "uncached"."""
    kinds = [kind for kind, match in detect_volatile(text) if match.start() < end and start < match.end()]
    if not kinds:
        return "uncached"
    return "timestamp" if kinds[0] in _TIME_KINDS else "id"


# ---- CLI: pagedrag explain -------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pagedrag explain A.txt B.txt [--block-size N] [--model NAME]``."""
    parser.add_argument("files", nargs="*", metavar="FILE",
                        help="prompt files: A (the new request), then B (the earlier one); "
                             "a side given with --text-a/--text-b takes no file")
    parser.add_argument("--text-a", help="prompt A as a literal string")
    parser.add_argument("--text-b", help="prompt B as a literal string")
    parser.add_argument("--block-size", type=int, default=default_block_size(),
                        help="KV cache block size in tokens (default: the engine's, %(default)s)")
    parser.add_argument("--model", default=None,
                        help="tokenizer: a model folder, hub name or .gguf file (default: the embedded SmolLM2)")


def _cli_prompts(args: argparse.Namespace) -> tuple[str, str]:
    """(A, B): the literal strings where given, the files' contents in order for the rest."""
    literals = (args.text_a, args.text_b)
    needed = sum(literal is None for literal in literals)
    if len(args.files) != needed:
        raise ValueError(f"expected {needed} prompt file(s) besides --text-a/--text-b, got {len(args.files)}")
    files = iter(args.files)
    prompt_a, prompt_b = (literal if literal is not None else _read_prompt(next(files)) for literal in literals)
    return prompt_a, prompt_b


def _read_prompt(path: str) -> str:
    """A prompt file's text exactly as it is (its line endings kept: \r\n and \n tokenize apart)."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text: {error}") from None


def run(args: argparse.Namespace) -> int:
    """Print the explanation of A against B; 0 on success, 2 on bad arguments or files."""
    try:
        prompt_a, prompt_b = _cli_prompts(args)
        _check_block_size(args.block_size)
        tokenizer = load_tokenizer(args.model)
        explanation = explain(prompt_a, prompt_b, tokenizer, args.block_size)
    except (OSError, ValueError) as err:
        print(f"pagedrag explain: {err}", file=sys.stderr)
        return 2
    print(explanation)
    return 0
