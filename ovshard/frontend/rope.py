"""Rotary frequencies for a config, from transformers' own rope init functions (compile time only).

The wrapper that traces a stage uses a fixed ``inv_freq`` and attention scaling, so no rope-type
logic reaches the graph; ``PrecomputeRotaryPass`` then folds the frequency math into a table.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ovshard.bundle.dims import ModelDims
from ovshard.errors import UnsupportedArchitectureError
from ovshard.frontend.arch import DYNAMIC_ROPE_TYPES


def rotary_frequencies(checkpoint_dir: Path, dims: ModelDims) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim // 2] f32, attention_scaling) exactly as transformers computes them."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if dims.rope_type in DYNAMIC_ROPE_TYPES:
        raise UnsupportedArchitectureError(f"rope type {dims.rope_type!r} depends on the running length")
    config = AutoConfig.from_pretrained(checkpoint_dir)
    if dims.rope_type == "default":
        base = dims.rope_theta
        exponents = torch.arange(0, dims.head_dim, 2, dtype=torch.int64).float() / dims.head_dim
        return 1.0 / (base**exponents), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[dims.rope_type](config)
    return inv_freq.float(), float(scaling)
