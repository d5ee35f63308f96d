"""Pure-torch reference implementations of the paged KV kernels.

These run the engine on CPU and are the ground truth the Triton kernels are
tested against; every Triton kernel in this package has the same signature as
its reference here.

Cache layout (one tensor each for K and V, per layer):
    [num_blocks, block_size, num_kv_heads, head_dim]
A token at position p of a sequence lives in block ``block_table[p // block_size]``
at row ``p % block_size``; its flat slot is ``block * block_size + row``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write K/V rows [T, kv_heads, head_dim] into their slots; slot -1 skips the row."""
    if bool((slot_mapping < 0).any()):  # padded rows: keep the others
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence over its whole cached context.

    query [B, heads, head_dim]; block_tables [B, max_blocks] (int32, padded with
    any valid block id); context_lens [B] (int32, >= 1, the current token included).
    Returns [B, heads, head_dim]. Sequence by sequence through torch's fused CPU
    attention (SDPA), in float32 for lower-precision caches (float64, the kernel tests' ground
    truth, stays float64). Grouped-query attention without repeating K/V: the query heads that
    share a KV head (consecutive ones) go in as that head's query rows, which ran a quarter
    faster than SDPA's enable_gqa (SmolLM2's heads, 800-1,600 cached tokens, 2-core EPYC).
    Each sequence's context is read as ``_contexts`` says (a view, or one gather).
    """
    out = torch.empty_like(query)
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    num_heads, head_dim = query.shape[1], query.shape[2]
    for b, context in enumerate(_contexts(block_tables, context_lens, k_cache.shape[1])):
        keys, values = context.keys_and_values(k_cache, v_cache, dtype)
        grouped = query[b].view(1, keys.shape[1], -1, head_dim).to(dtype)  # [1, kv_heads, heads per kv head, dim]
        attended = F.scaled_dot_product_attention(grouped, keys, values, scale=scale)
        out[b] = attended.view(num_heads, head_dim)
    return out


@dataclass(frozen=True)
class _Context:
    """Where one sequence's cached rows are: ``first`` block of a run of consecutive block
    ids (the common case: the rows are one view of the cache), or else the flat ``slots`` to
    gather (one index_select, whatever the number of pieces). A step's contexts serve all its
    layers (``_contexts``), and so do the causal masks they make (``masks``, by query length)."""

    length: int
    first: int | None
    slots: torch.Tensor | None
    masks: dict = field(default_factory=dict, compare=False)

    def causal_mask(self, q_len: int, device: torch.device) -> torch.Tensor:
        """[q_len, length] bool: new token i (at position length - q_len + i) sees positions 0
        to its own. Made at the step's first layer (~40 us for 9 x 800 on 2 cores), then reused."""
        mask = self.masks.get(q_len)
        if mask is None:
            mask = torch.ones(q_len, self.length, dtype=torch.bool, device=device).tril_(self.length - q_len)
            self.masks[q_len] = mask
        return mask

    def keys_and_values(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's keys and values, [1, kv_heads, length, head_dim] each in ``dtype``;
        gathered ones are valid until this thread's next call."""
        return tuple(self._rows(cache, buffer).transpose(0, 1)[None].to(dtype)
                     for buffer, cache in enumerate((k_cache, v_cache)))

    def _rows(self, cache: torch.Tensor, buffer: int) -> torch.Tensor:
        """The sequence's rows of ``cache`` [num_blocks, block_size, kv_heads, head_dim]:
        [length, kv_heads, head_dim]. Gathered rows go into this thread's gather buffer number
        ``buffer`` (0 for keys, 1 for values)."""
        block_size = cache.shape[1]
        if self.first is not None:
            return cache[self.first:self.first - (-self.length // block_size)].flatten(0, 1)[:self.length]
        flat = cache.flatten(0, 1)
        if flat.device.type != "cpu":  # a CUDA graph may hold a buffer past its growth: allocate
            return flat.index_select(0, self.slots)
        return torch.index_select(flat, 0, self.slots, out=_gather_buffer(buffer, self.length, flat))


_gather_buffers = threading.local()


def _gather_buffer(number: int, length: int, like: torch.Tensor) -> torch.Tensor:
    """Rows [length, ...like's other dims] of a CPU buffer this thread keeps for gathers, grown
    as needed and reused by every layer and step: a recycled pool fragments most contexts, and a
    fresh 1-2 MB tensor for each of a step's 2 x layers gathers cost more than the copy (page
    faults; RESULTS.md, "Why CPU decode slows with context")."""
    buffers = _gather_buffers.__dict__.setdefault("by_key", {})
    key = (number, like.dtype, like.shape[1:])
    buffer = buffers.get(key)
    if buffer is None or buffer.shape[0] < length:
        rows = length if buffer is None else max(length, 2 * buffer.shape[0])
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buffer = buffers[key] = like.new_empty((rows, *like.shape[1:]))
    return buffer[:length]


_last_contexts: tuple = ()  # (block_tables, context_lens, block_size: copies of the last ones, contexts)


def _contexts(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> list[_Context]:
    """Each sequence's _Context. Every layer of a step passes the same tables, so the last
    answer is kept, with copies of the tables it was made from, and reused while the tables
    are equal to them: one plan a step, not one a layer (a comparison of two small tensors)."""
    global _last_contexts
    last = _last_contexts
    if last and last[2] == block_size and _same(last[0], block_tables) and _same(last[1], context_lens):
        return last[3]
    contexts = [_context(block_tables[b], length, block_size) for b, length in enumerate(context_lens.tolist())]
    _last_contexts = (block_tables.clone(), context_lens.clone(), block_size, contexts)
    return contexts


def _same(kept: torch.Tensor, given: torch.Tensor) -> bool:
    return kept.shape == given.shape and kept.device == given.device and torch.equal(kept, given)


def _context(table: torch.Tensor, length: int, block_size: int) -> _Context:
    blocks = table[:-(-length // block_size)].long()
    if len(blocks) <= 1 or bool((blocks[1:] - blocks[:-1] == 1).all()):
        return _Context(length, int(blocks[0]) if len(blocks) else 0, None)
    slots = (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).flatten()[:length]
    return _Context(length, None, slots)


def prefix_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                             context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """New tokens of many sequences (varlen) attend causally to their cached prefix and themselves.

    query [T, heads, head_dim] holds the new tokens of sequence b at rows
    query_start_loc[b]:query_start_loc[b+1]; their K/V are already stored in the
    cache. context_lens[b] is the sequence length after these tokens, so its new
    tokens sit at positions context_lens[b] - q_len .. context_lens[b] - 1.
    Returns [T, heads, head_dim]. The context is read as in paged_decode_attention (a view
    where its block ids run consecutively: for the few new tokens of a speculative
    verification step over ~800 cached tokens (SmolLM2's heads, 2-core EPYC) this took a third
    of the time of gathering the context first).
    """
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    starts = query_start_loc.tolist()
    for b, context in enumerate(_contexts(block_tables, context_lens, k_cache.shape[1])):
        q = query[starts[b]:starts[b + 1]]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        keys, values = context.keys_and_values(k_cache, v_cache, query.dtype)
        mask = context.causal_mask(q_len, query.device)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask[None, None],
                                           scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[starts[b]:starts[b + 1]] = o[0].transpose(0, 1)
    return out


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy-on-write: for each row (src, dst) of block_mapping [N, 2], copy block src to dst in every layer."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long().to(k_caches[0].device)
    dst = block_mapping[:, 1].long().to(k_caches[0].device)
    for cache in (*k_caches, *v_caches):
        cache[dst] = cache[src]


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Move blocks between two caches (e.g. GPU and CPU): dst[m[:,1]] = src[m[:,0]]."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long().to(src_cache.device)
    dst = block_mapping[:, 1].long().to(dst_cache.device)
    dst_cache[dst] = src_cache[src].to(dst_cache.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [..., H], optionally after adding ``residual``.

    HF's order of casts: the sum s = x + residual is in x's dtype, the norm in
    float32 rounded back to x's dtype, then scaled by weight [H] (the result has
    the promoted dtype of the two). Returns norm(x) * weight, or (norm(s) * weight, s).
    """
    if residual is not None:
        x = x + residual
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight
    return normed if residual is None else (normed, x)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate every head of q [T, Hq * head_dim] and k [T, Hk * head_dim] by its token's position.

    Neox layout (HF's rotate_half): x * cos + cat(-x2, x1) * sin per head, with
    cos/sin = cat(freqs, freqs) rounded to q's dtype; computed half by half, which
    rounds exactly as HF does (x1 * cos + (-x2) * sin == x1 * cos - x2 * sin).
    cos_sin_cache [max_pos, head_dim] float32 holds cos then sin (head_dim / 2 each)
    of position p in row p; positions [T]. q and k may be row-strided views (last dim contiguous).
    Returns the rotated (q, k): new tensors here, while the Triton version rotates
    in place and returns its inputs, so callers use the results and drop the inputs.
    q and k are rotated as one tensor of Hq + Hk heads: half the per-op costs, which
    dominate a decode step on CPU.
    """
    half = head_dim // 2
    cos_sin = cos_sin_cache.index_select(0, positions)[:, None, :]
    cos, sin = cos_sin[..., :half].to(q.dtype), cos_sin[..., half:].to(q.dtype)
    heads = torch.cat((q, k), dim=1).view(q.shape[0], -1, head_dim)
    first, second = heads[..., :half], heads[..., half:]
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).flatten(1)
    return rotated[:, :q.shape[1]], rotated[:, q.shape[1]:]


_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight [out, in].T (+ bias [out]): F.linear's result, to float rounding.

    On CPU, float32 goes through oneDNN's matmul when torch has it. With the
    column-major weights the CPU engine keeps, on a 2-core AMD EPYC (SmolLM2's
    projections) it took half the time of the default BLAS path for 8-row decode
    products, as long for one row, and 20% less for 700-row prefills.
    """
    if _ONEDNN_LINEAR and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] holding gate | up -> silu(gate) * up, [T, I] in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
