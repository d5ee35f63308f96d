"""How long a sequence may grow while pagedrag computes exactly what HF computes.

pagedrag.models.llama attends over each token's whole context with static rotary
frequencies. Two kinds of config ask for more than that past some length:

- a sliding window (Mistral's ``sliding_window``; Qwen2/Qwen3 with ``use_sliding_window``,
  whose ``layer_types`` name the sliding layers): past the window a token no longer sees
  its earliest context;
- "longrope" rotary scaling: past ``original_max_position_embeddings`` HF switches every
  position to the long factors.

Within those lengths the two computations are the same, so the engine's ``max_model_len``
stays within them (vLLM's ``disable_sliding_window`` does the same): a default is cut down
with a warning, a larger request is refused by name. No config changes outputs silently.
"""

from __future__ import annotations

import logging

from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The attention window some layer of the model applies, or None where every layer sees
    its whole context."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def longrope_switch_of(config: PretrainedConfig) -> int | None:
    """For "longrope" rotary scaling, the length past which HF uses the long factors."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type")) != "longrope":
        return None
    original = params.get("original_max_position_embeddings",
                          getattr(config, "original_max_position_embeddings", None))
    return int(original) if original else None


def context_limit(config: PretrainedConfig) -> tuple[int, str]:
    """(the longest sequence computed as HF computes it, what sets that length)."""
    limits = [(config.max_position_embeddings, f"max_position_embeddings {config.max_position_embeddings}")]
    window = sliding_window_of(config)
    if window is not None:
        limits.append((window, f"sliding_window {window} (pagedrag attends over the whole context, "
                               "so it keeps sequences within the window)"))
    switch = longrope_switch_of(config)
    if switch is not None:
        limits.append((switch, f"longrope's original_max_position_embeddings {switch} (past it HF "
                               "switches to the long factors, which pagedrag does not)"))
    return min(limits, key=lambda limit: limit[0])


def max_model_len(config: PretrainedConfig, requested: int | None) -> int:
    """``requested`` if given (ValueError past the context limit), else the context limit,
    with a warning where that is below max_position_embeddings."""
    limit, reason = context_limit(config)
    if requested is not None:
        if requested > limit:
            raise ValueError(f"max_model_len {requested} exceeds the model's {reason}")
        return requested
    if limit < config.max_position_embeddings:
        logger.warning("max_model_len is %d, not max_position_embeddings %d: the model's %s",
                       limit, config.max_position_embeddings, reason)
    return limit
