"""The MLP forms of a decoder layer in torch: the dense gated MLP, and a mixture of experts run eagerly.

:func:`ovshard.frontend.stage_module.experts_mlp` writes the experts in the tiled form the CPU plugin gathers,
every token through every expert; traced, that is only a graph. Run in torch (the calibration's float32 layers),
it would hold every token for every expert ([experts, tokens, expert_size] a projection): :func:`routed_experts`
runs each expert one ``F.linear`` a projection with its own [out, in] weight (``experts_gate_weight[e]`` ...) on
the tokens routed to it, as the plugin's GatherMatmul reads them, so memory is the routed tokens' (k of every
token's experts) and the calibration catches each expert's own inputs. The same sum: an expert not chosen adds
0 (its routing weight is 0; Llama 4's experts, whose input is scaled instead, give 0 on a 0 input: they have no
biases).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ovshard.bundle.dims import ModelDims
    from ovshard.frontend.block import Block

# ``layer`` below is a decoder layer's ``ovshard.frontend.stage_module.Weights`` (that module builds on this one)
Layer = Any


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The MLP's gate activation: ``silu``, ``gelu_tanh`` or ``gelu``."""
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")


def gated_mlp(m: torch.Tensor, layer: Layer, blk: Block, prefix: str = "") -> torch.Tensor:
    """The dense MLP: down(act(gate(m)) * up(m)), of the weights ``{prefix}gate_weight`` ..."""
    w = {key: getattr(layer, f"{prefix}{key}") for key in ("gate_weight", "gate_bias", "up_weight", "up_bias",
                                                            "down_weight", "down_bias")}
    gate = activation(F.linear(m, w["gate_weight"], w["gate_bias"]), blk.activation)
    return F.linear(gate * F.linear(m, w["up_weight"], w["up_bias"]), w["down_weight"], w["down_bias"])


def routed_experts(flat: torch.Tensor, top_weights: torch.Tensor, top_index: torch.Tensor, layer: Layer,
                   blk: Block) -> torch.Tensor:
    """The routed experts' weighted sum [tokens, hidden] on ``flat`` [tokens, hidden], each token's top-k experts
    ``top_index`` [tokens, k] and their weights (the shared expert not included)."""
    out = torch.zeros_like(flat)
    for e in torch.unique(top_index).tolist():
        token, slot = torch.nonzero(top_index == e, as_tuple=True)  # the tokens routed to e, and where in their top k
        score = top_weights[token, slot, None].to(flat.dtype)  # [routed, 1]
        if blk.expert_input_scores:
            out.index_add_(0, token, _expert(flat[token] * score, layer, e, blk))
        else:
            out.index_add_(0, token, _expert(flat[token], layer, e, blk) * score)
    return out


def with_shared(routed: torch.Tensor, m: torch.Tensor, layer: Layer, d: ModelDims, blk: Block) -> torch.Tensor:
    """The routed experts' sum plus the shared expert's output on ``m`` where the block has one (scaled by the
    sigmoid of its own one-output gate where it has that: Qwen2-MoE)."""
    if not d.shared_expert_size:
        return routed
    shared = gated_mlp(m, layer, blk, "shared_")
    if blk.shared_expert_gated:
        shared = torch.sigmoid(F.linear(m, layer.shared_router_weight)) * shared
    return routed + shared


def _expert(x: torch.Tensor, layer: Layer, e: int, blk: Block) -> torch.Tensor:
    """Expert ``e`` on its tokens ``x`` [routed, hidden]: gated (SwiGLU ...), or gpt-oss's clamped SwiGLU (gate and
    up interleaved in one biased projection, ``(up + 1) * gate * sigmoid(alpha * gate)``, a biased down)."""
    if blk.swiglu_limit is None:
        gate = activation(F.linear(x, layer.experts_gate_weight[e]), blk.activation)
        return F.linear(gate * F.linear(x, layer.experts_up_weight[e]), layer.experts_down_weight[e])
    limit, alpha = blk.swiglu_limit, blk.swiglu_alpha
    gate_up = F.linear(x, layer.experts_gate_up_weight[e], layer.experts_gate_up_bias[e])
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return F.linear((up + 1) * gate * torch.sigmoid(gate * alpha), layer.experts_down_weight[e],
                    layer.experts_down_bias[e])
