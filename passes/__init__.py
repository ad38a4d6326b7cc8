"""The pass library: one pass a file, and the one ordered pipeline that compile runs."""

from __future__ import annotations

from ovshard.bundle.weights import WEIGHT_FORMATS, WeightFormat
from ovshard.ir.pass_manager import GraphPass
from ovshard.passes.compress_weights import CompressWeightsPass
from ovshard.passes.fuse_projections import FuseProjectionsPass
from ovshard.passes.inject_beam_idx_gather import InjectBeamIdxGatherPass
from ovshard.passes.make_stateful_kv import MakeStatefulKVPass
from ovshard.passes.precompute_rotary import PrecomputeRotaryPass
from ovshard.passes.split_zero_points import SplitZeroPointsPass

__all__ = [
    "WEIGHT_FORMATS",
    "CompressWeightsPass",
    "FuseProjectionsPass",
    "InjectBeamIdxGatherPass",
    "MakeStatefulKVPass",
    "PrecomputeRotaryPass",
    "SplitZeroPointsPass",
    "WeightFormat",
    "pipeline",
]


def pipeline(weights: WeightFormat) -> list[GraphPass]:
    """The compile pipeline, in order. Ordering facts are checked in each pass's ``requires``.

    Layer-scoped passes come first: a streamed compile runs them on each piece of a stage (one decoder
    layer, the embedding, the lm_head) and the rest on the joined stage graph.
    """
    return [
        CompressWeightsPass(weights),  # fp16 / NNCF int8 / int4 weights, per WeightFormat (layer scope)
        FuseProjectionsPass(),  # q/k/v and gate/up stored alike -> one MatMul + VariadicSplit (layer scope)
        SplitZeroPointsPass(),  # f16 zero points -> signed codes + a MatMul of group sums (layer scope)
        PrecomputeRotaryPass(),  # rotary frequency math -> Gather by position_ids from a constant table
        MakeStatefulKVPass(),  # past/present KV I/O -> ReadValue (zero initializer) / Assign
        InjectBeamIdxGatherPass(),  # beam_idx i32 Parameter + Gather(axis 0) on every KV ReadValue
    ]
