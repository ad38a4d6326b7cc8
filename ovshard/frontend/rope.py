"""Rotary frequencies for a config, from transformers' own rope init functions (compile time only).

The wrapper that traces a stage uses a fixed ``inv_freq`` and attention scaling per rotary table
(one, or one per layer type as in Gemma 3), so no rope-type logic reaches the graph;
``PrecomputeRotaryPass`` then folds the frequency math into a table.
"""

from __future__ import annotations

from typing import Any

import torch

from ovshard.errors import UnsupportedArchitectureError
from ovshard.frontend.arch import rope_settings, text_config
from ovshard.frontend.block import DEFAULT_ROPE, Block

Rotary = tuple[torch.Tensor, float]  # inv_freq [rotary_dim // 2] f32, attention scaling


def _hf_config(config: dict[str, Any]):
    from transformers import CONFIG_MAPPING

    text = dict(text_config(config))
    return CONFIG_MAPPING[text["model_type"]](**{k: v for k, v in text.items() if k != "model_type"})


def rotary_frequencies(config: dict[str, Any], block: Block, key: str, max_positions: int | None = None) -> Rotary:
    """(inv_freq, attention scaling) of rotary table ``key``, exactly as transformers computes them.

    ``longrope`` (Phi-3 128k, Phi-4-mini) switches from its short to its long factors once a sequence
    passes ``original_max_position_embeddings``, re-rotating the whole cache; a fixed table is exact only
    below that point, so a bundle with longer ``max_positions`` is refused.
    """
    text = text_config(config)
    layer_type = None if key == DEFAULT_ROPE else key
    params = rope_settings(text, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base, dim = float(params["rope_theta"]), block.rotary_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (base**exponents), 1.0
    if rope_type == "longrope":
        original = int(text.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                       or text["max_position_embeddings"])
        if max_positions is None or max_positions > original:
            raise UnsupportedArchitectureError(
                f"longrope rotary switches to its long factors past original_max_position_embeddings={original}, "
                "which no fixed cos/sin table can follow; compile with --max-positions "
                f"{original} or less (asked for {max_positions})"
            )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](_hf_config(config), None, None, layer_type)
    return inv_freq.float(), float(scaling)


def rotary_tables(config: dict[str, Any], block: Block, layers: range, max_positions: int | None) -> dict[str, Rotary]:
    """The rotary tables layers ``layers`` read, by key."""
    keys, _ = block.used(layers)
    return {key: rotary_frequencies(config, block, key, max_positions) for key in keys}
