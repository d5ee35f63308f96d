"""What a caller passes, turned into a validated prompt before it can reach a step.

InputProcessor holds no engine state: the engine thread uses one, and AsyncLLMEngine
runs copies on worker threads, so that tokenizing a long prompt never stalls a step.
Everything a request carries is checked here against the model and the engine's
limits (token ids within the vocabulary, lengths, UTF-8, n against max_num_seqs);
whatever passes cannot make a step fail.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedrag.core.request import PromptSegment
from pagedrag.engine import literal_text
from pagedrag.engine.segments import TextCuts, chat_segments, text_segments, token_segments
from pagedrag.sampling_params import ParameterError, SamplingParams
from pagedrag.structured.compiler import GrammarCompiler
from pagedrag.tools import PARSERS, ToolPlan, parser_for, plan_tools, prepare_conversation, template_supports_tools
from pagedrag.text_checks import check_int, check_utf8

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int] | Mapping
Conversation = list[dict]
PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_segments", "cache_salt")
SEGMENT_KEYS = ("text", "token_ids", "reusable")
MAX_PROMPT_SEGMENTS = 4096
MAX_CACHE_SALT_CHARS = 4096
# A text of more than this many characters per token of max_model_len is refused before
# it is tokenized: no token of the vocabulary decodes to more characters than its longest
# token string, and the factor covers normalizers that merge characters (NFKC).
CHARS_PER_TOKEN_SAFETY = 2


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt that passed every check: ``token_ids`` are in the vocabulary, and there
    are fewer than max_model_len of them. ``segments`` cover them, in order, when the
    prompt came as ``prompt_segments``."""

    text: str | None
    token_ids: list[int]
    cache_salt: str | None
    segments: tuple[PromptSegment, ...] = ()


@dataclass(frozen=True)
class ToolSettings:
    """How chats with tools work for this model: the family's parser (``tool_call_parser``,
    or detected from the chat template), and whether tool_choice "auto" is allowed."""

    parser_name: str | None = None
    auto_tool_choice: bool = True


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 eos_token_ids: list[int] = (), tools: ToolSettings = ToolSettings()):
        self.tokenizer = tokenizer
        self.grammars = GrammarCompiler(tokenizer, vocab_size, list(eos_token_ids))  # shared by copies
        self.tool_parser = PARSERS[tools.parser_name] if tools.parser_name else parser_for(tokenizer)
        self.template_supports_tools = template_supports_tools(tokenizer)
        self.auto_tool_choice = tools.auto_tool_choice
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_prompt_chars = max_model_len * CHARS_PER_TOKEN_SAFETY * _longest_token_chars(tokenizer)
        self.segment_prompts = False  # chunk reuse: cut text prompts and chats into segments (engine.segments)
        self._told_chunks_unused = threading.Event()  # shared by copies: the warning is logged once

    def copy(self) -> "InputProcessor":
        """An independent processor for another thread (a tokenizer is not shared across
        threads; the thread-safe grammar compiler and its cache are)."""
        clone = copy.copy(self)
        clone.tokenizer = copy.deepcopy(self.tokenizer)
        return clone

    # ---- prompts ------------------------------------------------------------------
    def process(self, prompt: PromptType, cache_salt: str | None = None,
                truncate_prompt_tokens: int | None = None, chunks: Sequence[str] | None = None) -> ProcessedPrompt:
        """Tokenize and check a prompt given as text, token ids or a prompt dict; the
        ``cache_salt`` argument wins over the dict's; ``truncate_prompt_tokens`` keeps the
        last k tokens (the text is then dropped; -1: the longest prompt the engine takes,
        max_model_len - 1). With ``segment_prompts`` a text prompt is
        cut into segments (around ``chunks``, the retrieved chunks' texts, or at blank
        lines). Raises ValueError / TypeError; also when ``chunks`` come with a prompt that has
        no text to cut (token ids, prompt_segments), rather than leaving them unused."""
        if chunks and not self._segmentable(prompt):
            raise ValueError("prompt_chunks (chunks) cut a text prompt into segments; this prompt is "
                             "token ids or prompt_segments, which have no text to cut")
        if chunks:
            self._warn_if_chunks_unused()
        if self.segment_prompts and self._segmentable(prompt):
            prompt = self._segmented(prompt, chunks)
        if isinstance(prompt, ProcessedPrompt):
            text, token_ids, salt, segments = prompt.text, prompt.token_ids, prompt.cache_salt, prompt.segments
        else:
            (text, token_ids, salt), segments = self._parse(prompt)
        salt = cache_salt if cache_salt is not None else salt
        if truncate_prompt_tokens == -1:  # vLLM's "as long as the model takes"
            truncate_prompt_tokens = self.max_model_len - 1
        if truncate_prompt_tokens is not None and len(token_ids) > truncate_prompt_tokens:
            text, token_ids, segments = None, token_ids[-truncate_prompt_tokens:], ()
        check_cache_salt(salt)
        self.check_prompt_ids(token_ids)
        return ProcessedPrompt(text, token_ids, salt, segments)

    def _warn_if_chunks_unused(self) -> None:
        """Chunks without chunk reuse change nothing: say so, once (integrations pass them on
        every call)."""
        if self.segment_prompts or self._told_chunks_unused.is_set():
            return
        self._told_chunks_unused.set()
        logger.warning("prompt_chunks (chunks=) are given, but chunk reuse is off: they change nothing "
                       "(prefix caching still applies); start the engine with enable_chunk_reuse=True "
                       "(pagedrag serve --enable-chunk-reuse) to reuse each chunk's KV wherever it lands. "
                       "Logged once.")

    @staticmethod
    def _segmentable(prompt: object) -> bool:
        """A text prompt (a string, or a dict with a text and no token ids or segments)."""
        return isinstance(prompt, str) or (isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str)
                                           and not {"prompt_token_ids", "prompt_segments"} & set(prompt))

    def _segmented(self, prompt: str | Mapping, chunks: Sequence[str] | None) -> dict:
        """A text prompt as a prompt_segments dict (engine.segments.text_segments), its
        cache_salt kept. A prompt dict's keys are checked as _parse checks them, so that
        chunk reuse never drops a key that would be refused without it."""
        if isinstance(prompt, Mapping):
            self._check_keys(prompt)
        text = prompt if isinstance(prompt, str) else prompt["prompt"]
        self._check_text(text)
        segmented = {"prompt_segments": text_segments(text, chunks)}
        if isinstance(prompt, Mapping) and "cache_salt" in prompt:
            segmented["cache_salt"] = prompt["cache_salt"]
        return segmented

    def _parse(self, prompt: PromptType) -> tuple[tuple[str | None, list[int], str | None], tuple[PromptSegment, ...]]:
        if isinstance(prompt, Mapping) and "prompt_segments" in prompt:
            if "prompt" in prompt or "prompt_token_ids" in prompt:
                raise ValueError("give a prompt as prompt_segments or as prompt / prompt_token_ids, not both")
            self._check_keys(prompt)
            text, token_ids, segments = self._segments(prompt["prompt_segments"])
            return (text, token_ids, prompt.get("cache_salt")), segments
        return self._parse_whole(prompt), ()

    def _check_keys(self, prompt: Mapping) -> None:
        unknown = set(prompt) - set(PROMPT_KEYS)
        if unknown:
            raise ValueError(f"unknown prompt keys {sorted(unknown)}; use {', '.join(PROMPT_KEYS)}")

    def _segments(self, items: object, special_first: bool = True) -> tuple[str | None, list[int], tuple[PromptSegment, ...]]:
        """prompt_segments: texts, token-id lists or {"text" | "token_ids", "reusable"} dicts. The
        prompt is their concatenation; each text is tokenized on its own (the first with the
        tokenizer's special tokens, unless ``special_first`` is False: a rendered chat has them
        in its text), so a chunk has the same tokens wherever it lands.

        Invariant: every PromptSegment covers at least one token. A segment with no tokens (an
        empty text or list) adds nothing to the prompt and is left out; when it is the first,
        the first segment with tokens is the head (core.chunk_cache keys a chunk by the
        segment before it, which needs a token).

        ``TextCuts`` (engine.segments: a text prompt or chat that chunk reuse cut) are not
        tokenized apart: see ``_cut_segments``."""
        if isinstance(items, TextCuts):
            return self._cut_segments(items, special_first)
        if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Sequence) or not items:
            raise ValueError("prompt_segments must be a non-empty list of texts, token-id lists or "
                             "{'text' | 'token_ids', 'reusable'} dicts")
        if len(items) > MAX_PROMPT_SEGMENTS:
            raise ValueError(f"prompt_segments holds {len(items)} segments, at most {MAX_PROMPT_SEGMENTS} are allowed")
        parts = [self._segment_part(index, item) for index, item in enumerate(items)]
        self.check_prompt_chars(sum(len(content) for content, _ in parts if isinstance(content, str)))
        token_ids, segments = [], []
        for index, (content, reusable) in enumerate(parts):
            ids = content if not isinstance(content, str) else \
                self._encode_segment(content, special=special_first and index == 0)
            if not ids:
                continue
            segments.append(PromptSegment(len(token_ids), len(token_ids) + len(ids), reusable))
            token_ids.extend(ids)
        texts = [content for content, _ in parts]
        text = "".join(texts) if all(isinstance(content, str) for content in texts) else None
        return text, token_ids, tuple(segments)

    def _cut_segments(self, cuts: TextCuts, special: bool) -> tuple[str, list[int], tuple[PromptSegment, ...]]:
        """The text of ``cuts`` tokenized whole (with the tokenizer's special tokens when
        ``special``), so its token ids are exactly those of the same prompt without chunk reuse;
        the segments are cut at token boundaries (engine.segments.token_segments). A tokenizer
        without offsets (a slow one) leaves the prompt one segment, which reuses nothing."""
        text = "".join(cut["text"] for cut in cuts)
        self._check_text(text)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
        if not getattr(self.tokenizer, "is_fast", False):
            token_ids = self.tokenizer.encode(text, add_special_tokens=special)
            return text, token_ids, (PromptSegment(0, len(token_ids), False),) if token_ids else ()
        encoded = self.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        ranges = token_segments(encoded["offset_mapping"], cuts)
        return text, list(encoded["input_ids"]), tuple(PromptSegment(*span) for span in ranges)

    def _segment_part(self, index: int, item: object) -> tuple[str | list[int], bool]:
        """(text or token ids, reusable) of one prompt segment."""
        where, reusable, kind = f"prompt_segments[{index}]", True, None
        if isinstance(item, Mapping):
            unknown = set(item) - set(SEGMENT_KEYS)
            if unknown or ("text" in item) == ("token_ids" in item):
                raise ValueError(f"{where} must hold exactly one of 'text' or 'token_ids' "
                                 f"(and optionally 'reusable'), got keys {sorted(item)}")
            reusable = item.get("reusable", True)
            if not isinstance(reusable, bool):
                raise TypeError(f"{where}['reusable'] must be true or false, got {type(reusable).__name__}")
            kind = "text" if "text" in item else "token_ids"
            where, item = f"{where}[{kind!r}]", item[kind]
        is_text = isinstance(item, str)
        is_ids = isinstance(item, Sequence) and not isinstance(item, (str, bytes))
        if is_text and kind in (None, "text"):
            check_utf8(where, item)
            return item, reusable
        if is_ids and kind in (None, "token_ids"):
            return [check_int(f"a token id of {where}", token) for token in item], reusable
        expected = {None: "a text, a token-id list or a dict", "text": "a text", "token_ids": "a token-id list"}[kind]
        raise TypeError(f"{where} must be {expected}, got {type(item).__name__}")

    def _encode_segment(self, text: str, special: bool) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompt_segments as token-id lists")
        return self.tokenizer.encode(text, add_special_tokens=special)

    def _parse_whole(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        if isinstance(prompt, Mapping):
            self._check_keys(prompt)
            text = prompt.get("prompt")
            if "prompt_token_ids" in prompt:
                if text is not None:
                    self._check_text(text)
                return text, self._token_ids(prompt["prompt_token_ids"]), prompt.get("cache_salt")
            return (*self._encode(text), prompt.get("cache_salt"))
        if isinstance(prompt, str):
            return (*self._encode(prompt), None)
        if isinstance(prompt, Sequence):
            if prompt and isinstance(prompt[0], Mapping) and "role" in prompt[0]:
                raise TypeError("a chat conversation (a list of messages) is not a prompt here: use LLM.chat, or "
                                "warm it through pagedrag.client or POST /v1/warm, which take conversations")
            return None, self._token_ids(prompt), None
        raise TypeError(f"a prompt must be a string, a list of token ids or a prompt dict, "
                        f"got {type(prompt).__name__}")

    def _encode(self, text: object) -> tuple[str, list[int]]:
        self._check_text(text)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
        return text, self.tokenizer.encode(text, add_special_tokens=True)

    def _check_text(self, text: object) -> None:
        if not isinstance(text, str):
            raise TypeError(f"a prompt's text must be a string, got {type(text).__name__}")
        check_utf8("the prompt", text)
        self.check_prompt_chars(len(text))

    def check_prompt_chars(self, num_chars: int) -> None:
        """Refuse a text certainly too long for max_model_len, before tokenizing it."""
        if num_chars > self.max_prompt_chars:
            raise ValueError(f"the prompt has {num_chars} characters, more than {self.max_model_len} "
                             f"tokens (max_model_len) can hold (at most {self.max_prompt_chars})")

    def _token_ids(self, token_ids: object) -> list[int]:
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise TypeError(f"prompt_token_ids must be a list of integers, got {type(token_ids).__name__}")
        return [check_int("a prompt token id", token) for token in token_ids]

    def check_prompt_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                "it must be shorter to leave room for at least one generated token")
        self._check_in_vocab("prompt", "prompt token ids", token_ids)

    def _check_in_vocab(self, param: str, what: str, token_ids: list[int]) -> None:
        """ParameterError naming ``param`` unless every id is in the vocabulary."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ParameterError(param, f"{what} {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    # ---- chats -------------------------------------------------------------------
    def render_chat(self, conversation: Conversation, add_generation_prompt: bool = True,
                    cache_salt: str | None = None, tools: ToolPlan | None = None,
                    chunks: Sequence[str] | None = None, truncate_prompt_tokens: int | None = None,
                    **template_kwargs) -> ProcessedPrompt:
        """A conversation through the model's chat template (the tokenizer's, rendered in
        Jinja's sandbox by transformers; ``template_kwargs`` may carry a caller's own
        ``chat_template`` and ``continue_final_message``), with the request's ``tools``,
        checked like any prompt after it is cut to its last ``truncate_prompt_tokens`` tokens
        (when given). The messages' content is literal text: a special-token string in it
        never becomes a special token (engine.literal_text). With ``segment_prompts`` it is cut
        into segments (around ``chunks``, the retrieved chunks' texts, or at blank lines:
        engine.segments), unless it is truncated or a content holds a special-token string."""
        def render(messages: Conversation) -> str:
            return self.render_chat_text(messages, add_generation_prompt, tools, **template_kwargs)

        if chunks:
            self._warn_if_chunks_unused()
        conversation = normalize_conversation(conversation)
        text = render(conversation)
        pieces = literal_text.chat_pieces(self.tokenizer, render, conversation, text)
        plain = pieces == [literal_text.Piece(text, False)]
        segments = chat_segments(render, conversation, text, chunks) \
            if self.segment_prompts and plain and truncate_prompt_tokens is None else None
        if segments is None:
            return self.process_chat_text(text, cache_salt, pieces, truncate_prompt_tokens)
        self._check_text(text)
        _, token_ids, parsed = self._segments(segments, special_first=False)
        prompt = self.process({"prompt": text, "prompt_token_ids": token_ids}, cache_salt)
        return ProcessedPrompt(prompt.text, prompt.token_ids, prompt.cache_salt, parsed)

    def render_chat_text(self, conversation: Conversation, add_generation_prompt: bool = True,
                         tools: ToolPlan | None = None, **template_kwargs) -> str:
        """The conversation through the chat template, as text (not yet checked or tokenized).
        Past tool calls and tool results are rendered as the model's family writes them
        (pagedrag.tools.prompting), and so are the tools when the template has no place for them."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template, and this model has none")
        conversation, tool_kwargs = prepare_conversation(conversation, tools, self.tool_parser,
                                                         self.template_supports_tools)
        return self.tokenizer.apply_chat_template(
            normalize_conversation(conversation), tokenize=False, add_generation_prompt=add_generation_prompt,
            **tool_kwargs, **template_kwargs)

    def plan_tools(self, tools: object, tool_choice: object, parallel_tool_calls: object = True) -> ToolPlan | None:
        """A chat request's tools and tool_choice, checked (pagedrag.tools.plan_tools); None
        without tools. tool_choice "auto" is refused when enable_auto_tool_choice is off."""
        plan = plan_tools(tools, tool_choice, parallel_tool_calls)
        if plan is not None and plan.choice == "auto" and not self.auto_tool_choice:
            raise ValueError('tool_choice "auto" needs enable_auto_tool_choice (--enable-auto-tool-choice); '
                             'use "none", "required" or a named function')
        return plan

    def process_chat_text(self, text: str, cache_salt: str | None = None,
                          pieces: Sequence[literal_text.Piece] | None = None,
                          truncate_prompt_tokens: int | None = None) -> ProcessedPrompt:
        """A rendered chat: its special tokens are in the text, so none are added. ``pieces``
        (literal_text.chat_pieces) split ``text`` into template text and message content,
        whose special-token strings are then encoded as literal text; without them, every
        special-token string in ``text`` is a special token. Cut to the last
        ``truncate_prompt_tokens`` tokens (when given) before its length is checked."""
        self._check_text(text)
        if pieces is None:
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif "".join(piece.text for piece in pieces) != text:
            raise ValueError("the chat's pieces do not make up its rendered text")
        else:
            token_ids = literal_text.encode(self.tokenizer, pieces)
        return self.process({"prompt": text, "prompt_token_ids": token_ids}, cache_salt, truncate_prompt_tokens)

    # ---- sampling parameters -------------------------------------------------------
    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the model's vocabulary and tokenizer,
        and the engine's seats."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.n > self.max_num_seqs:
            raise ParameterError("n", f"n={params.n} completions need more sequences than max_num_seqs="
                                      f"{self.max_num_seqs} lets run at once")
        self._check_in_vocab("stop_token_ids", "stop_token_ids", params.stop_token_ids)
        self._check_in_vocab("logit_bias", "logit_bias token ids", list(params.logit_bias))
        self._check_in_vocab("allowed_token_ids", "allowed_token_ids", params.allowed_token_ids or [])
        if (params.stop or params.bad_words) and self.tokenizer is None:
            raise ParameterError("stop" if params.stop else "bad_words",
                                 "stop strings and bad_words need a tokenizer, and this model has none; "
                                 "use stop_token_ids / logit_bias")

    def compile_constraint(self, params: SamplingParams) -> None:
        """Compile the output constraint (ValueError if it cannot be), so that the engine
        finds it in the shared cache: for callers off the engine thread (a compile can take
        seconds for a large schema, and xgrammar releases the GIL meanwhile)."""
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word as token ids, as vLLM tokenizes it: its text without leading spaces,
        and after one space where that is a word of the same length in tokens that starts
        with another token (so the word is banned at the start of the output and inside it)."""
        variants = []
        for word in params.bad_words:
            bare, spaced = (self.tokenizer.encode(text + word.lstrip(), add_special_tokens=False)
                            for text in ("", " "))
            variants.append(bare)
            if bare and len(spaced) == len(bare) and spaced[0] != bare[0]:
                variants.append(spaced)
        return [list(ids) for ids in dict.fromkeys(map(tuple, variants)) if ids]


def check_cache_salt(salt: object) -> None:
    """None, or a non-empty UTF-8 string of at most MAX_CACHE_SALT_CHARS characters (an empty
    one is refused, as vLLM refuses it: it would name a tenant of its own, unlike no salt)."""
    if salt is None:
        return
    if not isinstance(salt, str):
        raise TypeError(f"cache_salt must be a string, got {type(salt).__name__}")
    if not salt:
        raise ValueError("cache_salt must be a non-empty string when given")
    check_utf8("cache_salt", salt)
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt may hold at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")


def normalize_conversation(conversation: Conversation) -> Conversation:
    """The messages with content as one string: a list of text parts ({"type": "text",
    "text": ...}, as OpenAI sends them) is joined with newlines, as vLLM does; null content
    (an assistant message) is empty. Raises ValueError for anything else."""
    if isinstance(conversation, (str, Mapping)) or not isinstance(conversation, Sequence) or not conversation:
        raise ValueError("a conversation must be a non-empty list of {'role', 'content'} messages")
    return [_normalize_message(message) for message in conversation]


def check_conversation(conversation: Conversation) -> None:
    """Raise ValueError unless render_chat can take the conversation."""
    normalize_conversation(conversation)


def _normalize_message(message: object) -> dict:
    """Content may be missing or null only in an assistant message (one that made tool calls)."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"each chat message needs 'role' and 'content', got {message!r:.200}")
    role, content = message["role"], message.get("content")
    if "content" not in message and role != "assistant":
        raise ValueError(f"each chat message needs 'role' and 'content', got {message!r:.200}")
    if not isinstance(role, str):
        raise ValueError(f"a chat message's role must be a string, got {type(role).__name__}")
    if content is None and role == "assistant":
        content = ""
    elif isinstance(content, list):
        content = "\n".join(_text_of(part) for part in content)
    elif not isinstance(content, str):
        raise ValueError(f"chat message content must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    return {**message, "content": content}


def _text_of(part: object) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, got {part!r:.200}")
    return part["text"]


def _longest_token_chars(tokenizer) -> int:
    """The most characters one token string of the vocabulary has (16 without a tokenizer)."""
    if tokenizer is None:
        return 16
    return max((len(token) for token in tokenizer.get_vocab()), default=16)
