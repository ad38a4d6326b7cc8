"""The pass manager's contract: error kinds, one failure path for passes and instruments, failure dumps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from ovshard.bundle.dims import ModelDims
from ovshard.bundle.stage import StageSpec
from ovshard.errors import PassError, PostconditionError, PreconditionError
from ovshard.ir.instruments import DumpInstrument, ValidateInstrument
from ovshard.ir.pass_manager import GraphPass, Instrument, PassContext, PassManager, PassResult

DIMS = ModelDims("llama", 8, 1, 2, 2, 4, 16, 32, 1e-5, False, False, False, 16, "default", 10000.0)


def tiny_model() -> ov.Model:
    """hidden_states [?, ?, 8] -> Relu -> hidden_states: a graph inside the stage contract."""
    x = ops.parameter([-1, -1, 8], ov.Type.f32, name="hidden_states")
    x.output(0).get_tensor().set_names({"hidden_states"})
    out = ops.relu(x)
    out.output(0).get_tensor().set_names({"hidden_states"})
    return ov.Model([out], [x], "tiny")


def context() -> PassContext:
    return PassContext(StageSpec(0, 2, 0, 1), DIMS, 16)


class AddOneAndBreakPass(GraphPass):
    """Adds 1 after the Relu in place, then claims a fact that does not hold."""

    def call(self, model: ov.Model, ctx: PassContext) -> PassResult:
        relu = model.get_results()[0].input_value(0)
        plus = ops.add(relu, ops.constant(np.float32(1.0)))
        model.get_results()[0].input(0).replace_source_output(plus.output(0))
        return PassResult(model, modified=True)

    def ensures(self, model: ov.Model, ctx: PassContext) -> None:
        raise self.fail(ctx, "the graph has no Sigmoid")


class RenameOutputPass(GraphPass):
    """Renames the output to a name outside the stage contract (the validating instrument must catch it)."""

    def call(self, model: ov.Model, ctx: PassContext) -> PassResult:
        model.outputs[0].get_tensor().set_names({"not_in_the_contract"})
        return PassResult(model, modified=True)


class NeedsReadValuePass(GraphPass):
    def requires(self, model: ov.Model, ctx: PassContext) -> None:
        raise self.unmet(ctx, "the graph has no ReadValue")

    def call(self, model: ov.Model, ctx: PassContext) -> PassResult:
        raise AssertionError("call must not run when requires fails")


def op_types(model: ov.Model) -> str:
    return ",".join(op.get_type_name() for op in model.get_ordered_ops())


class Recorder(Instrument):
    """Records what on_failure is handed: pass, ops before the pass (if snapshotted), ops left, error type."""

    def __init__(self) -> None:
        self.failures: list[tuple[str, str | None, str, str]] = []

    def on_failure(self, p, before, partial, ctx, n, error) -> None:
        self.failures.append((p.name, None if before is None else op_types(before), op_types(partial),
                              type(error).__name__))


def test_a_failed_precondition_is_a_precondition_error_naming_the_stage() -> None:
    """requires raising stops the pass before call, as a PreconditionError with stage and history."""
    ctx = context()
    ctx.history.append("EarlierPass")
    with pytest.raises(PreconditionError, match=r"stage 0, NeedsReadValuePass \(after passes \[EarlierPass\]\)"):
        PassManager([NeedsReadValuePass()]).run(tiny_model(), ctx)


def test_a_broken_promise_is_a_postcondition_error() -> None:
    """ensures raising is a PostconditionError, a PassError like every pass failure."""
    with pytest.raises(PostconditionError, match="postcondition: the graph has no Sigmoid") as info:
        PassManager([AddOneAndBreakPass()]).run(tiny_model(), context())
    assert isinstance(info.value, PassError)


def test_an_instrument_failure_takes_the_pass_failure_path() -> None:
    """A ValidateInstrument rejection after a pass reaches every instrument's on_failure, as a PostconditionError."""
    recorder = Recorder()
    with pytest.raises(PostconditionError, match="unexpected I/O"):
        PassManager([RenameOutputPass()], [ValidateInstrument(), recorder]).run(tiny_model(), context())
    assert recorder.failures == [("RenameOutputPass", None, "Parameter,Relu,Result", "PostconditionError")]


def test_the_failure_dump_holds_the_graph_before_the_pass_and_the_partial_graph(tmp_path: Path) -> None:
    """With dumps on, the in-place pass's input is cloned first: .failed shows it unchanged, .partial the Add."""
    recorder = Recorder()
    with pytest.raises(PostconditionError):
        PassManager([AddOneAndBreakPass()], [DumpInstrument(tmp_path, after=None), recorder]).run(
            tiny_model(), context())
    stage = tmp_path / "stage0"
    before, partial = (stage / "01_AddOneAndBreakPass.failed.txt").read_text(), (
        stage / "01_AddOneAndBreakPass.partial.txt").read_text()
    assert "Add" not in before and "Relu" in before
    assert "Add" in partial
    assert recorder.failures[0][1] == "Parameter,Relu,Result"  # the snapshot, not the rewritten graph
