"""Cost model for the partition planner: bytes of each block after compression, KV bytes per token.

Weight bytes are estimates from tensor shapes (no data is read): INT4 counts half a byte per weight
plus an f16 scale and a 4-bit zero point per group; formats that keep the embedding and the last
MatMul of a stage in INT8 (``all_layers=False``) count those at one byte. KV cache and activations
count two bytes an element (f16), what the plugins store by default.
"""

from __future__ import annotations

from ovshard.bundle.dims import ModelDims
from ovshard.bundle.weights import WeightFormat
from ovshard.frontend.arch import ArchSpec, layer_tensors
from ovshard.plan.partition import Block, ModelCosts

KV_ELEMENT_BYTES = 2
WIRE_ELEMENT_BYTES = 2


def bytes_per_weight(fmt: WeightFormat, backup_int8: bool = False) -> float:
    """Average stored bytes per weight element of a MatMul/embedding in format ``fmt``."""
    if fmt.mode == "fp32":
        return 4.0
    if fmt.mode == "fp16":
        return 2.0
    if fmt.mode == "int8" or backup_int8:
        return 1.0
    # a f16 scale (and, asymmetric, a 4-bit zero point) per group; -1 means one per output channel, which
    # over a row of hundreds of inputs or more is below the rounding of the estimate
    per_group = 2.0 + (0.5 if fmt.mode == "int4_asym" else 0.0)
    int4 = 0.5 + (per_group / fmt.group_size if fmt.group_size > 0 else 0.0)
    return fmt.ratio * int4 + (1 - fmt.ratio) * 1.0


def _matrix_bytes(shapes: dict[str, tuple[int, ...]], fmt: WeightFormat) -> int:
    total = 0.0
    for shape in shapes.values():
        elements = 1
        for d in shape:
            elements *= d
        total += elements * (bytes_per_weight(fmt) if len(shape) == 2 else 4.0)  # norms and biases stay f32
    return int(total)


def model_costs(spec: ArchSpec, dims: ModelDims, fmt: WeightFormat) -> ModelCosts:
    """The planner's view of the model: embed, one block per layer, head."""
    int8_backup = fmt.mode.startswith("int4") and not fmt.all_layers
    table = dims.vocab_size * dims.hidden_size
    embed = Block("embed", "embed", None, int(table * bytes_per_weight(fmt, int8_backup)), 0)
    kv = 2 * dims.num_kv_heads * dims.head_dim * KV_ELEMENT_BYTES
    layers = [
        Block(f"layer.{i}", "layer", i, _matrix_bytes(layer_tensors(spec, dims, i), fmt), kv)
        for i in range(dims.num_layers)
    ]
    head = Block("head", "head", None, int(table * bytes_per_weight(fmt, int8_backup)) + 4 * dims.hidden_size, 0)
    return ModelCosts(blocks=(embed, *layers, head), activation_bytes_per_token=dims.hidden_size * WIRE_ELEMENT_BYTES)
