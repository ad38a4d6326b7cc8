"""Rotary frequencies for a model, from transformers' own rope init functions (compile time only).

The wrapper that traces a stage uses a fixed ``inv_freq`` and attention scaling per rotary table
(one, or one per layer type as in Gemma 3), so no rope-type logic reaches the graph;
``PrecomputeRotaryPass`` then folds the frequency math into a table.
"""

from __future__ import annotations

import torch

from ovshard.errors import UnsupportedArchitectureError
from ovshard.frontend.block import DEFAULT_ROPE
from ovshard.frontend.description import ModelDescription

Rotary = tuple[torch.Tensor, float]  # inv_freq [rotary_dim // 2] f32, attention scaling


def _hf_config(model: ModelDescription):
    """The transformers config object of the language model, which transformers' rope init functions read."""
    from transformers import CONFIG_MAPPING

    text = dict(model.language_config)
    return CONFIG_MAPPING[text.pop("model_type")](**text)


def rotary_frequencies(model: ModelDescription, key: str, max_positions: int | None = None) -> Rotary:
    """(inv_freq, attention scaling) of rotary table ``key``, exactly as transformers computes them.

    ``longrope`` (Phi-3 128k, Phi-4-mini) switches from its short to its long factors once a sequence
    passes ``original_max_position_embeddings``, re-rotating the whole cache; a fixed table is exact only
    below that point, so a bundle with longer ``max_positions`` is refused.
    """
    table = model.rope[key]
    if table.rope_type == "default":
        base, dim = table.theta, model.block.rotary_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (base**exponents), 1.0
    if table.rope_type == "longrope":
        original = table.original_max_positions
        if max_positions is None or original is None or max_positions > original:
            raise UnsupportedArchitectureError(
                f"longrope rotary switches to its long factors past original_max_position_embeddings={original}, "
                "which no fixed cos/sin table can follow; compile with --max-positions "
                f"{original} or less (asked for {max_positions})"
            )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    layer_type = None if key == DEFAULT_ROPE else key
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[table.rope_type](_hf_config(model), None, None, layer_type)
    return inv_freq.float(), float(scaling)


def rotary_tables(model: ModelDescription, layers: range, max_positions: int | None) -> dict[str, Rotary]:
    """The rotary tables layers ``layers`` read, by key."""
    keys, _ = model.block.used(layers)
    return {key: rotary_frequencies(model, key, max_positions) for key in keys}
