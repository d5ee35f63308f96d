"""Sampling parameters, named and defaulted as in vLLM's offline API."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from pagedrag.structured.params import StructuredOutputsParams
from pagedrag.text_checks import check_bool, check_float, check_int, check_utf8

logger = logging.getLogger("pagedrag")

# Limits on what one request may carry (vLLM-like; documented in the README).
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI and vLLM's default max_logprobs
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKEN_LIST = 1 << 17  # logit_bias entries / allowed_token_ids (a large vocabulary's size)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes
GREEDY_TEMPERATURE = 1e-5  # below: greedy (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-2  # below, and above GREEDY_TEMPERATURE: raised to this (vLLM's _MAX_TEMP)


class RequestOutputKind(enum.IntEnum):
    """What a streamed request yields, as vLLM's: every output so far (CUMULATIVE), only what
    is new since the last one (DELTA), or only the finished output (FINAL_ONLY). LLM.generate
    returns finished outputs whatever the kind."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class ParameterError(ValueError):
    """A sampling parameter out of its range; ``param`` names it (an OpenAI error's param)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    temperature == 0 (or below GREEDY_TEMPERATURE) is greedy decoding. ``seed`` makes a request's samples
    independent of whatever else shares its batch. ``n`` completions are sampled
    per prompt; they fork the prompt's KV blocks (copy-on-write).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top logprobs per prompt token (0: only the token's own)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # as vLLM with a fast tokenizer: see _check_types
    detokenize: bool = True  # False: token ids only (text "", no stop strings)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words never generated (their last token is banned in context)
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    structured_outputs: StructuredOutputsParams | dict | None = None  # the output's shape (a grammar)
    guided_decoding: StructuredOutputsParams | dict | None = None  # vLLM's older name for structured_outputs
    extra_args: dict | None = None  # kept for plugins, as vLLM keeps them; nothing in pagedrag reads them
    # pagedrag's extension: False keeps this request from drafting when the engine has a speculative_config
    speculative_decoding: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {check_int("a logit_bias token id", int(k) if isinstance(k, str) and k.isdigit() else k):
                           check_float("a logit_bias value", v) for k, v in (self.logit_bias or {}).items()}
        if self.allowed_token_ids is not None:  # None: every token; an empty list would allow none
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ParameterError("allowed_token_ids", "allowed_token_ids must not be empty (None: every token)")
        self.bad_words = list(self.bad_words or [])
        self._settle_structured_outputs()
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self._settle_temperature()

    def _settle_structured_outputs(self) -> None:
        """``guided_decoding`` is moved to ``structured_outputs`` (dicts become params)."""
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or its older name guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)

    def _check_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            check_int(name, getattr(self, name))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            check_float(name, getattr(self, name))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative_decoding",
                     "spaces_between_special_tokens", "detokenize"):
            check_bool(name, getattr(self, name))
        self.output_kind = self._output_kind(self.output_kind)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise TypeError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")
        if not self.spaces_between_special_tokens and not self.skip_special_tokens:
            logger.warning("spaces_between_special_tokens=False changes no text here: pagedrag detokenizes with "
                           "the model's fast tokenizer, as vLLM does for fast tokenizers, which ignores it")
        for token_id in self.stop_token_ids:
            check_int("stop_token_ids", token_id)
        for token_id in self.allowed_token_ids or ():
            check_int("allowed_token_ids", token_id)
        for word in self.bad_words:
            if not isinstance(word, str) or not word:
                raise TypeError("bad_words must hold non-empty strings")
            check_utf8("a bad word", word)
        for stop in self.stop:
            if not isinstance(stop, str):
                raise TypeError(f"stop must hold strings, got {type(stop).__name__}")
            check_utf8("a stop string", stop)

    @staticmethod
    def _output_kind(value: object) -> RequestOutputKind:
        """A RequestOutputKind (vLLM's or pagedrag's enum, or its name or number)."""
        name = getattr(value, "name", value)
        try:
            return RequestOutputKind[name] if isinstance(name, str) else RequestOutputKind(check_int("output_kind", name))
        except (KeyError, ValueError):
            raise ParameterError("output_kind", f"output_kind must be one of {[k.name for k in RequestOutputKind]}, "
                                                f"got {value!r}") from None

    def _validate(self) -> None:
        checks = [
            ("n", self.n >= 1, f"n must be at least 1, got {self.n}"),
            ("temperature", self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            ("top_p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= 0, f"top_k must be -1 (disabled) or at least 1, got {self.top_k}"),
            ("min_p", 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            ("repetition_penalty", 0 < self.repetition_penalty < float("inf"),
             f"repetition_penalty must be a finite number above 0, got {self.repetition_penalty}"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            ("min_tokens", self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}] (vLLM's default max_logprobs; -1, every token, "
             f"is past it), got {self.logprobs}"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (vLLM's default max_logprobs; -1, every token, "
             f"is past it), got {self.prompt_logprobs}"),
            ("seed", self.seed is None or SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1),
             f"seed must be in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] with n={self.n} (completion i uses "
             f"seed + i, and each must be in [{SEED_MIN}, {SEED_MAX}]), got {self.seed}"),
            ("stop", all(self.stop), "stop strings must not be empty"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS,
             f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"),
            ("stop", all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
             f"a stop string may hold at most {MAX_STOP_STRING_CHARS} characters"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}"),
            ("logit_bias", all(-100 <= v <= 100 for v in self.logit_bias.values()),
             "logit_bias values must be in [-100, 100]"),
            ("logit_bias", len(self.logit_bias) <= MAX_TOKEN_LIST, f"at most {MAX_TOKEN_LIST} logit_bias entries"),
            ("allowed_token_ids", len(self.allowed_token_ids or ()) <= MAX_TOKEN_LIST,
             f"at most {MAX_TOKEN_LIST} allowed_token_ids"),
            ("bad_words", len(self.bad_words) <= MAX_STOP_STRINGS
             and all(len(w) <= MAX_STOP_STRING_CHARS for w in self.bad_words),
             f"at most {MAX_STOP_STRINGS} bad_words of at most {MAX_STOP_STRING_CHARS} characters"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
             f"truncate_prompt_tokens must be at least 1, or -1 (the longest prompt the engine takes), "
             f"got {self.truncate_prompt_tokens}"),
            ("stop", self.detokenize or not self.stop, "stop strings need detokenize=True (they match the text)"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise ParameterError(param, message)

    def _settle_temperature(self) -> None:
        """Below GREEDY_TEMPERATURE sampling is greedy (a division by ~1e-40 would overflow
        the logits to inf and sample noise); up to MIN_TEMPERATURE it is raised to that, as
        vLLM does, with a warning."""
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        elif self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %g is below %g, which may overflow the logits; using %g",
                           self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


@dataclass
class BeamSearchParams:
    """Beam search as vLLM's LLM.beam_search takes it."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be in [1, {MAX_LOGPROBS // 2}] (each round asks for "
                             f"2 * beam_width <= {MAX_LOGPROBS} logprobs), got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
