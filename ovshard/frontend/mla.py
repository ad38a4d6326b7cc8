"""Multi-head latent attention (DeepSeek-V2/V3, Moonlight, Kimi K2), written for tracing, in two forms.

Queries come from the hidden state directly (``q``) or through a q_lora_rank-wide latent (``q_a``, its RMSNorm,
``q_b``); keys and values from one kv_lora_rank-wide latent plus a rotary key shared by every head
(``kv_a``: [latent; k_rot]), the latent RMSNormed and expanded by ``kv_b`` into every head's non-rotary key and
value. A head's query and key are [nope; rope] (qk_nope_head_dim + qk_rope_head_dim wide), its value
v_head_dim wide.

The latent form (``ModelDims.latent_cache``, what the compiler builds) caches the normed latent and the rotary
key, not what kv_b expands them into: ``kv_b`` is absorbed (as DeepSeek's own inference and vLLM's MLA backend
do). Head h's non-rotary score q_nope . (W_UK[h] c) is (q_nope W_UK[h]) . c, and its output sum_j p_j W_UV[h]
c_j is W_UV[h] (sum_j p_j c_j), so attention is multi-query: ONE KV head whose key is [c; k_rot]
(kv_lora_rank + rope wide) and whose value is c (kv_lora_rank wide), each head's query [q_nope W_UK[h]; q_rot],
the scale unchanged (it counts nope + rope); each head's output then times W_UV[h], then o (kv_b has no bias:
MLA_NAMES). W_UK as [heads, nope, rank] and W_UV as [heads, rank, v_dim] are cut from kv_b when a layer is
loaded (:func:`absorbed_kv_b`), so each feeds its MatMul directly and keeps kv_b's name (:func:`name_kv_b`): the
INT8 choice of kv_b holds for both halves. The cache is keys (kv_lora_rank + rope) and values (kv_lora_rank)
of one head a token and layer, one SDPA op whose key width differs from its value width, which OpenVINO's KV
fusion and paged attention take as they take grouped-query attention. The expanded form (every head's key and
value cached: a faster decode step on CPU, whose attention kernel scores each head against the shared key on its
own, for 38x the cache at DeepSeek-V3's width; docs/families.md) is built on request
(``--mla-cache expanded``, CompileConfig.mla_cache; bench/mla_step.py measures both).

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
    """x [batch, seq, hidden] -> queries, keys and values [batch, heads, seq, dim] of attention: the latent form's
    (queries heads x (rank + rope), keys 1 x (rank + rope), values 1 x rank: :func:`latent_output` takes its
    output) or the expanded form's (queries and keys heads x head_dim, values heads x v_dim); cos, sin
    [batch, 1, seq, rope_head_dim]; ``layer`` the layer's stage_module.Weights (q_a/q_b or q, kv_a, kv_b
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
    latent = rms_norm(latent, layer.kv_a_norm, eps)
    q_nope, q_rot = q[..., :nope], q[..., nope:]
    k_rot = k_rot.reshape(b, t, 1, rope).transpose(1, 2)  # [batch, 1, seq, rope]: one rotary key for every head
    if blk.rope_interleave:
        q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
    q_rot, k_rot = apply_rotary(q_rot, cos, sin, rope), apply_rotary(k_rot, cos, sin, rope)
    if d.latent_cache:
        latent = latent.reshape(b, t, 1, d.kv_lora_rank).transpose(1, 2)  # [batch, 1, seq, rank]
        q_latent = torch.matmul(q_nope, layer.kv_b_key_weight)  # [batch, heads, seq, rank]: q_nope W_UK[h]
        return torch.cat((q_latent, q_rot), dim=-1), torch.cat((latent, k_rot), dim=-1), latent
    kv = F.linear(latent, layer.kv_b_weight, layer.kv_b_bias)
    kv = kv.view(b, t, heads, nope + d.v_dim).transpose(1, 2)  # [batch, heads, seq, nope + v_dim]
    q = torch.cat((q_nope, q_rot), dim=-1)
    k = torch.cat((kv[..., :nope], k_rot.expand(-1, heads, -1, -1)), dim=-1)
    return q, k, kv[..., nope:]


def latent_output(layer: Any, out: torch.Tensor) -> torch.Tensor:
    """The latent form's attention output [batch, heads, seq, rank] (each head's weighted latent) -> each head's
    value output [batch, heads, seq, v_dim]: times W_UV[h]."""
    return torch.matmul(out, layer.kv_b_value_weight)


def absorbed_kv_b(d: ModelDims, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """kv_b's weight [heads * (nope + v_dim), rank] (each head's key rows, then its value rows) as the latent
    form reads it: ``kv_b_key`` W_UK [heads, nope, rank] and ``kv_b_value`` W_UV transposed [heads, rank, v_dim]."""
    nope = d.head_dim - d.rope_head_dim
    by_head = weight.view(d.num_heads, nope + d.v_dim, d.kv_lora_rank)
    return {"kv_b_key": by_head[:, :nope].contiguous(), "kv_b_value": by_head[:, nope:].transpose(1, 2).contiguous()}


_HALVES = ("kv_b_key_weight", "kv_b_value_weight")


def name_kv_b(model: Any) -> None:
    """Name the converted graph's kv_b halves (constants ``<path>.kv_b_key_weight`` and ``.kv_b_value_weight``)
    ``key:<path>.kv_b_weight`` and ``value:<path>.kv_b_weight``: weight compression finds a layer's projections by
    the ``layers.<n>.<projection>_weight`` their names end with, so both halves take kv_b's format."""
    for op in model.get_ops():
        name = op.get_friendly_name()
        for half in _HALVES:
            if op.get_type_name() == "Constant" and name.endswith("." + half):
                op.set_friendly_name(f"{half.split('_')[2]}:{name[: -len(half)]}kv_b_weight")
