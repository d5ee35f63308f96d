"""Each step's token masks: which tokens a constrained sequence may sample next.

The masks are filled on the host from each sequence's xgrammar GrammarMatcher (the
grammar's state after the tokens it has accepted) while the device runs the step's
forward pass, and go over in one copy; the sampler applies them to the logits. With
speculative decoding a constrained request's draft is cut where its grammar refuses it
(``grammar_prefix``), and each of its verification rows gets the mask of the grammar's
state after the drafted tokens before it (``fill_draft_masks``): the matcher itself only
ever advances on verified tokens.
"""

from __future__ import annotations

import torch

from pagedrag.worker.transfer import host_to_device, tensor_to_device


def fill_masks(matchers: list, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, bitmask) for the constrained rows of a batch, on ``device``; None when no row is.

    ``matchers[i]`` is row i's GrammarMatcher or None. ``bitmask`` is [len(rows),
    ceil(vocab / 32)] int32, xgrammar's packing: bit j of word w allows token 32 w + j.
    """
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return None
    import xgrammar  # only where a row is constrained: an engine without grammars never needs it
    bitmask = xgrammar.allocate_token_bitmask(len(rows), vocab_size)
    for index, row in enumerate(rows):
        matchers[row].fill_next_token_bitmask(bitmask, index)
    return host_to_device(rows, torch.long, device), tensor_to_device(bitmask, device)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The packed bitmask [R, W] unpacked to booleans [R, vocab_size] (True: allowed)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def grammar_prefix(matcher, draft: list[int], refused: frozenset[int] = frozenset()) -> list[int]:
    """The longest prefix of a speculative ``draft`` that ``matcher``'s grammar accepts and
    that leaves it unterminated (a terminated grammar has no mask for the row after).
    ``refused``: tokens the grammar never accepts, cut without asking it (the compiler's
    ``special_token_ids``: xgrammar warns on stderr at each one). The matcher is left as it
    was found."""
    fed = 0
    for token in draft:
        if token in refused or not matcher.accept_token(token):
            break
        fed += 1
        if matcher.is_terminated():
            break
    kept = fed - 1 if fed and matcher.is_terminated() else fed
    if fed:
        matcher.rollback(fed)
    return draft[:kept]


def fill_draft_masks(matchers: list, drafts: list[list[int]], vocab_size: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fill_masks`` for the verification rows of speculative decoding: request i has
    len(drafts[i]) + 1 rows, and its row j is masked by its grammar's state after drafts[i][:j]
    (a draft ``grammar_prefix`` cut, so the grammar accepts all of it). Matchers are left as
    they were found."""
    spans, first_row = [], 0
    for matcher, draft in zip(matchers, drafts):
        if matcher is not None:
            spans.append((first_row, matcher, draft))
        first_row += len(draft) + 1
    if not spans:
        return None
    import xgrammar
    rows = [start + j for start, _, draft in spans for j in range(len(draft) + 1)]
    bitmask = xgrammar.allocate_token_bitmask(len(rows), vocab_size)
    index = 0
    for _, matcher, draft in spans:
        for j in range(len(draft) + 1):
            matcher.fill_next_token_bitmask(bitmask, index)
            index += 1
            if j < len(draft) and not matcher.accept_token(draft[j]):
                matcher.rollback(j)
                raise ValueError(f"drafted token {draft[j]} does not fit the grammar: the draft was not cut")
        if draft:
            matcher.rollback(len(draft))
    return host_to_device(rows, torch.long, device), tensor_to_device(bitmask, device)
