"""Multi-head latent attention (DeepSeek-V2/V3, Moonlight, Kimi K2) in its expanded form, written for tracing.

Queries come from the hidden state directly (``q``) or through a q_lora_rank-wide latent (``q_a``, its RMSNorm,
``q_b``); keys and values from one kv_lora_rank-wide latent plus a rotary key shared by every head
(``kv_a``: [latent; k_rot]), the latent RMSNormed and expanded by ``kv_b`` into every head's non-rotary key and
value. A head's query and key are [nope; rope] (qk_nope_head_dim + qk_rope_head_dim wide), its value
v_head_dim wide; the stateful cache holds the expanded keys and values (``ModelDims.cache_dims``), so attention
stays one SDPA op whose value width differs from its key width. The compressed form (caching the latent and
k_rot, absorbing kv_b into the query and the output) is not built: see docs/families.md.

``rope_interleave`` (DeepSeek's checkpoints) rotates interleaved pairs (x0, x1), (x2, x3), ...: taking the even
dims then the odd ones and rotating the halves is the same rotation (transformers'
apply_rotary_pos_emb_interleave returns exactly that layout), and q and k share it, so their dot product is
unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ovshard.bundle.dims import ModelDims
from ovshard.frontend.block import Block
from ovshard.frontend.layer_math import apply_rotary, deinterleave, rms_norm


def mla_qkv(d: ModelDims, blk: Block, layer: Any, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [batch, seq, hidden] -> queries and keys [batch, heads, seq, head_dim], values [batch, heads, seq, v_dim];
    cos, sin [batch, 1, seq, rope_head_dim]; ``layer`` the layer's stage_module.Weights (q_a/q_b or q, kv_a, kv_b
    weights and biases, q_a_norm, kv_a_norm)."""
    b, t, _ = x.shape
    heads, rope, eps = d.num_heads, d.rope_head_dim, d.rms_norm_eps
    nope = d.head_dim - rope
    if d.q_lora_rank:
        q_latent = rms_norm(F.linear(x, layer.q_a_weight, layer.q_a_bias), layer.q_a_norm, eps)
        q = F.linear(q_latent, layer.q_b_weight, layer.q_b_bias)
    else:
        q = F.linear(x, layer.q_weight, layer.q_bias)
    q = q.view(b, t, heads, d.head_dim).transpose(1, 2)
    kv_a = F.linear(x, layer.kv_a_weight, layer.kv_a_bias)  # [batch, seq, kv_lora_rank + rope]
    latent, k_rot = torch.split(kv_a, [d.kv_lora_rank, rope], dim=-1)  # on the last axis, whatever the rank
    kv = F.linear(rms_norm(latent, layer.kv_a_norm, eps), layer.kv_b_weight, layer.kv_b_bias)
    kv = kv.view(b, t, heads, nope + d.v_dim).transpose(1, 2)  # [batch, heads, seq, nope + v_dim]
    q_nope, q_rot = q[..., :nope], q[..., nope:]
    k_rot = k_rot.reshape(b, t, 1, rope).transpose(1, 2)  # [batch, 1, seq, rope]: one rotary key for every head
    if blk.rope_interleave:
        q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
    q_rot, k_rot = apply_rotary(q_rot, cos, sin, rope), apply_rotary(k_rot, cos, sin, rope)
    q = torch.cat((q_nope, q_rot), dim=-1)
    k = torch.cat((kv[..., :nope], k_rot.expand(-1, heads, -1, -1)), dim=-1)
    return q, k, kv[..., nope:]
