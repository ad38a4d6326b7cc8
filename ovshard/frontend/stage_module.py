"""The torch module traced for one pipeline stage: a Llama-family decoder slice written for tracing.

Differences from Hugging Face's modules, all deliberate:
- rotary cos/sin come from a fixed ``inv_freq`` (no rope-type branches reach the graph);
- attention is ``F.scaled_dot_product_attention`` (OpenVINO's KV-cache fusions need the SDPA op);
- the causal + padding mask is built inside the graph from ``attention_mask`` by physical cache index,
  so a position zeroed in the mask is invisible to every later query (mask rewind relies on this);
- past keys/values are plain tensors in and out, one pair per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ovshard.bundle.dims import ModelDims


class Weights(nn.Module):
    """Tensors held as non-persistent buffers: torch.jit.trace then reads them as module attributes.

    Plain tensor attributes would be baked into the traced graph as constants, and PyTorch's global
    compilation unit keeps those graphs (and so every stage's f32 weights) alive until the process
    exits; buffers are freed with the module, so compile memory stays at one stage.
    """

    def __init__(self, tensors: dict[str, torch.Tensor | None]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor, persistent=False)

    if TYPE_CHECKING:  # every attribute is one of the buffers above (nn.Module types them as Tensor | Module)
        def __getattr__(self, name: str) -> Any: ...


def layer_weights(input_norm: torch.Tensor, post_attention_norm: torch.Tensor,
                  linears: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> Weights:
    """One decoder layer: norms and q,k,v,o,gate,up,down (weight [out, in], bias or None)."""
    tensors: dict[str, torch.Tensor | None] = {"input_norm": input_norm, "post_attention_norm": post_attention_norm}
    for key, (weight, bias) in linears.items():
        tensors[f"{key}_weight"], tensors[f"{key}_bias"] = weight, bias
    return Weights(tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[batch, kv_heads, seq, head_dim] -> [batch, kv_heads * groups, seq, head_dim]."""
    if groups == 1:
        return x
    b, kv_heads, seq, head_dim = x.shape
    x = x[:, :, None, :, :].expand(b, kv_heads, groups, seq, head_dim)
    return x.reshape(b, kv_heads * groups, seq, head_dim)


def causal_padding_mask(attention_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """Additive mask [batch, 1, query, past + query] from attention_mask [batch, past + query].

    Query t sits at physical cache index past + t; it sees key j iff j <= past + t and mask[j] == 1.
    """
    key_index = torch.cumsum(torch.ones_like(attention_mask), dim=-1) - 1  # [batch, total]
    query_index = key_index[:, -query_len:]  # [batch, query]
    causal = key_index[:, None, :] <= query_index[:, :, None]  # [batch, query, total]
    visible = causal & (attention_mask[:, None, :] > 0)
    zero = torch.zeros((), dtype=torch.float32)
    blocked = torch.tensor(torch.finfo(torch.float32).min, dtype=torch.float32)
    return torch.where(visible, zero, blocked)[:, None, :, :]


def rotary(inv_freq: torch.Tensor, scaling: float, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [batch, seq, head_dim] for integer positions [batch, seq] (HF's formula)."""
    freqs = position_ids[..., None].float() * inv_freq  # [batch, seq, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def decoder_layer(d: ModelDims, layer: Weights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  mask: torch.Tensor, past_k: torch.Tensor,
                  past_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pre-norm decoder layer: h [batch, seq, hidden] -> (h, keys, values [batch, kv_heads, past + seq, d])."""
    b, t, _ = h.shape
    x = rms_norm(h, layer.input_norm, d.rms_norm_eps)
    q = F.linear(x, layer.q_weight, layer.q_bias).view(b, t, d.num_heads, d.head_dim).transpose(1, 2)
    k = F.linear(x, layer.k_weight, layer.k_bias).view(b, t, d.num_kv_heads, d.head_dim).transpose(1, 2)
    v = F.linear(x, layer.v_weight, layer.v_bias).view(b, t, d.num_kv_heads, d.head_dim).transpose(1, 2)
    cos, sin = cos[:, None], sin[:, None]  # [batch, 1, seq, head_dim]
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k = torch.cat((past_k, k), dim=2)  # [batch, kv_heads, past + seq, head_dim]
    v = torch.cat((past_v, v), dim=2)
    out = F.scaled_dot_product_attention(
        q, repeat_kv(k, d.kv_groups), repeat_kv(v, d.kv_groups), attn_mask=mask, scale=d.head_dim**-0.5
    )  # [batch, heads, seq, head_dim]
    out = out.transpose(1, 2).reshape(b, t, d.num_heads * d.head_dim)
    h = h + F.linear(out, layer.o_weight, layer.o_bias)
    m = rms_norm(h, layer.post_attention_norm, d.rms_norm_eps)
    gate = F.silu(F.linear(m, layer.gate_weight, layer.gate_bias))
    up = F.linear(m, layer.up_weight, layer.up_bias)
    return h + F.linear(gate * up, layer.down_weight, layer.down_bias), k, v


class StageModule(nn.Module):
    """Layers [start, end) of the model, plus the embedding (first stage) and head (last stage)."""

    def __init__(
        self,
        dims: ModelDims,
        layers: list[Weights],
        inv_freq: torch.Tensor,
        attention_scaling: float,
        embed: torch.Tensor | None,
        final_norm: torch.Tensor | None,
        lm_head: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.dims = dims
        self.layers = nn.ModuleList(layers)
        self.attention_scaling = attention_scaling
        self.head_is_embed = lm_head is not None and lm_head is embed  # tied, in a one-stage model
        self.globals = Weights({"inv_freq": inv_freq, "embed": embed, "final_norm": final_norm,
                                "lm_head": None if self.head_is_embed else lm_head})  # no buffer twice

    @property
    def blocks(self) -> list[Weights]:
        return [cast(Weights, block) for block in self.layers]

    def forward(self, x, attention_mask, position_ids, *past):
        d, g = self.dims, self.globals
        h = F.embedding(x, g.embed) if g.embed is not None else x  # [batch, seq, hidden]
        cos, sin = rotary(g.inv_freq, self.attention_scaling, position_ids)
        mask = causal_padding_mask(attention_mask, position_ids.shape[1])
        presents = []
        for n, layer in enumerate(self.blocks):
            h, k, v = decoder_layer(d, layer, h, cos, sin, mask, past[2 * n], past[2 * n + 1])
            presents += [k, v]
        head = g.embed if self.head_is_embed else g.lm_head
        if head is not None:
            h = F.linear(rms_norm(h, g.final_norm, d.rms_norm_eps), head)  # [batch, seq, vocab]
        return (h, *presents)


class PrologueModule(nn.Module):
    """What every layer of a stage shares: (position_ids, attention_mask) -> cos, sin, 4-D mask."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float) -> None:
        super().__init__()
        self.attention_scaling = attention_scaling
        self.globals = Weights({"inv_freq": inv_freq})

    def forward(self, attention_mask, position_ids):
        cos, sin = rotary(self.globals.inv_freq, self.attention_scaling, position_ids)
        return cos, sin, causal_padding_mask(attention_mask, position_ids.shape[1])


class LayersModule(nn.Module):
    """Consecutive decoder layers as their own graph: (h, cos, sin, mask, *past) -> (h, *presents)."""

    def __init__(self, dims: ModelDims, layers: list[Weights]) -> None:
        super().__init__()
        self.dims, self.layers = dims, nn.ModuleList(layers)

    def forward(self, h, cos, sin, mask, *past):
        presents = []
        for n, layer in enumerate(self.layers):
            h, k, v = decoder_layer(self.dims, cast(Weights, layer), h, cos, sin, mask, past[2 * n], past[2 * n + 1])
            presents += [k, v]
        return (h, *presents)


class FinalNormModule(nn.Module):
    """The final RMSNorm of the last stage; the lm_head MatMul is built from chunks (``ovshard.stream``)."""

    def __init__(self, dims: ModelDims, weight: torch.Tensor) -> None:
        super().__init__()
        self.dims = dims
        self.globals = Weights({"final_norm": weight})

    def forward(self, h):
        return rms_norm(h, self.globals.final_norm, self.dims.rms_norm_eps)
