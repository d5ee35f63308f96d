"""Which running requests draft this step, how many tokens, and what came of it.

Gates (drafting must not cost where it does not pay):
- no request drafts while more than ``disable_by_batch_size`` requests run;
- a request drafts only if its SamplingParams allow it (``speculative_decoding=False`` opts
  out); a structured request's draft is cut at the first token its grammar refuses (and
  before a token that would complete it), and its matcher only advances on verified tokens;
- each request's draft limit follows its recent acceptance: it starts at
  num_speculative_tokens; after a rejection it drops to one more than the tokens accepted,
  and after a fully accepted draft it grows to twice that draft's length (never shrinking,
  never above num_speculative_tokens).
"""

from __future__ import annotations

from pagedrag.core.request import Request
from pagedrag.outputs import SpecDecodeCounts
from pagedrag.spec_decode.config import SpeculativeConfig
from pagedrag.spec_decode.ngram import NgramProposer
from pagedrag.spec_decode.suffix import SuffixProposer
from pagedrag.structured.compiler import GrammarCompiler
from pagedrag.structured.masks import grammar_prefix


def make_proposer(config: SpeculativeConfig) -> NgramProposer | SuffixProposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)


class Drafter:
    """Owns the proposer, the per-request draft limits and the engine-wide counts.

    Invariant: ``limits`` and the proposer hold state only for requests that have not
    finished (``finish`` drops it)."""

    def __init__(self, config: SpeculativeConfig, grammars: GrammarCompiler | None = None):
        self.config = config
        self.grammars = grammars  # of the engine's structured requests: which tokens no grammar takes
        self.proposer = make_proposer(config)
        self.limits: dict[str, int] = {}
        self.stats = SpecDecodeCounts()

    def draft(self, request: Request, room: int, batch_size: int) -> list[int]:
        """Tokens to verify after the request's next one: at most ``room`` (what its
        max_tokens, max_model_len and the step's budget leave), [] when gated."""
        if batch_size > self.config.disable_by_batch_size or not request.params.speculative_decoding:
            return []
        limit = min(room, self.limits.get(request.request_id, self.config.num_speculative_tokens))
        draft = self.proposer.propose(request, limit) if limit > 0 else []
        if request.grammar is None or not draft:
            return draft
        return grammar_prefix(request.grammar, draft, self.grammars.special_token_ids if self.grammars else frozenset())

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """A verified draft: count it (engine-wide and on the request) and adapt the limit. A
        pipelined step verifies every row, also one whose lookup found nothing: no draft."""
        if num_drafted == 0:
            return
        self.stats.record(num_drafted, num_accepted)
        if request.spec_decode is None:
            request.spec_decode = SpecDecodeCounts()
        request.spec_decode.record(num_drafted, num_accepted)
        full = self.config.num_speculative_tokens
        limit = self.limits.get(request.request_id, full)
        self.limits[request.request_id] = min(full, max(limit, 2 * num_drafted)) if num_accepted == num_drafted \
            else num_accepted + 1

    def finish(self, request: Request) -> None:
        self.limits.pop(request.request_id, None)
        self.proposer.finish(request)
