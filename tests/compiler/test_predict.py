"""The static fusion predictor against real IRs broken on purpose, and against the real CPU compile."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
from conftest import compile_fp32
from openvino.op.util import Variable, VariableInfo

from ovshard.bundle import names
from ovshard.bundle.manifest import read_manifest
from ovshard.ir import graph
from ovshard.verify import predict

LAYERS = 5  # stories260K


@pytest.fixture(scope="module")
def good(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> ov.Model:
    bundle = compile_fp32(stories, tmp_path_factory.mktemp("predict") / "b", stages=1)
    return ov.Core().read_model(str(bundle / names.SINGLE_STAGE_XML))


def _node(model: ov.Model, kind: str, vid: str) -> ov.Node:
    return next(n for n in graph.ops_of_type(model, kind) if graph.variable_id(n) == vid)


def _variable(model: ov.Model, vid: str) -> Variable:
    return next(v for v in model.get_variables() if v.get_info().variable_id == vid)


def _layer_sdpa(model: ov.Model, layer: int) -> str:
    """Friendly name of the SDPA that layer ``layer``'s key cache reaches (the fused op keeps it)."""
    node = _node(model, "Assign", names.past_key(layer)).input_value(0).get_node()
    if node.get_type_name() == "Convert":  # an f16 state's Concat -> Convert -> Assign
        node = node.input_value(0).get_node()
    skip = ("Assign", "ShapeOf", "Convert")
    while node.get_type_name() != "ScaledDotProductAttention":  # Concat -> GQA reshapes -> SDPA
        node = next(n for n in graph.consumers(node) if n.get_type_name() not in skip)
    return node.get_friendly_name()


def _fused_on_cpu(model: ov.Model) -> set[str]:
    """Names of the runtime SDPA nodes that read beam_idx and two MemoryInputs: the CPU fusion fired."""
    def kind(node: ov.Node) -> str:
        return str(node.get_rt_info()["layerType"].astype(str))

    fused = set()
    for op in ov.Core().compile_model(model, "CPU").get_runtime_model().get_ordered_ops():
        sources = [v.get_node() for v in op.input_values()]
        memory = sum(kind(s) == "MemoryInput" for s in sources)
        beam = any(s.get_friendly_name() == names.BEAM_IDX for s in sources)
        if kind(op) == "ScaledDotProductAttention" and memory == 2 and beam:
            fused.add(op.get_friendly_name())
    return fused


def _failed(pred: predict.Prediction) -> set[tuple[str, str]]:
    return {(c.subject, c.condition) for c in pred.checks if not c.holds}


def _subject(layer: int) -> str:
    return f"layer {layer} ({names.past_key(layer).rsplit('.', 1)[0]}.key/value)"


def _assert_cpu_agrees(model: ov.Model, broken: set[int]) -> None:
    """The real CPU compile fuses exactly the layers outside ``broken``, as predicted."""
    fused = _fused_on_cpu(model)
    assert {layer for layer in range(LAYERS) if _layer_sdpa(model, layer) not in fused} == broken
    assert predict.predict_model(model, "CPU").fused_layers == LAYERS - len(broken)


# ---- the broken copies: each changes exactly one thing ---------------------------------------------


def _reduced_precision_state(model: ov.Model, vid: str) -> None:
    """Keep ``vid`` in f16: ReadValue(f16) -> Convert(f32) -> Gather; Concat -> Convert(f16) -> Assign."""
    read, assign = _node(model, "ReadValue", vid), _node(model, "Assign", vid)
    info = VariableInfo()
    info.data_shape, info.data_type, info.variable_id = read.get_output_partial_shape(0), ov.Type.f16, vid
    variable = Variable(info)
    new_read = ops.read_value(ops.convert(read.input_value(0), "f16"), variable)
    graph.redirect(read.output(0), ops.convert(new_read, "f32").output(0))
    new_assign = ops.assign(ops.convert(assign.input_value(0), "f16"), variable)
    model.remove_sink(assign)
    model.remove_variable(_variable(model, vid))
    model.add_variables([variable])
    model.add_sinks([new_assign])


def _convert_before_gather(model: ov.Model) -> None:
    _reduced_precision_state(model, names.past_key(2))
    _reduced_precision_state(model, names.past_value(2))


def _nop_convert_before_gather(model: ov.Model) -> None:
    read = _node(model, "ReadValue", names.past_key(0))
    gather = graph.consumers(read)[0]
    gather.input(0).replace_source_output(ops.convert(read, "f32").output(0))


def _beam_idx_i64(model: ov.Model) -> None:
    graph.parameter(model, names.BEAM_IDX).set_element_type(ov.Type.i64)


def _no_gather(model: ov.Model) -> None:
    read = _node(model, "ReadValue", names.past_key(1))
    gather = graph.consumers(read)[0]
    graph.redirect(gather.output(0), read.output(0))


def _second_beam_idx(model: ov.Model) -> None:
    other = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx_v")
    other.output(0).get_tensor().set_names({"beam_idx_v"})
    model.add_parameters([other])
    gather = graph.consumers(_node(model, "ReadValue", names.past_value(3)))[0]
    gather.input(1).replace_source_output(other.output(0))


def _no_initializer(model: ov.Model) -> None:
    read = _node(model, "ReadValue", names.past_value(4))
    graph.redirect(read.output(0), ops.read_value(_variable(model, names.past_value(4))).output(0))


def _broken(good: ov.Model, edit: Callable[[ov.Model], None]) -> ov.Model:
    model = good.clone()
    edit(model)
    model.validate_nodes_and_infer_types()
    return model


def _one_layer(sdpa: bool) -> ov.Model:
    """A hand-built one-layer stateful graph: ReadValue(init) -> Gather(beam_idx) -> Concat -> attention."""
    # q, k, v: [batch, heads, seq, head_dim]
    q, k_new, v_new = (ops.parameter([-1, 2, -1, 4], ov.Type.f32, name=n) for n in ("q", "k", "v"))
    beam = ops.parameter([-1], ov.Type.i32, name=names.BEAM_IDX)
    beam.output(0).get_tensor().set_names({names.BEAM_IDX})
    batch = ops.gather(ops.shape_of(q), ops.constant(np.array([0], np.int64)), ops.constant(np.int64(0)))
    empty = ops.concat([batch, ops.constant(np.array([2, 0, 4], np.int64))], 0)  # [B, H, 0, D]
    caches, sinks = [], []
    for vid, new in ((names.past_key(0), k_new), (names.past_value(0), v_new)):
        info = VariableInfo()
        info.data_shape, info.data_type, info.variable_id = ov.PartialShape([-1, 2, -1, 4]), ov.Type.f32, vid
        variable = Variable(info)
        read = ops.read_value(ops.broadcast(ops.constant(np.float32(0)), empty), variable)
        cache = ops.concat([ops.gather(read, beam, ops.constant(np.int64(0))), new], 2)
        caches.append(cache)
        sinks.append(ops.assign(cache, variable))
    if sdpa:
        out = ops.scaled_dot_product_attention(q, caches[0], caches[1], causal=False)
    else:
        scores = ops.multiply(ops.matmul(q, caches[0], False, True), ops.constant(np.float32(0.5)))
        out = ops.matmul(ops.softmax(scores, -1), caches[1], False, False)
    return ov.Model([ops.result(out)], sinks, [q, k_new, v_new, beam], "one_layer")


# ---- tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["CPU", "GPU"])
def test_good_stage_every_check_holds(good: ov.Model, device: str) -> None:
    """An ovshard stage meets every fusion condition of both plugins, on every layer."""
    pred = predict.predict_model(good, device)
    assert pred.layers == LAYERS and pred.fused_layers == LAYERS and pred.ok, predict.format_predictions([pred])


def test_good_stage_fuses_on_cpu(good: ov.Model) -> None:
    """The real CPU compile of the good stage fuses every layer, as predicted."""
    _assert_cpu_agrees(good, broken=set())


def test_convert_between_readvalue_and_gather(good: ov.Model) -> None:
    """An f16 state read through a Convert: GPU loses the direct Gather, and the CPU fusion fails too."""
    model = _broken(good, _convert_before_gather)
    gpu, cpu = predict.predict_model(model, "GPU"), predict.predict_model(model, "CPU")
    assert _failed(gpu) == {(_subject(2), predict.GATHER_DIRECT), (_subject(2), predict.STATE_TYPE)}
    # the CPU pattern admits one Convert, but precision conversion runs first: measured, it does not fuse
    assert _failed(cpu) == {(_subject(2), predict.STATE_TYPE)}
    _assert_cpu_agrees(model, broken={2})


def test_type_keeping_convert_is_harmless(good: ov.Model) -> None:
    """A Convert f32 -> f32 between ReadValue and Gather is dropped by the plugins: predicted and real fusion."""
    model = _broken(good, _nop_convert_before_gather)
    assert predict.predict_model(model, "CPU").ok and predict.predict_model(model, "GPU").ok
    _assert_cpu_agrees(model, broken=set())


def test_beam_idx_i64(good: ov.Model) -> None:
    """An i64 beam_idx fails the CPU's i32 condition on every layer; the GPU does not care."""
    model = _broken(good, _beam_idx_i64)
    expected = {(_subject(layer), predict.BEAM_I32) for layer in range(LAYERS)}
    assert _failed(predict.predict_model(model, "CPU")) == expected
    assert predict.predict_model(model, "GPU").ok
    _assert_cpu_agrees(model, broken=set(range(LAYERS)))


def test_gather_removed(good: ov.Model) -> None:
    """Without the Gather on layer 1's keys both plugins lose that layer, and the detail names the key."""
    model = _broken(good, _no_gather)
    cpu, gpu = predict.predict_model(model, "CPU"), predict.predict_model(model, "GPU")
    assert _failed(cpu) == {(_subject(1), predict.GATHERED)}
    assert _failed(gpu) == {(_subject(1), predict.GATHER_DIRECT)}
    detail = next(c.detail for c in cpu.checks if not c.holds)
    assert names.past_key(1) in detail and names.past_value(1) not in detail
    _assert_cpu_agrees(model, broken={1})


def test_matmul_attention_is_not_fused_on_cpu() -> None:
    """MatMul/Softmax attention fails the CPU's SDPA condition and does not fuse; the SDPA control does."""
    matmul, control = _one_layer(sdpa=False), _one_layer(sdpa=True)
    subject = _subject(0)
    assert _failed(predict.predict_model(matmul, "CPU")) == {(subject, predict.SDPA)}
    assert predict.predict_model(matmul, "GPU").ok  # IndirectGemm reads the beam table
    assert predict.predict_model(control, "CPU").ok and predict.predict_model(control, "GPU").ok
    assert not _fused_on_cpu(matmul)
    assert len(_fused_on_cpu(control)) == 1


def test_k_and_v_gathered_by_different_indices(good: ov.Model) -> None:
    """Layer 3's V gathered by a second index Parameter fails 'same beam_idx' on both devices."""
    model = _broken(good, _second_beam_idx)
    for device in ("CPU", "GPU"):
        assert _failed(predict.predict_model(model, device)) == {(_subject(3), predict.SAME_BEAM)}
    _assert_cpu_agrees(model, broken={3})


def test_readvalue_without_initializer(good: ov.Model) -> None:
    """A ReadValue without initializer fails the CPU condition (compile raises); the GPU does not need one."""
    model = _broken(good, _no_initializer)
    assert _failed(predict.predict_model(model, "CPU")) == {(_subject(4), predict.INITIALIZER)}
    assert predict.predict_model(model, "GPU").ok
    with pytest.raises(RuntimeError, match="ReadValue"):
        ov.Core().compile_model(model, "CPU")


def test_predict_bundle_two_stages(stories: Path, tmp_path: Path) -> None:
    """predict_bundle gives one Prediction per stage and device, all ok, and a readable table."""
    bundle = compile_fp32(stories, tmp_path / "b", stages=2)
    preds = predict.predict_bundle(bundle, read_manifest(bundle), ["CPU", "GPU"])
    assert [(p.stage, p.device) for p in preds] == [(0, "CPU"), (0, "GPU"), (1, "CPU"), (1, "GPU")]
    assert all(p.ok for p in preds) and sum(p.layers for p in preds) == 2 * LAYERS
    table = predict.format_predictions(preds)
    assert predict.SAME_BEAM in table and "FAIL" not in table


@pytest.mark.skipif("GPU" not in ov.Core().available_devices, reason="no Intel GPU visible to OpenVINO here")
def test_good_stage_has_kv_cache_on_gpu(good: ov.Model) -> None:
    """On a real GPU the good stage's runtime graph holds one kv_cache node per variable, fed by beam_idx."""
    runtime = ov.Core().compile_model(good, "GPU").get_runtime_model()

    def kind(node: ov.Node) -> str:
        return str(node.get_rt_info()["layerType"].astype(str)).lower().replace("_", "")

    def reads_beam_idx(node: ov.Node, hops: int = 3) -> bool:
        sources = [v.get_node() for v in node.input_values()]
        return any(s.get_friendly_name() == names.BEAM_IDX or (hops > 1 and kind(s) in ("reorder", "convert")
                                                              and reads_beam_idx(s, hops - 1)) for s in sources)

    caches = [op for op in runtime.get_ordered_ops() if "kvcache" in kind(op)]
    assert len(caches) == 2 * LAYERS, sorted({kind(op) for op in runtime.get_ordered_ops()})
    assert all(reads_beam_idx(op) for op in caches)


def test_compile_warns_when_a_fusion_would_not_fire(good: ov.Model, caplog: pytest.LogCaptureFixture) -> None:
    """The predictor compile runs after each stage warns naming the stage, device, layer and condition."""
    from ovshard.bundle.dims import ModelDims
    from ovshard.bundle.stage import StageSpec
    from ovshard.compile import PREDICTED_DEVICES
    from ovshard.ir.pass_manager import PassContext
    from ovshard.verify.predict import PredictFusionInstrument

    dims = ModelDims("llama", 64, 5, 8, 4, 8, 172, 512, 1e-5, True, False, False, 512, "default", 10000.0)
    with caplog.at_level("WARNING", logger="ovshard.verify.predict"):
        PredictFusionInstrument(PREDICTED_DEVICES).run_end(_broken(good, _beam_idx_i64),
                                                           PassContext(StageSpec(0, 1, 0, 5), dims, 512))
    assert "stage 0: CPU fusion will not fire for layer 0" in caplog.text
    assert predict.BEAM_I32 in caplog.text
