"""Instruments around the pass pipeline: graph dumps, print-after-change, validation, progress.

Dumps go to ``<dump-dir>/stage<i>/<NN>_<pass>.<ext>``: ``00_input`` is the traced graph, ``NN`` the
pass's position in the pipeline; a dump before a pass is ``<NN>_<pass>.before.<ext>``. Each dump is
written as OpenVINO IR (``.xml``/``.bin``, opens in Netron), Graphviz DOT (``.dot``; ``ovshard inspect
--format svg`` renders it when ``dot`` is installed) and the deterministic text form (``.txt``) that
golden tests diff.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Collection
from pathlib import Path

import openvino as ov

from ovshard.bundle import names
from ovshard.errors import BundleError, OvshardError, PostconditionError
from ovshard.ir.dot import graph_dot
from ovshard.ir.pass_manager import GraphPass, Instrument, PassContext, PassResult
from ovshard.ir.printer import graph_text

log = logging.getLogger(__name__)

ALL = "all"


def dump_stem(dump_dir: Path, stage: int, n: int, pass_name: str, before: bool = False) -> Path:
    return dump_dir / f"stage{stage}" / f"{n:02d}_{pass_name}{'.before' if before else ''}"


def write_dump(model: ov.Model, stem: Path, with_ir: bool = True) -> None:
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_name(stem.name + ".txt").write_text(graph_text(model))
        dot = graph_dot(model)
        stem.with_name(stem.name + ".dot").write_text(dot)
    except OSError as e:
        raise BundleError(f"cannot write the graph dump {stem}.*: {e.strerror or e}; choose a writable "
                          "--dump-dir") from e
    if with_ir:
        ov.save_model(model, stem.with_name(stem.name + ".xml"), compress_to_fp16=False)


def _selected(selection: Collection[str] | str | None, pass_name: str) -> bool:
    if not selection:
        return False
    return selection == ALL or pass_name in selection


class DumpInstrument(Instrument):
    """Write the graph before and/or after the selected passes (``"all"`` or a set of pass names)."""

    def __init__(self, dump_dir: Path, after: Collection[str] | str | None = ALL,
                 before: Collection[str] | str | None = None, with_ir: bool = True) -> None:
        self.dump_dir, self.after, self.before, self.with_ir = Path(dump_dir), after, before, with_ir

    def run_begin(self, model: ov.Model, ctx: PassContext) -> None:
        shutil.rmtree(self.dump_dir / f"stage{ctx.stage.index}", ignore_errors=True)  # no stale dumps
        write_dump(model, self.dump_dir / f"stage{ctx.stage.index}" / "00_input", self.with_ir)

    def before_pass(self, p: GraphPass, model: ov.Model, ctx: PassContext, n: int) -> None:
        if _selected(self.before, p.name):
            write_dump(model, dump_stem(self.dump_dir, ctx.stage.index, n, p.name, before=True), self.with_ir)

    def after_pass(self, p: GraphPass, result: PassResult, ctx: PassContext, n: int, seconds: float) -> None:
        if _selected(self.after, p.name):
            write_dump(result.model, dump_stem(self.dump_dir, ctx.stage.index, n, p.name), self.with_ir)

    @property
    def wants_before_snapshot(self) -> bool:  # type: ignore[override]
        return True

    def on_failure(self, p: GraphPass, before: ov.Model | None, partial: ov.Model, ctx: PassContext, n: int,
                   error: Exception) -> None:
        """``NN_<pass>.failed.*``: the graph the pass was given; ``NN_<pass>.partial.*``: what it left."""
        stem = dump_stem(self.dump_dir, ctx.stage.index, n, p.name + ".failed")
        if before is not None:
            write_dump(before, stem, self.with_ir)
        partial_stem = dump_stem(self.dump_dir, ctx.stage.index, n, p.name + ".partial")
        try:
            write_dump(partial, partial_stem, self.with_ir)
        except (RuntimeError, OvshardError) as e:  # a half-rewritten graph may not even serialise
            log.warning("stage %d: the partial graph after %s could not be dumped: %s", ctx.stage.index, p.name, e)
        log.error("stage %d: %s failed; the graph it ran on is in %s.*, what it left in %s.*", ctx.stage.index,
                  p.name, stem, partial_stem)


class PrintAfterChangeInstrument(Instrument):
    """Hand the text form of the graph to ``emit`` after every pass that changed it."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit

    def after_pass(self, p: GraphPass, result: PassResult, ctx: PassContext, n: int, seconds: float) -> None:
        if result.modified:
            self.emit(f"// ----- stage {ctx.stage.index} after {p.name} -----\n{graph_text(result.model)}")


class ValidateInstrument(Instrument):
    """After each pass: types and shapes re-infer, and the graph's I/O names stay within the contract."""

    def after_pass(self, p: GraphPass, result: PassResult, ctx: PassContext, n: int, seconds: float) -> None:
        model = result.model
        try:
            model.validate_nodes_and_infer_types()
        except RuntimeError as e:
            raise PostconditionError(f"{ctx.where(p.name)} left an invalid graph: {e}") from e
        allowed_in = {*names.stage_inputs(ctx.stage.first, ctx.stage.layers), names.BEAM_IDX}
        allowed_out = set(names.stage_outputs(ctx.stage.last, ctx.stage.layers))
        found_in = {n for port in model.inputs for n in port.get_names()}
        found_out = {n for port in model.outputs for n in port.get_names()}
        if not found_in <= allowed_in or not found_out <= allowed_out:
            raise PostconditionError(f"{ctx.where(p.name)} left unexpected I/O: inputs {sorted(found_in - allowed_in)}, "
                            f"outputs {sorted(found_out - allowed_out)}")


class ProgressInstrument(Instrument):
    """Log one line per pass: stage, pass, whether it changed the graph, seconds."""

    def after_pass(self, p: GraphPass, result: PassResult, ctx: PassContext, n: int, seconds: float) -> None:
        log.info("stage %d (%d of %d): %-24s %s in %.2f s", ctx.stage.index, ctx.stage.index + 1, ctx.stage.num_stages, p.name,
                 "changed the graph" if result.modified else "no change", seconds)
