"""Each step's token masks: which tokens a constrained sequence may sample next.

The masks are filled on the host from each sequence's xgrammar GrammarMatcher (the
grammar's state after the tokens it has accepted) while the device runs the step's
forward pass, and go over in one copy; the sampler applies them to the logits.
"""

from __future__ import annotations

import torch

from pagedrag.worker.transfer import host_to_device


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
    return host_to_device(rows, torch.long, device), _to_device(bitmask, device)


def _to_device(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return bitmask
    return bitmask.pin_memory().to(device, non_blocking=True)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The packed bitmask [R, W] unpacked to booleans [R, vocab_size] (True: allowed)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()
