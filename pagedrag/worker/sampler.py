"""Turn each sequence's last-position logits into its next token.

One step, for a batch of N rows (one per sampling sequence) over a vocabulary of V, in
vLLM's order:

1. logprobs (``logprobs_mode`` "raw_logprobs", the default) are read from log_softmax(raw
   logits), before anything below changes them;
2. processed logits = raw logits with tokens outside allowed_token_ids at -inf, banned
   tokens at -inf (the token that would complete a bad word; stop and EOS tokens under
   min_tokens), logit_bias added, then the penalties (repetition, then frequency and
   presence), and tokens a row's grammar does not allow now at -inf (structured outputs);
3. greedy rows (temperature 0) take argmax(processed logits), exactly;
4. other rows: divide by temperature, then min-p, top-k, then top-p (over the top-k
   renormalised), and sample with the exponential race argmax(probs / E), E ~ Exp(1)
   i.i.d. per token.

The other logprobs modes read "raw_logits" (the raw logits themselves), or the row's
logits after everything it was sampled under, as logprobs or logits ("processed_logprobs",
"processed_logits": step 2, and for a sampled row step 4's temperature and filters too).

Invariants:
- Everything is batched tensor work on the logits' device; the only python loop
  is over rows with their own torch.Generator, each drawing its own noise.
- A row's result depends only on its own logits, parameters and generator, never on
  its batch neighbours: neutral parameters (k = 0, p = 1, min_p = 0, penalties off)
  leave logits bit-identical, and a seeded row's noise comes from its generator only.
- Nothing here copies from device to host but ``SamplerOutput.to_host``; a caller that
  reads the samples later copies ``SamplerOutput.table()`` (one transfer) and unpacks
  it with ``unpack_samples`` (the model runner's InflightTokens does so).
- The caller's logits tensor is never modified.

Use per step: ``batch = SamplingBatch.from_params(...)`` (its small host->device copies
are non-blocking on CUDA), then ``samples = Sampler()(logits, batch).to_host()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrag.sampling_params import SamplingParams
from pagedrag.structured.masks import allowed_tokens
from pagedrag.worker.token_tables import TABLES
from pagedrag.worker.transfer import host_to_device, tensor_to_device


@dataclass
class SamplingBatch:
    """The sampling parameters of one step's rows, as tensors on the logits device.

    Built once per step by the model runner with ``from_params``. Row i of every field
    belongs to row i of the logits. Host-side flags let the sampler skip stages that
    no row needs without reading tensors back from the device.
    """

    temperatures: torch.Tensor  # [N] float32; 0 = greedy
    top_ks: torch.Tensor  # [N] int64; 0 = off
    top_ps: torch.Tensor  # [N] float32; 1 = off
    min_ps: torch.Tensor  # [N] float32; 0 = off
    generators: list[torch.Generator | None]  # per row; None = global RNG (always None when greedy)
    num_logprobs: list[int]  # per row, how many top logprobs it asked for (0 = none)
    penalties: Penalties | None = None  # None when no row uses penalties
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) forced to -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, values) added
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (restricted rows, rows, ids)
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None  # (constrained rows, their token bitmask)
    all_greedy: bool = False
    needs_top_k_top_p: bool = False
    needs_min_p: bool = False
    needs_ranks: bool = False  # some row asked for logprobs (ranks cost a pass over [N, V])

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prompt_token_ids: list[list[int] | torch.Tensor],
        output_token_ids: list[list[int]],
        device: torch.device | str,
        eos_token_ids: frozenset[int] = frozenset(),
        bad_words_token_ids: list[list[list[int]]] | None = None,
        grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplingBatch:
        """Gather the parameters of N >= 1 rows into tensors.

        ``generators[i]`` must live on ``device`` (``torch.Generator(device)``), and is
        kept by the caller across steps. ``output_token_ids[i]`` are the tokens row i
        generated so far: they drive the penalties and the min_tokens ban, which keeps
        ``stop_token_ids`` and every id of ``eos_token_ids`` (unless ignore_eos) from being
        sampled while fewer than ``min_tokens`` tokens were generated. ``bad_words_token_ids[i]`` are
        row i's bad words as token sequences (the engine tokenizes SamplingParams.bad_words).
        ``grammar`` is (rows, bitmask) from ``pagedrag.structured.masks.fill_masks``.
        """
        sampled = [not p.greedy for p in params]
        table = [[p.temperature, p.top_k, p.top_p, p.min_p] for p in params]
        temperatures, top_ks, top_ps, min_ps = _to_columns(table, device)
        return cls(
            temperatures=temperatures,
            top_ks=top_ks.long(),
            top_ps=top_ps,
            min_ps=min_ps,
            generators=[g if s else None for g, s in zip(generators, sampled)],
            num_logprobs=[p.logprobs or 0 for p in params],
            needs_ranks=any(p.logprobs is not None for p in params),
            penalties=Penalties.from_params(params, prompt_token_ids, output_token_ids, device),
            banned=_banned(params, output_token_ids, eos_token_ids, bad_words_token_ids, device),
            bias=_logit_bias(params, device),
            allowed=_allowed(params, device),
            grammar=grammar,
            all_greedy=not any(sampled),
            needs_top_k_top_p=any(s and (p.top_k > 0 or p.top_p < 1) for p, s in zip(params, sampled)),
            needs_min_p=any(s and p.min_p > 0 for p, s in zip(params, sampled)),
        )

    @property
    def max_num_logprobs(self) -> int:
        return max(self.num_logprobs, default=0)


@dataclass
class Penalties:
    """Repetition, frequency and presence penalties of a batch (OpenAI / vLLM semantics).

    - repetition r: a token seen in the prompt or the output has its logit divided by
      r when positive, multiplied by r when negative;
    - frequency f and presence p: logit -= f * count + p * (count > 0), where count is
      the token's number of occurrences in the output (the prompt does not count).
    """

    repetition: torch.Tensor  # [N, 1]; 1 = off
    frequency: torch.Tensor  # [N, 1]; 0 = off
    presence: torch.Tensor  # [N, 1]; 0 = off
    prompt_token_ids: list[list[int] | torch.Tensor]  # each a list or an int64 host tensor
    output_token_ids: list[list[int]]

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int] | torch.Tensor],
        output_token_ids: list[list[int]],
        device: torch.device | str,
    ) -> Penalties | None:
        """The batch's penalties, or None when no row uses any."""
        if not any(p.uses_penalties for p in params):
            return None
        table = [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params]
        repetition, frequency, presence = _to_columns(table, device)
        return cls(
            repetition=repetition.unsqueeze(1),
            frequency=frequency.unsqueeze(1),
            presence=presence.unsqueeze(1),
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return penalised logits; rows with neutral values come back bit-identical."""
        vocab_size, device = logits.shape[1], logits.device
        output_counts = _token_counts(self.output_token_ids, vocab_size, device)
        in_output = output_counts > 0
        seen = in_output | (_token_counts(self.prompt_token_ids, vocab_size, device) > 0)
        repeated = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(seen, repeated, logits)
        return logits - self.frequency * output_counts - self.presence * in_output.float()


def _to_columns(rows: list[list[float]], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """The columns of a per-row table (N >= 1 rows) as float32 tensors [N] on device, in one copy."""
    return host_to_device(rows, torch.float32, device).unbind(1)


def _token_counts(token_ids: list, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, V] float32 occurrence counts of each row's token ids, a list or an int64 host tensor
    (one host->device copy; no Python work per token)."""
    flat = torch.cat([torch.as_tensor(ids, dtype=torch.int64) for ids in token_ids])
    rows = torch.arange(len(token_ids)).repeat_interleave(torch.tensor([len(ids) for ids in token_ids]))
    index = tensor_to_device(torch.stack((rows, flat)), device)
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)
    ones = torch.ones(len(flat), dtype=torch.float32, device=device)
    return counts.index_put_(tuple(index), ones, accumulate=True)


def _banned(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: frozenset[int],
    bad_words_token_ids: list[list[list[int]]] | None,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) that must not be sampled now, or None: stop tokens while a row has
    fewer than min_tokens (unless its output is constrained: a complete grammar allows only
    the stop tokens, and wins), and each bad word's last token when the output ends with
    the word's other tokens (a one-token bad word is always banned)."""
    pairs = []
    for row, (p, output) in enumerate(zip(params, output_token_ids)):
        if len(output) < p.min_tokens and p.structured_outputs is None:
            stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | eos_token_ids
            pairs.extend((row, token) for token in sorted(stops))
        for word in (bad_words_token_ids[row] if bad_words_token_ids else ()):
            if len(word) == 1 or output[len(output) - len(word) + 1:] == word[:-1]:
                pairs.append((row, word[-1]))
    if not pairs:
        return None
    rows, tokens = host_to_device(pairs, torch.long, device).unbind(1)
    return rows, tokens


def _logit_bias(params: list[SamplingParams], device: torch.device | str):
    """(rows, token ids, values) of every row's logit_bias, or None (from each params object's
    TokenTables: no per-entry Python work at a step)."""
    tables = [(row, TABLES.get(p)) for row, p in enumerate(params) if p.logit_bias]
    if not tables:
        return None
    rows = _rows_of([(row, t.bias_ids) for row, t in tables])
    tokens = torch.cat([t.bias_ids for _, t in tables])
    values = torch.cat([t.bias_values for _, t in tables])
    return tensor_to_device(rows, device), tensor_to_device(tokens, device), tensor_to_device(values, device)


def _allowed(params: list[SamplingParams], device: torch.device | str):
    """(rows that restrict their tokens, rows, allowed token ids), or None."""
    tables = [(row, TABLES.get(p)) for row, p in enumerate(params) if p.allowed_token_ids]
    if not tables:
        return None
    restricted = host_to_device([row for row, _ in tables], torch.long, device)
    rows = _rows_of([(row, t.allowed_ids) for row, t in tables])
    return restricted, tensor_to_device(rows, device), tensor_to_device(torch.cat([t.allowed_ids for _, t in tables]),
                                                                        device)


def _rows_of(entries: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The row of each element of the row tensors, concatenated: row r repeated len(tensor) times."""
    rows = torch.tensor([row for row, _ in entries], dtype=torch.int64)
    return rows.repeat_interleave(torch.tensor([len(tensor) for _, tensor in entries]))


@dataclass
class Sample:
    """One row's result on the host."""

    token_id: int
    logprob: float  # of token_id, as the logprobs mode reports it (raw logprobs by default)
    rank: int  # of token_id among those values (1 = the most likely; 0 when no row asked for logprobs)
    top_logprobs: dict[int, float]  # the row's num_logprobs most likely tokens, best first


@dataclass
class SamplerOutput:
    """One step's sampled tokens, still on the logits device.

    ``top_token_ids`` / ``top_logprobs`` hold ``max(num_logprobs)`` columns, best
    first; a row that asked for fewer uses only its first columns.
    """

    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] float32
    ranks: torch.Tensor  # [N] int64
    top_token_ids: torch.Tensor | None  # [N, k] int64
    top_logprobs: torch.Tensor | None  # [N, k] float32
    num_logprobs: list[int]  # per row

    def to_host(self) -> list[Sample]:
        """Copy everything to the host and wait for it."""
        return unpack_samples(self.table().cpu(), self.num_logprobs)

    def table(self) -> torch.Tensor:
        """Everything in one tensor [N, 3 + 2k] float64 (exact for token ids) on the device, so
        that one transfer brings it to the host: token, logprob, rank, top ids (k), top logprobs (k)."""
        columns = [self.token_ids.unsqueeze(1), self.logprobs.unsqueeze(1), self.ranks.unsqueeze(1)]
        if self.top_token_ids is not None:
            columns += [self.top_token_ids, self.top_logprobs]
        return torch.cat([c.to(torch.float64) for c in columns], dim=1)


def unpack_samples(table: torch.Tensor, num_logprobs: list[int]) -> list[Sample]:
    """The samples of a ``SamplerOutput.table()`` on the host; row i keeps num_logprobs[i] top ones."""
    return [_row_sample(row, n) for row, n in zip(table.tolist(), num_logprobs)]


def _row_sample(row: list[float], num_logprobs: int) -> Sample:
    """Unpack [token, logprob, rank, top ids (k), top logprobs (k)] keeping num_logprobs of the top."""
    k = (len(row) - 3) // 2
    top_ids, top_logprobs = row[3:3 + num_logprobs], row[3 + k:3 + k + num_logprobs]
    return Sample(int(row[0]), row[1], int(row[2]), {int(t): lp for t, lp in zip(top_ids, top_logprobs)})


class Sampler:
    """Stateless: all per-request state (generators, history) lives in SamplingBatch.
    ``logprobs_mode``: what logprobs report (EngineArgs.logprobs_mode; see the module doc)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs"):
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of ``logits`` [N, V]."""
        raw = logits.float()
        processed = process_logits(raw, batch)
        greedy_ids = processed.argmax(dim=-1)
        filtered = None
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            filtered = filter_logits(processed, batch)
            token_ids = torch.where(batch.temperatures == 0, greedy_ids, sample_from(filtered, batch.generators))
        return with_logprobs(*reported_values(self.logprobs_mode, raw, processed, filtered, batch), token_ids, batch)


def reported_values(mode: str, raw: torch.Tensor, processed: torch.Tensor, filtered: torch.Tensor | None,
                    batch: SamplingBatch) -> tuple[torch.Tensor, bool]:
    """(the values logprobs report, whether they are normalised into logprobs) in ``mode``:
    the raw logits, or each row's logits as it was sampled (``filtered`` for rows that sample,
    ``processed`` for greedy ones)."""
    values = raw
    if mode.startswith("processed"):
        values = processed if filtered is None else torch.where((batch.temperatures == 0).unsqueeze(1),
                                                                 processed, filtered)
    return values, mode.endswith("logprobs")


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """allowed_token_ids, the bans, logit_bias, the penalties and the grammars, in vLLM's
    order: the logits greedy sees."""
    if batch.allowed is not None:
        logits = logits.masked_fill(_outside_allowed(logits, *batch.allowed), float("-inf"))
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, logits.new_tensor(float("-inf")))
    if batch.bias is not None:
        rows, tokens, values = batch.bias
        logits = logits.index_put((rows, tokens), values, accumulate=True)
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)
    if batch.grammar is not None:
        logits = logits.masked_fill(_outside_grammar(logits, *batch.grammar), float("-inf"))
    return logits


def _outside_grammar(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """True for the tokens a constrained row's grammar does not allow next."""
    blocked = torch.zeros_like(logits, dtype=torch.bool)
    blocked[rows] = ~allowed_tokens(bitmask, logits.shape[1])
    return blocked


def _outside_allowed(logits: torch.Tensor, restricted: torch.Tensor, rows: torch.Tensor,
                     tokens: torch.Tensor) -> torch.Tensor:
    """True for the tokens a restricted row may not sample."""
    blocked = torch.zeros_like(logits, dtype=torch.bool)
    blocked[restricted] = True
    blocked[rows, tokens] = False
    return blocked


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (vLLM's order); removed tokens get -inf logits."""
    temperatures = torch.where(batch.temperatures == 0, 1.0, batch.temperatures)
    logits = logits / temperatures.unsqueeze(1)
    if batch.needs_min_p:
        logits = logits.masked_fill(_min_p_mask(logits, batch.min_ps), float("-inf"))
    if batch.needs_top_k_top_p:
        logits = logits.masked_fill(_top_k_top_p_mask(logits, batch.top_ks, batch.top_ps), float("-inf"))
    return logits


def _top_k_top_p_mask(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """True for tokens outside a row's top-k, or outside its top-p nucleus.

    Top-k keeps exactly k tokens (ties broken by sort order). Top-p keeps the smallest
    prefix of the top-k tokens, by descending probability renormalised over them, whose
    mass reaches p; the most likely token is always kept. k = 0 and p = 1 mask nothing.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    mask = (ranks >= top_ks.unsqueeze(1)) & (top_ks > 0).unsqueeze(1)
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    mask |= (mass_before >= top_ps.unsqueeze(1)) & (top_ps < 1).unsqueeze(1)
    return torch.zeros_like(mask).scatter_(1, order, mask)


def _min_p_mask(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """True where prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    max_logits = logits.max(dim=-1, keepdim=True).values
    return logits < max_logits + min_ps.log().unsqueeze(1)


def sample_from(logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exponential race: argmax(probs / E) with E ~ Exp(1) is a draw from probs.

    Rows with a generator fill their noise row from it alone, so the row's draw is
    the same whatever shares the batch. E is clamped away from 0 so that a zero-prob
    token can never win through 0 / 0.
    """
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def with_logprobs(values: torch.Tensor, normalised: bool, token_ids: torch.Tensor,
                  batch: SamplingBatch) -> SamplerOutput:
    """The reported value of each sampled token (``values`` as logprobs when ``normalised``, else
    as they are: see reported_values), its rank, and the top ones when any row asked for them."""
    log_norm = values.logsumexp(dim=-1) if normalised else values.new_zeros(values.shape[0])
    chosen = values.gather(1, token_ids.unsqueeze(1))
    logprobs = chosen.squeeze(1) - log_norm
    # rank 0 means "not computed": only rows that asked for logprobs read it
    ranks = (values > chosen).sum(dim=-1) + 1 if batch.needs_ranks else torch.zeros_like(token_ids)
    top_token_ids = top_logprobs = None
    if batch.max_num_logprobs > 0:
        top = values.topk(batch.max_num_logprobs, dim=-1)
        top_token_ids, top_logprobs = top.indices, top.values - log_norm.unsqueeze(1)
    return SamplerOutput(token_ids, logprobs, ranks, top_token_ids, top_logprobs, batch.num_logprobs)
