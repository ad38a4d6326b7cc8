"""Cost model for the partition planner: bytes of each block after compression, KV bytes per token.

Weight bytes are estimates from tensor shapes (no data is read): INT4 counts half a byte per weight
plus an f16 scale and a 4-bit zero point per group; the embedding and the lm_head (unless
``all_layers``) and the decoder weights the format keeps in INT8 (``int8_weights``) count one byte.
Before the compiler has chosen those, each layer is counted with its share of the INT8 budget spent. Activations
count two bytes an element (f16 on the wire); the KV cache as the CPU plugin stores it under the bundle's hints
(bundle/kv_store.py: u8 with its scales and zero points). A mixture-of-experts layer holds every
expert (its memory) but a decode step reads only the routed ones (its ``read_bytes``: the top-k of the experts'
share, beside all of attention and the router), which the planner's step time follows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ovshard.bundle.dims import ModelDims
from ovshard.bundle.kv_store import KVStore, kv_store
from ovshard.bundle.manifest import CPU_PLUGIN_HINTS
from ovshard.bundle.weights import WeightFormat
from ovshard.frontend.arch import ArchSpec
from ovshard.frontend.tensors import layer_tensors, linear_shapes, model_tensors
from ovshard.plan.partition import Block, ModelCosts
from ovshard.plan.precision import all_int4_bytes, embedding_bytes

WIRE_ELEMENT_BYTES = 2
NEW_BUNDLE_KV = kv_store(CPU_PLUGIN_HINTS, "the CPU hints a new bundle carries")  # what a compile's plan counts


def bytes_per_weight(fmt: WeightFormat, backup_int8: bool = False) -> float:
    """Average stored bytes per weight element of a MatMul/embedding in format ``fmt`` (INT4: all INT4)."""
    if fmt.mode == "fp32":
        return 4.0
    if fmt.mode == "fp16":
        return 2.0
    if fmt.mode == "int8" or backup_int8:
        return 1.0
    # a f16 scale (and, asymmetric, a 4-bit zero point) per group; -1 means one per output channel, which
    # over a row of hundreds of inputs or more is below the rounding of the estimate
    per_group = 2.0 + {"int4_asym": 0.5, "int4_affine": 2.0}.get(fmt.mode, 0.0)
    return 0.5 + (per_group / fmt.group_size if fmt.group_size > 0 else 0.0)


def _layer_bytes(spec: ArchSpec, dims: ModelDims, fmt: WeightFormat, i: int) -> int:
    shapes = layer_tensors(spec, dims, i)
    small = sum(4 * math.prod(s) for s in shapes.values() if len(s) != 2)  # norms and biases stay f32
    matrices = sum(math.prod(s) for s in shapes.values() if len(s) == 2)
    if not fmt.is_int4:
        return int(small + matrices * bytes_per_weight(fmt))
    int4 = bytes_per_weight(fmt)
    linears = linear_shapes(dims, i)
    if fmt.int8_weights:
        kept = sum(math.prod(linears[k.split(".")[1]]) for k in fmt.int8_weights if int(k.split(".")[0]) == i)
        return int(small + matrices * int4 + kept * (1.0 - int4))
    spare = fmt.budget * all_int4_bytes(dims) - all_int4_bytes(dims, fmt)
    budget_share = max(spare, 0.0) / dims.num_layers  # the choice is not made yet: each layer its share
    return int(small + min(matrices * int4 + budget_share, matrices * (1.0 - fmt.ratio * (1.0 - int4))))


def _layer_block(spec: ArchSpec, dims: ModelDims, fmt: WeightFormat, i: int, kv: int, reach: int | None) -> Block:
    """Layer ``i``: its memory counts every expert; a decode step reads only the routed ones (top-k of all). A
    dense layer of a MoE model is read whole."""
    weight_bytes = _layer_bytes(spec, dims, fmt, i)
    if not dims.sparse(i):
        return Block(f"layer.{i}", "layer", i, weight_bytes, kv, kv_reach=reach)
    elements = sum(math.prod(s) for s in layer_tensors(spec, dims, i).values())
    experts = 3 * dims.num_experts * dims.expert_size * dims.hidden_size
    idle = experts * (1.0 - dims.experts_per_token / dims.num_experts) / elements  # share of the layer not read
    return Block(f"layer.{i}", "layer", i, weight_bytes, kv, read_bytes=int(weight_bytes * (1.0 - idle)),
                 kv_reach=reach)


def rotary_table_bytes(tables: int, rotary_dim: int, max_positions: int) -> int:
    """The f32 cos and sin tables [max_positions, rotary_dim] each stage holds, one pair per rotary table
    (PrecomputeRotaryPass): 128 MiB a stage for Llama 3.1's 131,072 positions."""
    return 2 * tables * max_positions * rotary_dim * 4


def model_costs(spec: ArchSpec, dims: ModelDims, fmt: WeightFormat, stage_bytes: int = 0,
                kv_cache: KVStore = NEW_BUNDLE_KV, reach: Sequence[int | None] = ()) -> ModelCosts:
    """The planner's view of the model: embed, one block per layer, head; ``stage_bytes`` every stage holds
    whatever its layers (the rotary tables: ``rotary_table_bytes``); ``kv_cache``: how its stages store keys and
    values (a compiled bundle's: ``Manifest.kv_store``).

    It takes the family and dimensions only (from a :class:`~ovshard.frontend.description.ModelDescription`
    when compiling, from a manifest's ``architecture`` when placing a compiled bundle); ``reach``: per layer, the
    cached positions its attention reads at most (a sliding window), None or empty for all."""
    int8_backup = fmt.mode.startswith("int4") and not fmt.all_layers
    table = dims.vocab_size * dims.hidden_size
    per_weight = bytes_per_weight(fmt.table or fmt, int8_backup and fmt.table is None)
    # a step gathers the fed tokens' rows of the embedding: a row's bytes, against all of the lm_head's
    embed = Block("embed", "embed", None, int(table * per_weight), 0, read_bytes=int(dims.hidden_size * per_weight))
    kv = kv_cache.bytes_per_token(dims)  # cache heads x (key + value dims) as stored: MLA's latent cache too
    layers = [_layer_block(spec, dims, fmt, i, kv, reach[i] if reach else None) for i in range(dims.num_layers)]
    head = Block("head", "head", None, int(table * per_weight) + 4 * dims.hidden_size, 0)
    return ModelCosts(blocks=(embed, *layers, head), activation_bytes_per_token=dims.hidden_size * WIRE_ELEMENT_BYTES,
                      shared_head_bytes=embed.weight_bytes if dims.tie_word_embeddings else 0,
                      stage_bytes=stage_bytes)


def parameter_count(spec: ArchSpec, dims: ModelDims) -> int:
    """Parameters of the model as its checkpoint holds them (a tied embedding once), norms and biases included."""
    return sum(math.prod(shape) for shape in model_tensors(spec, dims).values())


def tied_copy_bytes(dims: ModelDims, fmt: WeightFormat, stages: int) -> float:
    """Bytes of the second copy of a tied embedding that the last stage of a bundle of 2 or more stages holds
    as its lm_head."""
    return embedding_bytes(dims, fmt) if dims.tie_word_embeddings and stages >= 2 else 0.0


def bits_per_parameter(weight_bytes: float, spec: ArchSpec, dims: ModelDims, fmt: WeightFormat, stages: int) -> float:
    """Stored bits per parameter of a bundle whose stages' weight files hold ``weight_bytes`` in all: every
    parameter counted once, so a tied embedding's second copy (:func:`tied_copy_bytes`) is left out; as
    llama.cpp's files are measured (tensor bytes x 8 / parameters)."""
    return 8.0 * (weight_bytes - tied_copy_bytes(dims, fmt, stages)) / parameter_count(spec, dims)
