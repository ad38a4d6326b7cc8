"""The torch module traced for one pipeline stage: a decoder slice written for tracing, following a Block.

Every family difference is a field of :class:`~ovshard.frontend.block.Block` (norm offset, q/k norms,
sandwich norms, embedding scale, activation, attention scale and soft-capping, partial rotary, sliding
windows, per-layer rotary tables); nothing here branches on ``model_type``.

Differences from Hugging Face's modules, all deliberate:
- rotary cos/sin come from a fixed ``inv_freq`` per table (no rope-type branches reach the graph);
- attention is ``F.scaled_dot_product_attention`` (OpenVINO's KV-cache fusions need the SDPA op);
- the causal + padding mask is built inside the graph from ``attention_mask`` by physical cache index,
  so a position zeroed in the mask is invisible to every later query (mask rewind relies on this); a
  sliding window counts visible positions (the mask's cumulative sum), so rewinds keep it exact;
- past keys/values are plain tensors in and out, one pair per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ovshard.bundle.dims import ModelDims
from ovshard.frontend.block import Block
from ovshard.frontend.layer_math import apply_rotary, deinterleave, l2_norm, rms_norm
from ovshard.frontend.mla import latent_output, mla_qkv
from ovshard.frontend.mlp import activation as _activation
from ovshard.frontend.mlp import gated_mlp, routed_experts, with_shared


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


def layer_weights(norms: dict[str, torch.Tensor],
                  linears: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> Weights:
    """One decoder layer: its norm scales by role (``attn_norm``, ``mlp_norm``, ``attn_out_norm``,
    ``mlp_out_norm``, ``q_norm``, ``k_norm``) and q,k,v,o,gate,up,down (weight [out, in], bias or None);
    a mixture of experts holds router [experts, hidden] and experts_gate, experts_up, experts_down
    (every expert's weight stacked: [experts, out, in]) instead of gate, up and down."""
    tensors: dict[str, torch.Tensor | None] = dict(norms)
    for key, (weight, bias) in linears.items():
        tensors[f"{key}_weight"], tensors[f"{key}_bias"] = weight, bias
    return Weights(tensors)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[batch, kv_heads, seq, head_dim] -> [batch, kv_heads * groups, seq, head_dim]."""
    if groups == 1:
        return x
    b, kv_heads, seq, head_dim = x.shape
    x = x[:, :, None, :, :].expand(b, kv_heads, groups, seq, head_dim)
    return x.reshape(b, kv_heads * groups, seq, head_dim)


def causal_padding_mask(attention_mask: torch.Tensor, query_len: int, window: int | None = None,
                        chunk: int | None = None) -> torch.Tensor:
    """Additive mask [batch, 1, query, past + query] from attention_mask [batch, past + query].

    Query t sits at physical cache index past + t; it sees key j iff j <= past + t and mask[j] == 1,
    and, with a sliding ``window``, iff fewer than ``window`` visible positions lie in (j, past + t]: the
    window counts what the mask shows (its cumulative sum), not cache slots, so rewound (zeroed) slots and
    holes left by speculation never shorten it. With a ``chunk`` (Llama 4's chunked attention), iff the query and
    the key lie in the same chunk of ``chunk`` visible positions (chunk n holds positions [n * chunk, (n + 1) * chunk)).
    """
    key_index = torch.cumsum(torch.ones_like(attention_mask), dim=-1) - 1  # [batch, total]
    query_index = key_index[:, -query_len:]  # [batch, query]
    causal = key_index[:, None, :] <= query_index[:, :, None]  # [batch, query, total]
    visible = causal & (attention_mask[:, None, :] > 0)
    if window is not None:
        seen = torch.cumsum(attention_mask, dim=-1)  # visible positions up to and including each slot
        distance = seen[:, -query_len:, None] - seen[:, None, :]  # [batch, query, total]
        visible = visible & (distance < window)
    if chunk is not None:
        seen = torch.cumsum(attention_mask, dim=-1)  # a visible slot's position is seen - 1
        chunks = torch.div(seen - 1, chunk, rounding_mode="floor")  # [batch, total]
        visible = visible & (chunks[:, -query_len:, None] == chunks[:, None, :])
    zero = torch.zeros((), dtype=torch.float32)
    blocked = torch.tensor(torch.finfo(torch.float32).min, dtype=torch.float32)
    return torch.where(visible, zero, blocked)[:, None, :, :]


def rotary(inv_freq: torch.Tensor, scaling: float, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [batch, seq, rotary_dim] for integer positions [batch, seq] (HF's formula)."""
    freqs = position_ids[..., None].float() * inv_freq  # [batch, seq, rotary_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def temperature(position_ids: torch.Tensor, blk: Block) -> torch.Tensor:
    """Llama 4's NoPE query scale [batch, 1, seq, 1]: 1 + attn_scale * log1p(floor((p + 1) / floor_scale)) at position
    p (transformers counts the cached positions, the same as p for a sequence without padding)."""
    floor_scale, attn_scale = cast(tuple[float, float], blk.temperature)
    steps = torch.floor((position_ids.float() + 1.0) / floor_scale)
    return (torch.log1p(steps) * attn_scale + 1.0)[:, None, :, None]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, blk: Block,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Scores, mask, softmax, values: one SDPA op, or explicit where SDPA cannot express the block: soft-capping,
    or attention sinks (a learned logit per head [heads] joins the softmax, then its column is dropped)."""
    if blk.attention_softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=blk.attention_scale)
    scores = torch.matmul(q, k.transpose(2, 3)) * blk.attention_scale  # [batch, heads, seq, total]
    if blk.attention_softcap is not None:
        cap = blk.attention_softcap
        scores = torch.tanh(scores / cap) * cap
    scores = scores + mask
    if sinks is None:
        return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32), v)
    sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = F.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)
    return torch.matmul(probs[..., :-1], v)


def _clamped_swiglu_experts(tiled: torch.Tensor, layer: Weights, blk: Block) -> torch.Tensor:
    """gpt-oss's experts on tiled tokens [experts, tokens, hidden]: gate and up interleaved in one biased
    projection, clamped, ``(up + 1) * gate * sigmoid(alpha * gate)``, a biased down projection (the form of
    ConvertTiledMoeBlockTo2GatherMatmuls: Slice, Clamp, Add; Slice, Minimum, Swish)."""
    limit, alpha = cast(float, blk.swiglu_limit), blk.swiglu_alpha
    gate_up = torch.matmul(tiled, layer.experts_gate_up_weight.transpose(1, 2)) + layer.experts_gate_up_bias[:, None]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # [experts, tokens, expert_size] each
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    down = torch.matmul((up + 1) * glu, layer.experts_down_weight.transpose(1, 2))
    return down + layer.experts_down_bias[:, None]


def route(logits: torch.Tensor, layer: Weights, d: ModelDims, blk: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k experts of each token [tokens, k] and their weights, from the router's logits [tokens, experts]:
    top k of a softmax over all (renormalized when ``blk.norm_topk``), a softmax over the top-k logits
    (``blk.topk_softmax``), or sigmoid routing (``blk.sigmoid_routing``)."""
    if blk.sigmoid_routing:
        return _sigmoid_route(logits, layer, d, blk)
    if blk.expert_input_scores:  # Llama 4: the sigmoids of the top-k logits
        top_logits, top_index = torch.topk(logits, d.experts_per_token, dim=-1)
        return torch.sigmoid(top_logits), top_index
    if blk.topk_softmax:
        top_logits, top_index = torch.topk(logits, d.experts_per_token, dim=-1)  # [tokens, k]
        top_weights = F.softmax(top_logits, dim=-1, dtype=torch.float32)
    else:
        top_weights, top_index = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), d.experts_per_token,
                                            dim=-1)
    if blk.norm_topk:
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    return top_weights, top_index


def _sigmoid_route(logits: torch.Tensor, layer: Weights, d: ModelDims, blk: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5's router (transformers' Glm4MoeTopkRouter): experts chosen by sigmoid score plus the correction bias,
    within the best ``groups_per_token`` groups (a group scored by the sum of its two best); weighted by their
    plain sigmoid scores, renormalized (``norm_topk``) and scaled by ``routed_scaling``."""
    scores = torch.sigmoid(logits)  # [tokens, experts]
    choice = scores + layer.router_correction
    if blk.groups_per_token < blk.expert_groups:  # with every group kept, the mask changes nothing
        groups, size = blk.expert_groups, d.num_experts // blk.expert_groups
        group_scores = choice.view(-1, groups, size).topk(2, dim=-1)[0].sum(dim=-1)  # [tokens, groups]
        group_index = torch.topk(group_scores, blk.groups_per_token, dim=-1)[1]
        kept = torch.zeros_like(group_scores).scatter(1, group_index, torch.ones_like(group_scores))
        kept = kept[:, :, None].expand(-1, groups, size).reshape(-1, d.num_experts) > 0
        choice = torch.where(kept, choice, torch.tensor(float("-inf"), dtype=choice.dtype))
    top_index = torch.topk(choice, d.experts_per_token, dim=-1)[1]  # [tokens, k]
    top_weights = scores.gather(1, top_index)
    if blk.norm_topk:
        top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return top_weights * blk.routed_scaling, top_index


def experts_mlp(m: torch.Tensor, layer: Weights, d: ModelDims, blk: Block) -> torch.Tensor:
    """A mixture of experts, written in the "tiled" form the CPU plugin reads only the routed experts of.

    The router's softmax over all experts picks the top k (renormalized when ``blk.norm_topk``), scattered
    into a dense [tokens, experts] weight map; every token runs through every expert as one batched MatMul
    per projection (weights stacked [experts, out, in]); the map weights the outputs and a sum over experts
    ends it. OpenVINO's ConvertTiledMoeBlockToGatherMatmuls matches exactly this graph (Reshape -> Tile ->
    Reshape, three MatMuls with transposed weights, Swish * up, Reshape; ScatterElementsUpdate -> Transpose
    -> Reshape -> Unsqueeze; Multiply, ReduceSum) and turns the MatMuls into GatherMatmul ops that read the
    top-k experts' weights only: the dense math here is what the graph means, not what the plugin runs.
    A shared expert (``d.shared_expert_size``), which every token runs, is added after, scaled by the
    sigmoid of its own one-output gate where it has one (Qwen2-MoE; GLM-4.5's is not scaled). Llama 4
    (``blk.expert_input_scores``) scales an expert's input, not its output: top-1 scales the token before the
    tiling (map 1 at its expert: gathered); top-k > 1 runs every expert on every token (0 input where not chosen).
    Run eagerly (not traced), the same sum is computed from the routed tokens alone (``ovshard.frontend.mlp``).
    """
    b, t, hidden = m.shape
    if not (torch.jit.is_tracing() or torch.compiler.is_compiling()):  # eager (calibration): the routed tokens only
        flat = m.reshape(-1, hidden)  # [tokens, hidden]
        top_weights, top_index = route(F.linear(flat, layer.router_weight, layer.router_bias), layer, d, blk)
        return with_shared(routed_experts(flat, top_weights, top_index, layer, blk).view(b, t, hidden), m, layer, d, blk)
    experts = d.num_experts
    flat = m.reshape(-1, hidden)  # [tokens, hidden]
    logits = F.linear(flat, layer.router_weight, layer.router_bias)  # [tokens, experts]
    top_weights, top_index = route(logits, layer, d, blk)
    if scaled_once := blk.expert_input_scores and d.experts_per_token == 1:  # Llama 4, top-1 (exact)
        flat, top_weights = flat * top_weights, torch.ones_like(top_weights)
    routing = torch.zeros_like(logits).scatter(1, top_index, top_weights)  # [tokens, experts]
    tiled = flat.repeat(experts, 1).view(experts, -1, hidden)  # [experts, tokens, hidden]
    weights = routing.transpose(0, 1).reshape(experts, b, t)[..., None]  # [experts, batch, seq, 1]
    if blk.expert_input_scores and not scaled_once:  # Llama 4, top-k > 1: no tiled block the plugin gathers
        tiled = tiled * weights.reshape(experts, -1, 1)
        weights = torch.ones_like(weights)
    if blk.swiglu_limit is not None:
        out = _clamped_swiglu_experts(tiled, layer, blk).view(experts, b, t, hidden)
    else:
        gate = _activation(torch.matmul(tiled, layer.experts_gate_weight.transpose(1, 2)), blk.activation)
        up = torch.matmul(tiled, layer.experts_up_weight.transpose(1, 2))  # [experts, tokens, expert_size]
        out = torch.matmul(gate * up, layer.experts_down_weight.transpose(1, 2)).view(experts, b, t, hidden)
    routed = (out * weights).sum(dim=0)  # [batch, seq, hidden]
    return with_shared(routed, m, layer, d, blk)


def _qkv(d: ModelDims, blk: Block, layer: Weights, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
         scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries [batch, heads, seq, head_dim], keys and values [batch, kv_heads, seq, head_dim] of q/k/v projections:
    q/k norms before the rotary where the block has them; no rotary without ``cos`` (a NoPE layer), its queries
    times ``scale`` where given; Llama 4's rotary on interleaved pairs, then q/k L2 norms."""
    b, t, _ = x.shape
    q = F.linear(x, layer.q_weight, layer.q_bias).view(b, t, d.num_heads, d.head_dim)
    k = F.linear(x, layer.k_weight, layer.k_bias).view(b, t, d.num_kv_heads, d.head_dim)
    v = F.linear(x, layer.v_weight, layer.v_bias).view(b, t, d.num_kv_heads, d.head_dim).transpose(1, 2)
    if blk.qk_norm:
        q, k = rms_norm(q, layer.q_norm, d.rms_norm_eps, blk.norm_offset), rms_norm(k, layer.k_norm, d.rms_norm_eps,
                                                                                  blk.norm_offset)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if cos is None or sin is None:
        return (q if scale is None else q * scale), k, v
    if blk.rope_interleave:
        q, k = deinterleave(q), deinterleave(k)
    q, k = apply_rotary(q, cos, sin, blk.rotary_dim), apply_rotary(k, cos, sin, blk.rotary_dim)
    if blk.qk_l2_norm:
        q, k = l2_norm(q, d.rms_norm_eps), l2_norm(k, d.rms_norm_eps)
    return q, k, v


def decoder_layer(d: ModelDims, blk: Block, layer: Weights, h: torch.Tensor, cos: torch.Tensor | None,
                  sin: torch.Tensor | None, mask: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
                  sparse: bool = False, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """One pre-norm decoder layer: h [batch, seq, hidden] -> (h, keys, values [batch, cache_heads, past + seq, d]);
    its MLP the experts when ``sparse`` (``ModelDims.sparse``), else dense; no rotary without ``cos`` and ``sin``
    (a NoPE layer), its queries times ``scale`` where given (temperature tuning)."""
    b, t, _ = h.shape
    eps, offset = d.rms_norm_eps, blk.norm_offset
    x = rms_norm(h, layer.attn_norm, eps, offset)
    if cos is not None and sin is not None:
        cos, sin = cos[:, None], sin[:, None]  # [batch, 1, seq, rotary_dim]
    if d.mla:
        assert cos is not None and sin is not None
        q, k, v = mla_qkv(d, blk, layer, x, cos, sin)
    else:
        q, k, v = _qkv(d, blk, layer, x, cos, sin, scale)
    k = torch.cat((past_k, k), dim=2)  # [batch, cache_heads, past + seq, head_dim]
    v = torch.cat((past_v, v), dim=2)
    groups = d.num_heads // d.cache_heads
    out = attention(q, repeat_kv(k, groups), repeat_kv(v, groups), mask, blk,
                    layer.sinks if blk.attention_sinks else None)  # [batch, heads, seq, d]
    if d.latent_cache:
        out = latent_output(layer, out)
    out = F.linear(out.transpose(1, 2).reshape(b, t, d.num_heads * d.v_dim), layer.o_weight, layer.o_bias)
    if blk.sandwich_norms:
        out = rms_norm(out, layer.attn_out_norm, eps, offset)
    h = h + out
    m = rms_norm(h, layer.mlp_norm, eps, offset)
    out = experts_mlp(m, layer, d, blk) if sparse else gated_mlp(m, layer, blk)
    if blk.sandwich_norms:
        out = rms_norm(out, layer.mlp_out_norm, eps, offset)
    return h + out, k, v


def embed_tokens(ids: torch.Tensor, table: torch.Tensor, blk: Block) -> torch.Tensor:
    h = F.embedding(ids, table)
    return h if blk.embed_scale is None else h * torch.tensor(blk.embed_scale, dtype=h.dtype)


def softcap_logits(logits: torch.Tensor, blk: Block) -> torch.Tensor:
    if blk.final_softcap is None:
        return logits
    return torch.tanh(logits / blk.final_softcap) * blk.final_softcap


class Context:
    """The per-stage values every layer reads: a rotary (cos, sin) per table, a mask per attention kind, and the
    NoPE layers' query scale where the block tunes their temperature."""

    def __init__(self, blk: Block, layers: range) -> None:
        self.blk, self.layers = blk, layers
        self.ropes, self.masks = blk.used(layers)
        self.tuned = blk.tuned(layers)

    def build(self, tables: dict[str, tuple[torch.Tensor, float]], attention_mask: torch.Tensor,
              position_ids: torch.Tensor) -> list[torch.Tensor]:
        """cos, sin per rotary table, one 4-D mask per kind, the query scale: the flat list :meth:`split` reads."""
        out: list[torch.Tensor] = []
        for key in self.ropes:
            inv_freq, scaling = tables[key]
            out += rotary(inv_freq, scaling, position_ids)
        for kind in self.masks:
            out.append(causal_padding_mask(attention_mask, position_ids.shape[1], self.blk.window(kind),
                                           self.blk.chunk(kind)))
        if self.tuned:
            out.append(temperature(position_ids, self.blk))
        return out

    def split(self, values: tuple | list) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor],
                                                   torch.Tensor | None]:
        ropes = {key: (values[2 * n], values[2 * n + 1]) for n, key in enumerate(self.ropes)}
        masks = {kind: values[2 * len(self.ropes) + n] for n, kind in enumerate(self.masks)}
        return ropes, masks, values[self.size - 1] if self.tuned else None

    @property
    def size(self) -> int:
        return 2 * len(self.ropes) + len(self.masks) + int(self.tuned)

    def run_layers(self, d: ModelDims, weights: list[Weights], h: torch.Tensor, values: tuple | list,
                   past: tuple) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ropes, masks, scale = self.split(values)
        presents = []
        for n, (i, layer) in enumerate(zip(self.layers, weights, strict=True)):
            nope = i in self.blk.nope_layers
            cos, sin = (None, None) if nope else ropes[self.blk.rope_keys[i]]
            h, k, v = decoder_layer(d, self.blk, layer, h, cos, sin, masks[self.blk.mask_kind(i)],
                                    past[2 * n], past[2 * n + 1], d.sparse(i), scale if nope else None)
            presents += [k, v]
        return h, presents


class StageModule(nn.Module):
    """Layers [start, end) of the model, plus the embedding (first stage) and head (last stage)."""

    def __init__(
        self,
        dims: ModelDims,
        blk: Block,
        layers: range,
        weights: list[Weights],
        tables: dict[str, tuple[torch.Tensor, float]],
        embed: torch.Tensor | None,
        final_norm: torch.Tensor | None,
        lm_head: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.dims, self.blk, self.context = dims, blk, Context(blk, layers)
        self.layers = nn.ModuleList(weights)
        self.scalings = {key: scaling for key, (_, scaling) in tables.items()}
        self.head_is_embed = lm_head is not None and lm_head is embed  # tied, in a one-stage model
        self.globals = Weights({"embed": embed, "final_norm": final_norm,
                                "lm_head": None if self.head_is_embed else lm_head,  # no buffer twice
                                **{f"inv_freq_{key}": inv_freq for key, (inv_freq, _) in tables.items()}})

    @property
    def blocks(self) -> list[Weights]:
        return [cast(Weights, block) for block in self.layers]

    def forward(self, x, attention_mask, position_ids, *past):
        d, g = self.dims, self.globals
        h = embed_tokens(x, g.embed, self.blk) if g.embed is not None else x  # [batch, seq, hidden]
        tables = {key: (getattr(g, f"inv_freq_{key}"), scaling) for key, scaling in self.scalings.items()}
        values = self.context.build(tables, attention_mask, position_ids)
        h, presents = self.context.run_layers(d, self.blocks, h, values, past)
        head = g.embed if self.head_is_embed else g.lm_head
        if head is not None:
            h = softcap_logits(F.linear(rms_norm(h, g.final_norm, d.rms_norm_eps, self.blk.norm_offset), head),
                               self.blk)  # [batch, seq, vocab]
        return (h, *presents)


class PrologueModule(nn.Module):
    """What the layers of a stage share: (attention_mask, position_ids) -> cos, sin per table, mask per kind."""

    def __init__(self, blk: Block, layers: range, tables: dict[str, tuple[torch.Tensor, float]]) -> None:
        super().__init__()
        self.context = Context(blk, layers)
        self.scalings = {key: scaling for key, (_, scaling) in tables.items()}
        self.globals = Weights({f"inv_freq_{key}": inv_freq for key, (inv_freq, _) in tables.items()})

    def forward(self, attention_mask, position_ids):
        tables = {key: (getattr(self.globals, f"inv_freq_{key}"), s) for key, s in self.scalings.items()}
        return tuple(self.context.build(tables, attention_mask, position_ids))


class LayersModule(nn.Module):
    """Consecutive decoder layers as their own graph: (h, *context values, *past) -> (h, *presents)."""

    def __init__(self, dims: ModelDims, blk: Block, layers: range, weights: list[Weights]) -> None:
        super().__init__()
        self.dims, self.context = dims, Context(blk, layers)
        self.layers = nn.ModuleList(weights)

    def forward(self, h, *rest):
        n = self.context.size
        h, presents = self.context.run_layers(self.dims, [cast(Weights, w) for w in self.layers], h, rest[:n], rest[n:])
        return (h, *presents)


class EmbedScaleModule(nn.Module):
    """Gemma's embedding scale, on the gathered rows (the embedding itself is joined from row chunks)."""

    def __init__(self, blk: Block) -> None:
        super().__init__()
        self.blk = blk

    def forward(self, h):
        return h * torch.tensor(self.blk.embed_scale, dtype=h.dtype)


class FinalNormModule(nn.Module):
    """The final RMSNorm of the last stage; the lm_head MatMul is built from chunks (``ovshard.layerwise``)."""

    def __init__(self, dims: ModelDims, blk: Block, weight: torch.Tensor) -> None:
        super().__init__()
        self.dims, self.blk = dims, blk
        self.globals = Weights({"final_norm": weight})

    def forward(self, h):
        return rms_norm(h, self.globals.final_norm, self.dims.rms_norm_eps, self.blk.norm_offset)


class SoftcapModule(nn.Module):
    """Gemma 2's final logit soft-capping, after the lm_head built from chunks."""

    def __init__(self, blk: Block) -> None:
        super().__init__()
        self.blk = blk

    def forward(self, logits):
        return softcap_logits(logits, self.blk)
