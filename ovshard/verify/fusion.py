"""Did the CPU plugin fuse the KV cache into attention? Read it off the compiled runtime graph.

StatefulSDPAFusion, when it fires, leaves one ``ScaledDotProductAttention`` node per layer that reads
the ``beam_idx`` input and two ``MemoryInput`` nodes (the K and V state) directly, and no attention
``MatMul``/``Softmax``. Imports only openvino: nodes can run it.

A mixture-of-experts layer is read off the same graph: the CPU plugin's ConvertTiledMoeBlockToGatherMatmuls
turns the tiled expert block (``ovshard.frontend.stage_module.experts_mlp``) into ``GatherMatmul`` nodes
that read only the routed experts' weights, one per expert projection in OpenVINO 2026.4 (gate, up, down;
gpt-oss: gate_up, down); left unconverted, the experts would be batched ``MatMul``s over every expert. The
router's softmax feeds its TopK (or, gpt-oss, is fed by it) and is not attention.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import openvino as ov

from ovshard.bundle import names


@dataclass(frozen=True)
class FusionReport:
    stage: int
    layers: int  # layers in the stage: the number of fused SDPA nodes expected
    fused_sdpa: int  # SDPA nodes reading beam_idx and two MemoryInputs
    unfused_attention: int  # MatMul + Softmax nodes left in the runtime graph
    runtime_ops: dict[str, int]
    explicit_layers: int = 0  # layers whose attention is explicit by design (soft-capping has no SDPA form)
    moe_layers: int = 0  # layers holding a mixture of experts
    gather_matmuls: int = 0  # GatherMatmul nodes: the expert projections that read only the routed experts
    expert_projections: int = 0  # GatherMatmul nodes expected a MoE layer: one per expert projection

    @property
    def expected_fused(self) -> int:
        return self.layers - self.explicit_layers

    @property
    def experts_gathered(self) -> bool:
        """Every MoE layer's projections run as GatherMatmul (trivially true without experts)."""
        return self.gather_matmuls == self.expected_gather_matmuls

    @property
    def expected_gather_matmuls(self) -> int:
        return self.expert_projections * self.moe_layers

    @property
    def ok(self) -> bool:
        left_ok = self.unfused_attention == 0 if self.explicit_layers == 0 else self.unfused_attention > 0
        return self.fused_sdpa == self.expected_fused and left_ok and self.experts_gathered


def _layer_type(node: ov.Node) -> str:
    return str(node.get_rt_info()["layerType"].astype(str))


def _is_fused_sdpa(node: ov.Node) -> bool:
    sources = [v.get_node() for v in node.input_values()]
    memory = sum(_layer_type(s) == "MemoryInput" for s in sources)
    beam = any(_layer_type(s) == "Input" and s.get_friendly_name() == names.BEAM_IDX for s in sources)
    return memory == 2 and beam


def _is_router_softmax(node: ov.Node) -> bool:
    """A softmax whose values go to a TopK, or that a TopK feeds: a MoE router's, not attention's."""
    feeds_topk = any(_layer_type(t.get_node()) == "TopK" for out in node.outputs() for t in out.get_target_inputs())
    return feeds_topk or any(_layer_type(v.get_node()) == "TopK" for v in node.input_values())


def _is_weight_matmul(node: ov.Node) -> bool:
    """A MatMul over a weight, not attention's (whose inputs have dynamic sequence axes): stacked expert weights (a
    static [experts, out, in] input) left ungathered (Llama 4's input-scaled experts), or latent attention's
    per-head kv_b halves absorbed into the query and the output (a static [1, heads, rows, cols] input)."""
    shapes = [v.get_partial_shape() for v in node.input_values()]
    return any(shape.is_static and shape.rank.get_length() in (3, 4) for shape in shapes)


def explicit_attention_layers(manifest, layers: int) -> int:
    """How many of a stage's ``layers`` compute attention explicitly: all of them under soft-capping (Gemma 2)
    or attention sinks (gpt-oss)."""
    arch = manifest.architecture
    return layers if arch.attention_softcap is not None or arch.attention_sinks else 0


def moe_layers(manifest, layers: tuple[int, int]) -> int:
    """How many of the layers [start, end) hold a mixture of experts (a MoE model's dense layers do not) in the tiled
    form the CPU plugin gathers; Llama 4's experts scale their inputs, not their outputs, which that form holds only
    with one expert a token: with more, none, by design."""
    if manifest.architecture.expert_input_scores and manifest.architecture.experts_per_token > 1:
        return 0
    return sum(manifest.architecture.sparse(i) for i in range(*layers))


def runtime_fusion(compiled: ov.CompiledModel, stage: int, layers: int, explicit_layers: int = 0,
                   moe_layers: int = 0, expert_projections: int = 0) -> FusionReport:
    ops = compiled.get_runtime_model().get_ordered_ops()
    kinds = Counter(_layer_type(op) for op in ops)
    fused = sum(1 for op in ops if _layer_type(op) == "ScaledDotProductAttention" and _is_fused_sdpa(op))
    routers = sum(1 for op in ops if _layer_type(op) == "Softmax" and _is_router_softmax(op))
    weights = sum(1 for op in ops if _layer_type(op) == "MatMul" and _is_weight_matmul(op))
    unfused = kinds.get("MatMul", 0) + kinds.get("Softmax", 0) - routers - weights
    return FusionReport(stage, layers, fused, unfused, dict(kinds), explicit_layers, moe_layers,
                        kinds.get("GatherMatmul", 0), expert_projections)


def check_cpu_fusion(bundle: Path, manifest, core: ov.Core | None = None) -> list[FusionReport]:
    """Compile every stage of a bundle on CPU and report its KV-cache fusion."""
    core = core or ov.Core()
    reports = []
    for entry in manifest.stages:
        compiled = core.compile_model(str(Path(bundle) / entry.model_xml), "CPU")
        layers = entry.layers[1] - entry.layers[0]
        reports.append(runtime_fusion(compiled, entry.index, layers, explicit_attention_layers(manifest, layers),
                                      moe_layers(manifest, entry.layers), manifest.architecture.expert_projections))
    return reports
