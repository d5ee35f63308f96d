"""The prefix-miss explainer on crafted prompt pairs, against a fake engine, and its CLI."""

import argparse

import pytest

from pagedrag.rag.canonical import Chunk, PromptCanonicalizer
from pagedrag.config import EngineArgs
from pagedrag.rag.explain import add_arguments, classify, explain, explain_against_engine, run
from pagedrag.rag.tokenizer import load_tokenizer

PREAMBLE = ("You are the support assistant of ACME Tools. Answer only from the documents below, "
            "cite the source of every claim, and say so when the documents do not answer. ")
DOCS = ["The warranty covers parts and labour for two years from the date of purchase.",
        "Returns are accepted within thirty days if the item is unused and in its box.",
        "Batteries are consumables and are not covered by the warranty at all."]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


class FixedEngine:
    """An engine whose cache covers a fixed number of leading tokens, in blocks of block_size."""

    def __init__(self, cached: int, block_size: int = 16):
        self.cached, self.calls = cached, []
        self.args = EngineArgs(block_size=block_size)

    def cached_prefix(self, prompt_token_ids, cache_salt=None):
        self.calls.append((list(prompt_token_ids), cache_salt))
        return {"pool": min(self.cached, len(prompt_token_ids)) // self.args.block_size * self.args.block_size}


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def test_a_timestamp_in_the_system_prompt_is_found_in_its_block(tok):
    a = PREAMBLE + "Current time: 2026-11-29 10:41.\n" + "\n".join(DOCS)
    b = PREAMBLE + "Current time: 2026-11-28 09:00.\n" + "\n".join(DOCS)
    result = explain(a, b, tok)
    ids_a, ids_b = tok.encode(a), tok.encode(b)
    assert result.cause == "timestamp" and result.diverged
    assert result.token_offset == _first_difference(ids_a, ids_b) and result.num_tokens == len(ids_a)
    assert result.block_index == result.token_offset // 16 == result.matched_blocks >= 2
    start = a.index("2026-11-29")
    assert start <= len(tok.decode(ids_a[:result.token_offset])) <= result.char_offset < start + len("2026-11-29")
    assert result.after.startswith("9 10:41") and result.reference_after.startswith("8 09:00")
    text = str(result)
    assert text.startswith(f"prefix cache miss at block {result.block_index} (token {result.token_offset} of")
    assert "time: 2026-11-29 10:41" in text and "time: 2026-11-28 09:00" in text and "timestamp" in text


def test_the_canonicalizer_moves_the_miss_after_the_chunks(tok):
    canon = PromptCanonicalizer(PREAMBLE, tokenizer=tok)
    chunks = [Chunk(text, "faq.md", i) for i, text in enumerate(DOCS)]
    first = canon.build("Is the battery covered?", chunks, {"now": "2026-11-29 10:41"})
    second = canon.build("Is the battery covered?", chunks[::-1], {"now": "2026-11-28 09:00"})
    result = explain(first.token_ids, second.token_ids, tok)
    assert result.cause == "timestamp"
    seen = tok.decode(first.token_ids)  # the chat template as the model sees it
    assert seen[:result.char_offset].endswith("now: 2026-11-2")
    assert result.matched_blocks == len(tok.encode(seen[:seen.index("now:")])) // 16


def test_reordered_chunks(tok):
    a = PREAMBLE + "\n".join(DOCS)
    b = PREAMBLE + "\n".join([DOCS[1], DOCS[0], DOCS[2]])
    result = explain(a, b, tok)
    assert result.cause == "reordered" and "different order" in str(result)
    assert result.char_offset == len(PREAMBLE)


def test_whitespace_only_difference(tok):
    a = PREAMBLE + "\n\n".join(DOCS)
    b = PREAMBLE + "\n \n".join(DOCS)
    assert explain(a, b, tok).cause == "whitespace"
    assert explain(a + "  ", a, tok).cause in ("whitespace", "extension")


def test_identical_prompts_do_not_diverge(tok):
    a = PREAMBLE + "\n".join(DOCS)
    result = explain(a, a, tok)
    n = len(tok.encode(a))
    assert not result.diverged and result.cause == "none" and result.token_offset is None
    assert result.matched_tokens == n and result.matched_blocks == (n - 1) // 16
    assert str(result).startswith("no prefix cache miss")


def test_one_prompt_extending_the_other_is_no_miss(tok):
    result = explain(PREAMBLE + "\nWhat about batteries?", PREAMBLE, tok)
    assert result.cause == "extension" and not result.diverged


@pytest.mark.parametrize("a, b, cause", [
    ("session 3f2a9c1e-0b1d-4c2e-9f00-1234567890ab: hi", "session 77aa9c1e-0b1d-4c2e-9f00-1234567890ab: hi", "id"),
    ("Your order 48213 shipped today.", "Your order 99120 shipped today.", "id"),
    ("Meeting on November 29, 2026 in Lyon.", "Meeting on November 30, 2026 in Lyon.", "timestamp"),
    ("The answer is yes.", "The answer is no.", "content"),
])
def test_ids_dates_and_content(tok, a, b, cause):
    assert explain(PREAMBLE + a, PREAMBLE + b, tok).cause == cause


def test_same_text_tokenized_in_pieces(tok):
    whole = tok.encode(PREAMBLE + DOCS[0])
    pieces = tok.encode(PREAMBLE + DOCS[0][:9]) + tok.encode(DOCS[0][9:])
    result = explain(whole, pieces, tok)
    assert result.cause == "tokenization" and result.token_offset == _first_difference(whole, pieces)


def test_classify_checks_whitespace_before_reordering_before_ids():
    assert classify("a  b", "a b", 2) == "whitespace"
    moved = "x" * 40
    assert classify("head 12 " + moved, "head 34 tail " + "12 " + moved, 5) == "reordered"
    assert classify("head 12 tail", "head 34 tail", 5) == "id"


def test_against_an_engine(tok):
    a = PREAMBLE + "Current time: 2026-11-29 10:41.\n" + "\n".join(DOCS)
    ids = tok.encode(a)
    stop = len(tok.encode(a[:a.index("2026")])) // 16 * 16
    engine = FixedEngine(stop)
    result = explain_against_engine(a, engine, tok, cache_salt="t1")
    assert engine.calls == [(ids[:-1], "t1")]  # the last token is always computed
    assert result.cause == "timestamp" and result.block_index == stop // 16 and result.reference_after is None
    assert a[:result.char_offset].endswith(result.before) and a[result.char_offset:].startswith(result.after)
    assert f"prefix cache miss at block {stop // 16}" in str(result) and "cached up to" in str(result)
    assert explain_against_engine(PREAMBLE, FixedEngine(0), tok).cause == "uncached"
    assert explain_against_engine(a, FixedEngine(len(ids)), tok).cause == "none"


def test_the_block_size_is_the_engines(tok):
    a = PREAMBLE + "Current time: 2026-11-29 10:41.\n" + "\n".join(DOCS)
    assert explain(a, a, tok).block_size == EngineArgs().block_size
    result = explain_against_engine(a, FixedEngine(0, block_size=8), tok)
    assert result.block_size == 8 and result.block_index == 0
    assert _args("a.txt", "b.txt").block_size == EngineArgs().block_size


def test_the_tokenizer_is_loaded_once_per_process(tok):
    assert load_tokenizer() is tok
    assert load_tokenizer().encode(PREAMBLE) == tok.encode(PREAMBLE)


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="block_size"):
        explain("a", "b", tok, block_size=0)
    with pytest.raises(TypeError, match="prompt"):
        explain(3, "b", tok)
    for ids in ([1, -1], [1, 10**9]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            explain(ids, [1, 2], tok)
    with pytest.raises(TypeError, match="token ids"):
        explain([True, 1], [1, 2], tok)


def _args(*argv):
    parser = argparse.ArgumentParser(prog="pagedrag explain")
    add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_with_files_and_literals(tok, tmp_path, capsys):
    path_a, path_b = tmp_path / "a.txt", tmp_path / "b.txt"
    path_a.write_text(PREAMBLE + "Now: 2026-11-29 10:41.\n" + DOCS[0])
    path_b.write_text(PREAMBLE + "Now: 2026-11-28 09:00.\n" + DOCS[0])
    assert run(_args(str(path_a), str(path_b), "--block-size", "8")) == 0
    out = capsys.readouterr().out
    assert out.startswith("prefix cache miss at block") and "of 8 tokens" in out and "timestamp" in out
    assert run(_args("--text-a", PREAMBLE + "x", str(path_b))) == 0
    assert run(_args("--text-a", "same", "--text-b", "same")) == 0
    assert "no prefix cache miss" in capsys.readouterr().out.splitlines()[-1]


def test_cli_files_keep_their_line_endings(tok, tmp_path, capsys):
    """A CRLF file against an LF one tokenizes apart, and the CLI says so (its files are read
    as they are, not with Python's newline translation)."""
    path_a, path_b = tmp_path / "crlf.txt", tmp_path / "lf.txt"
    text = PREAMBLE + "\n" + DOCS[0] + "\n"
    path_a.write_bytes(text.replace("\n", "\r\n").encode())
    path_b.write_bytes(text.encode())
    assert run(_args(str(path_a), str(path_b), "--block-size", "8")) == 0
    out = capsys.readouterr().out
    assert out.startswith("prefix cache miss at block") and "whitespace" in out


@pytest.mark.parametrize("argv, message", [
    (("only-one.txt",), "expected 2 prompt file(s)"),
    (("--text-a", "x", "--text-b", "y", "extra.txt"), "expected 0 prompt file(s)"),
    (("nope-a.txt", "nope-b.txt"), "No such file"),
    (("--text-a", "x", "--text-b", "y", "--block-size", "0"), "block_size"),
])
def test_cli_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(_args(*argv)) == 2
    assert message in capsys.readouterr().err


def test_inserted_timestamp_is_a_timestamp_not_a_reordering():
    from pagedrag.rag.explain import classify
    base = "You are a helpful assistant. Answer from the documents below."
    stamped = "Today is 2026-11-29 10:41:07. " + base
    assert classify(stamped, base, 0) == "timestamp"
    assert classify(base, stamped, 0) == "timestamp"


def test_text_that_is_not_utf8_is_named(tok):
    with pytest.raises(ValueError, match="reference is not valid UTF-8"):
        explain("abc", "abc \ud800", tok)
    with pytest.raises(ValueError, match="prompt is not valid UTF-8"):
        explain("abc \ud800", "abc", tok)
    assert run(_args("--text-a", "abc \udcff", "--text-b", "abc")) == 2
