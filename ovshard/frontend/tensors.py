"""What a checkpoint of a family stores, layer by layer: tensor names and shapes, and the projections each layer
holds as the stage module reads them.

Every count of a layer (the checkpoint check, the planner's memory and step bytes, the INT8 precision plan,
``ovshard synth``, the streamed compile's layer cache) goes through :func:`layer_tensors` or
:func:`linear_shapes`, which follow the layer's kind: a mixture-of-experts model's dense layers
(``ModelDims.dense_layers``) hold a gated MLP of ``intermediate_size``, its other layers the experts.
"""

from __future__ import annotations

from ovshard.bundle.dims import ModelDims
from ovshard.frontend.arch import ArchSpec


def linear_shapes(dims: ModelDims, layer: int) -> dict[str, tuple[int, int]]:
    """Layer ``layer``'s projections as the stage module holds them (fused ones split): key -> (out, in)."""
    q_out, kv_out = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    hidden, inter = dims.hidden_size, dims.intermediate_size
    attention = mla_shapes(dims) if dims.mla else {"q": (q_out, hidden), "k": (kv_out, hidden),
                                                   "v": (kv_out, hidden), "o": (hidden, q_out)}
    if not dims.sparse(layer):
        return {**attention, "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    # every expert's matrix stacked: [experts * out, in]; the router stays float (not listed)
    experts, size = dims.num_experts, dims.expert_size
    if dims.expert_projections == 2:  # gpt-oss: gate and up in one matrix, interleaved
        return {**attention, "experts_gate_up": (experts * 2 * size, hidden), "experts_down": (experts * hidden, size)}
    shared = dims.shared_expert_size
    shared_linears = {"shared_gate": (shared, hidden), "shared_up": (shared, hidden),
                      "shared_down": (hidden, shared)} if shared else {}
    return {**attention, "experts_gate": (experts * size, hidden), "experts_up": (experts * size, hidden),
            "experts_down": (experts * hidden, size), **shared_linears}


def mla_shapes(dims: ModelDims) -> dict[str, tuple[int, int]]:
    """Multi-head latent attention's projections (key -> (out, in)): q (or q_a to the q_lora_rank latent, q_b from
    it), kv_a to the kv_lora_rank latent plus the shared rotary key, kv_b from the latent to every head's nope key
    and value, o from the values."""
    heads, hidden, nope = dims.num_heads, dims.hidden_size, dims.head_dim - dims.rope_head_dim
    query = ({"q_a": (dims.q_lora_rank, hidden), "q_b": (heads * dims.head_dim, dims.q_lora_rank)}
             if dims.q_lora_rank else {"q": (heads * dims.head_dim, hidden)})
    return {**query, "kv_a": (dims.kv_lora_rank + dims.rope_head_dim, hidden),
            "kv_b": (heads * (nope + dims.v_dim), dims.kv_lora_rank), "o": (hidden, heads * dims.v_dim)}


# MLA's projections by checkpoint name under ArchSpec.mla, and which of them take config["attention_bias"]
MLA_NAMES = {"q": ("q_proj", False), "q_a": ("q_a_proj", True), "q_b": ("q_b_proj", False),
             "kv_a": ("kv_a_proj_with_mqa", True), "kv_b": ("kv_b_proj", False), "o": ("o_proj", True)}
# MLA's latent norms: role -> checkpoint name under ArchSpec.mla (q_a_layernorm only with q_lora_rank)
MLA_NORMS = {"q_a_norm": "q_a_layernorm", "kv_a_norm": "kv_a_layernorm"}


def _mla_tensors(spec: ArchSpec, dims: ModelDims, i: int) -> dict[str, tuple[int, ...]]:
    assert spec.mla
    prefix = spec.mla.format(i=i)
    shapes: dict[str, tuple[int, ...]] = {}
    for key, shape in mla_shapes(dims).items():
        name, biased = MLA_NAMES[key]
        shapes[f"{prefix}.{name}.weight"] = shape
        if biased and dims.attention_bias:
            shapes[f"{prefix}.{name}.bias"] = (shape[0],)
    if dims.q_lora_rank:
        shapes[f"{prefix}.q_a_layernorm.weight"] = (dims.q_lora_rank,)
    shapes[f"{prefix}.kv_a_layernorm.weight"] = (dims.kv_lora_rank,)
    return shapes


def norm_templates(spec: ArchSpec, dims: ModelDims) -> tuple[str, ...]:
    """Every per-layer RMSNorm scale tensor of this checkpoint (templates over ``{i}``): the family's, less q/k
    norms a checkpoint leaves out (``dims.qk_norm``)."""
    left_out = () if dims.qk_norm else tuple(t + ("" if t.endswith(".weight") else ".weight")
                                             for t in (spec.q_norm, spec.k_norm) if t)
    return tuple(t for t in spec.norm_templates() if t not in left_out)


def layer_tensors(spec: ArchSpec, dims: ModelDims, i: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of layer ``i``'s tensors, as Hugging Face stores them."""
    q_out = dims.num_heads * dims.head_dim
    kv_out = dims.num_kv_heads * dims.head_dim
    qkv_bias, o_bias, mlp_bias = dims.attention_bias, dims.o_bias, dims.mlp_bias
    linear: dict[str, tuple[int, int, bool]] = {}
    if spec.qkv_proj:
        linear[spec.qkv_proj] = (q_out + 2 * kv_out, dims.hidden_size, qkv_bias)
    elif not spec.mla:  # MLA's projections: _mla_tensors
        linear[spec.q_proj] = (q_out, dims.hidden_size, qkv_bias)
        linear[spec.k_proj] = (kv_out, dims.hidden_size, qkv_bias)
        linear[spec.v_proj] = (kv_out, dims.hidden_size, qkv_bias)
    if not spec.mla:
        linear[spec.o_proj] = (dims.hidden_size, q_out, o_bias)
    sparse = dims.sparse(i)
    if sparse:
        linear.update(_expert_linears(spec, dims))
    elif spec.gate_up_proj:
        linear[spec.gate_up_proj] = (2 * dims.intermediate_size, dims.hidden_size, mlp_bias)
    else:
        linear[spec.gate_proj] = (dims.intermediate_size, dims.hidden_size, mlp_bias)
        linear[spec.up_proj] = (dims.intermediate_size, dims.hidden_size, mlp_bias)
    if not sparse:
        linear[spec.down_proj] = (dims.hidden_size, dims.intermediate_size, mlp_bias)
    shapes: dict[str, tuple[int, ...]] = _mla_tensors(spec, dims, i) if spec.mla else {}
    for template in norm_templates(spec, dims):
        per_head = template in (spec.q_norm, spec.k_norm)
        shapes[template.format(i=i)] = (dims.head_dim,) if per_head else (dims.hidden_size,)
    for prefix, (out_f, in_f, bias) in linear.items():
        shapes[prefix.format(i=i) + ".weight"] = (out_f, in_f)
        if bias:
            shapes[prefix.format(i=i) + ".bias"] = (out_f,)
    if sparse and spec.router_correction:
        shapes[spec.router_correction.format(i=i)] = (dims.num_experts,)
    shapes.update(_stacked_expert_tensors(spec, dims, i, sparse))
    return shapes


def _stacked_expert_tensors(spec: ArchSpec, dims: ModelDims, i: int, sparse: bool) -> dict[str, tuple[int, ...]]:
    """gpt-oss's 3-D expert tensors and its attention sinks (nothing for other families)."""
    shapes: dict[str, tuple[int, ...]] = {}
    if spec.stacked_experts and sparse:
        experts, hidden, size, prefix = dims.num_experts, dims.hidden_size, dims.expert_size, spec.stacked_experts
        prefix = prefix.format(i=i)
        if spec.stacked_halves:  # Llama 4: no biases
            return shapes | {f"{prefix}.gate_up_proj": (experts, hidden, 2 * size), f"{prefix}.down_proj": (experts, size, hidden)}
        shapes |= {f"{prefix}.gate_up_proj": (experts, hidden, 2 * size),
                   f"{prefix}.gate_up_proj_bias": (experts, 2 * size),
                   f"{prefix}.down_proj": (experts, size, hidden), f"{prefix}.down_proj_bias": (experts, hidden)}
    if spec.sinks:
        shapes[spec.sinks.format(i=i)] = (dims.num_heads,)
    return shapes


def _expert_linears(spec: ArchSpec, dims: ModelDims) -> dict[str, tuple[int, int, bool]]:
    """The router, every expert's gate, up and down projection and a shared expert with its gate, where the
    family has one (templates over {i}; no biases)."""
    assert spec.router
    hidden, size = dims.hidden_size, dims.expert_size
    linear = {spec.router: (dims.num_experts, hidden, spec.router_bias)}
    for e in range(0 if spec.stacked_experts else dims.num_experts):
        assert spec.expert_gate and spec.expert_up and spec.expert_down
        linear[spec.expert_gate.replace("{e}", str(e))] = (size, hidden, False)
        linear[spec.expert_up.replace("{e}", str(e))] = (size, hidden, False)
        linear[spec.expert_down.replace("{e}", str(e))] = (hidden, size, False)
    if spec.shared_expert and dims.shared_expert_size:
        shared = dims.shared_expert_size
        linear[spec.shared_expert + ".gate_proj"] = (shared, hidden, False)
        linear[spec.shared_expert + ".up_proj"] = (shared, hidden, False)
        linear[spec.shared_expert + ".down_proj"] = (hidden, shared, False)
        if spec.shared_expert_gate:
            linear[spec.shared_expert_gate] = (1, hidden, False)
    return linear


def model_tensors(spec: ArchSpec, dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this family and these dimensions holds, in file order."""
    shapes: dict[str, tuple[int, ...]] = {spec.embed: (dims.vocab_size, dims.hidden_size)}
    for i in range(dims.num_layers):
        shapes.update(layer_tensors(spec, dims, i))
    shapes[spec.final_norm] = (dims.hidden_size,)
    if not dims.tie_word_embeddings:
        shapes[spec.lm_head] = (dims.vocab_size, dims.hidden_size)
    return shapes
