"""The token lists of a request's SamplingParams that the sampler applies at every step
(``logit_bias``, ``allowed_token_ids``), as host tensors made once per params object.

Rebuilding them from Python dicts and lists at every step cost time linear in their length
for every row of every step (a 131k-entry logit_bias: ~200 ms a step, for the whole batch).
A params object's tables are made at its first step and dropped when the object is
garbage-collected; a params object changed after its request was added keeps the tables of
its first step (as vLLM, which copies the params when a request is added).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from pagedrag.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenTables:
    bias_ids: torch.Tensor | None  # int64 [K]: logit_bias's token ids (None: no logit_bias)
    bias_values: torch.Tensor | None  # float32 [K]: what is added to each
    allowed_ids: torch.Tensor | None  # int64 [A]: allowed_token_ids (None: every token)

    @classmethod
    def of(cls, params: SamplingParams) -> TokenTables:
        bias = params.logit_bias or {}
        return cls(torch.tensor(list(bias.keys()), dtype=torch.int64) if bias else None,
                   torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None,
                   torch.tensor(params.allowed_token_ids, dtype=torch.int64) if params.allowed_token_ids else None)


class TokenTableCache:
    """TokenTables by params object (identity), each kept while its object lives."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, TokenTables]] = {}

    def get(self, params: SamplingParams) -> TokenTables:
        key = id(params)
        entry = self._by_id.get(key)
        if entry is not None and entry[0]() is params:
            return entry[1]
        tables = TokenTables.of(params)
        self._by_id[key] = (weakref.ref(params, lambda _, key=key: self._by_id.pop(key, None)), tables)
        return tables


TABLES = TokenTableCache()  # one per process: what it holds is a function of the params objects alone
