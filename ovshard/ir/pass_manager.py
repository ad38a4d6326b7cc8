"""Pass infrastructure: a pass is a small class; a manager runs an ordered list with instruments.

Modelled on onnx-ir's ``PassBase`` and TVM's ``PassContext(instruments=...)``: a pass checks its
preconditions in ``requires`` (raising :class:`PreconditionError`) and its promises in ``ensures``
(raising :class:`PostconditionError`), never silently doing nothing; each pass declares whether it
rewrites the graph it is given in place. Instrumentation (dumps, timing, validation, progress, the
fusion prediction) lives outside the passes. A failure anywhere in a step, the pass itself or an
instrument validating after it, takes one path: every instrument's ``on_failure`` sees the graph as it
was before the pass (when one asked for it) and the partial graph, then a :class:`PassError` naming the
stage and the passes run so far propagates.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import openvino as ov

from ovshard.bundle.dims import ModelDims
from ovshard.bundle.manifest import PassRecord
from ovshard.bundle.stage import StageSpec
from ovshard.errors import PassError, PostconditionError, PreconditionError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassResult:
    model: ov.Model
    modified: bool


@dataclass(frozen=True)
class Piece:
    """A part of a stage that a streamed compile runs the layer-scoped passes on by itself.

    ``kind``: "embedding", "layers" (decoder layers [start, end)) or "head" (the lm_head); the prologue and
    the final norm hold no weight a pass rewrites.
    """

    kind: str
    start: int | None = None
    end: int | None = None

    def __str__(self) -> str:
        if self.kind != "layers":
            return self.kind
        return f"layer {self.start}" if self.end == (self.start or 0) + 1 else f"layers [{self.start}, {self.end})"


class Calibration(Protocol):
    """What a calibrated streamed compile knows about a piece's inputs (``ovshard.frontend.calibration``)."""

    def __call__(self, piece: Piece) -> list[dict[str, np.ndarray]] | None:
        """The piece's calibration inputs for NNCF: one dict of input name -> array per sample (None for a piece
        that has none, such as the embedding)."""

    def fit_int4(self, key: str, weight: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
        """Symmetric INT4 of decoder weight ``key`` (``"3.down"``; ``weight`` [out, in] f32) fitted to its inputs:
        int8 codes in [-8, 7] [out, in / group, group] and f16 scales [out, in / group, 1]; stacked experts
        ([experts, out, in]: ``"3.experts_down"``) each to its routed tokens' inputs, with a leading experts axis."""

    def fit_table(self, weight: np.ndarray, group: int, asym: bool = False) -> tuple[np.ndarray, ...]:
        """INT4 of rows of the lm_head (or of the embedding tied to it; ``weight`` [rows, hidden] f32) fitted to the
        lm_head's inputs, the final hidden states after the final norm: symmetric as :meth:`fit_int4` returns;
        ``asym``: uint8 codes in [0, 15], uint8 zero points [rows, groups, 1] and f16 scales."""

    def weights(self, layer: int) -> Any | None:
        """Layer ``layer``'s float32 weights (``ovshard.frontend.stage_module.Weights``) if the calibration loaded
        them already (``ovshard.frontend.fit_ahead``), for the trace to take; None: the trace loads them."""

    def lend(self, first: int, weights: Sequence[Any]) -> None:
        """The float32 weights (``ovshard.frontend.stage_module.Weights``) of layers ``first``, ``first + 1`` ...,
        loaded to trace their piece: the float32 runs that catch those layers' matmul inputs read them instead of
        loading them again. Each call replaces what was lent before; an empty list takes it all back."""


@dataclass
class PassContext:
    """What a pass may know about the stage it runs on. ``history`` lists the passes run so far.

    ``piece`` is set when a layer-scoped pass runs on one piece of the stage (a streamed compile).
    ``calibration``, in a calibrated streamed compile, gives a piece's calibration inputs, or fits its INT4
    weights to them (:class:`Calibration`).
    """

    stage: StageSpec
    dims: ModelDims
    max_positions: int
    history: list[str] = field(default_factory=list)
    piece: Piece | None = None
    calibration: Calibration | None = None

    def where(self, pass_name: str) -> str:
        done = ", ".join(self.history) or "none"
        piece = f" on {self.piece}" if self.piece is not None else ""
        return f"stage {self.stage.index}, {pass_name}{piece} (after passes [{done}])"


class GraphPass(ABC):
    """One named graph rewrite. Subclasses implement ``call``; a second run returns modified=False.

    ``in_place``: the pass rewrites the model it is given (and returns it) rather than building a new one;
    the manager clones the graph first when an instrument wants the graph as it was before the pass.
    ``scope``: "stage" passes need the whole stage graph; "layer" passes touch each weight on its own,
    so a streamed compile runs them on each piece of the stage (``ctx.piece``) before joining the pieces.
    """

    in_place: bool = True
    scope: str = "stage"

    @property
    def name(self) -> str:
        return type(self).__name__

    def requires(self, model: ov.Model, ctx: PassContext) -> None:
        """Raise (``self.unmet``) if the graph lacks a fact this pass needs."""

    def ensures(self, model: ov.Model, ctx: PassContext) -> None:
        """Raise (``self.fail``) if the graph lacks a fact this pass promises."""

    @abstractmethod
    def call(self, model: ov.Model, ctx: PassContext) -> PassResult: ...

    def unmet(self, ctx: PassContext, message: str) -> PreconditionError:
        """The error for a failed precondition."""
        return PreconditionError(f"{ctx.where(self.name)}: precondition: {message}")

    def error(self, ctx: PassContext, message: str) -> PassError:
        """The error for a graph the pass cannot rewrite."""
        return PassError(f"{ctx.where(self.name)}: {message}")

    def fail(self, ctx: PassContext, message: str) -> PostconditionError:
        """The error for a broken promise."""
        return PostconditionError(f"{ctx.where(self.name)}: postcondition: {message}")

    def __call__(self, model: ov.Model, ctx: PassContext) -> PassResult:
        self.requires(model, ctx)
        result = self.call(model, ctx)
        self.ensures(result.model, ctx)
        return result


class Instrument:
    """Hooks around every pass. The default implementation does nothing.

    ``wants_before_snapshot``: on a failure, hand ``on_failure`` the graph as it was before the pass
    (the manager clones it before each in-place pass, which costs memory: only dumps ask for it).
    """

    wants_before_snapshot: bool = False

    def run_begin(self, model: ov.Model, ctx: PassContext) -> None: ...

    def before_pass(self, p: GraphPass, model: ov.Model, ctx: PassContext, n: int) -> None: ...

    def after_pass(self, p: GraphPass, result: PassResult, ctx: PassContext, n: int, seconds: float) -> None: ...

    def on_failure(self, p: GraphPass, before: ov.Model | None, partial: ov.Model, ctx: PassContext, n: int,
                   error: Exception) -> None: ...

    def run_end(self, model: ov.Model, ctx: PassContext) -> None: ...


class PassManager:
    """Runs an ordered pipeline of passes on one stage's graph."""

    def __init__(self, passes: Sequence[GraphPass], instruments: Sequence[Instrument] = ()) -> None:
        self.passes = list(passes)
        self.instruments = list(instruments)

    def run(self, model: ov.Model, ctx: PassContext,
            done: dict[str, tuple[ov.Model, PassRecord]] | None = None) -> tuple[ov.Model, list[PassRecord]]:
        """Run the pipeline on ``model``. ``done``: passes already run piece by piece (a streamed compile),
        by name, with the joined graph they produced and their summed record; the instruments see them as
        if they had run here, so dumps, validation and the pass log are the same."""
        records = []
        for inst in self.instruments:
            inst.run_begin(model, ctx)
        snapshot = any(inst.wants_before_snapshot for inst in self.instruments)
        for n, p in enumerate(self.passes, start=1):
            if done is not None and p.name in done:
                model, record = self._replay(p, model, done[p.name], ctx, n)
            else:
                model, record = self._step(p, model, ctx, n, snapshot)
            records.append(record)
            ctx.history.append(p.name)
        for inst in self.instruments:
            inst.run_end(model, ctx)
        return model, records

    def _step(self, p: GraphPass, model: ov.Model, ctx: PassContext, n: int,
              snapshot: bool) -> tuple[ov.Model, PassRecord]:
        """Run pass ``p`` and the instruments after it; any failure goes through ``_failed``."""
        for inst in self.instruments:
            inst.before_pass(p, model, ctx, n)
        before = model.clone() if snapshot and p.in_place else (model if snapshot else None)
        start = time.perf_counter()
        try:
            result = p(model, ctx)
            seconds = time.perf_counter() - start
            for inst in self.instruments:
                inst.after_pass(p, result, ctx, n, seconds)
        except Exception as e:
            error = self._failed(p, before, model, ctx, n, e)
            if error is e:
                raise
            raise error from e
        return result.model, PassRecord(ctx.stage.index, p.name, result.modified, round(seconds, 4))

    def _replay(self, p: GraphPass, model: ov.Model, done: tuple[ov.Model, PassRecord], ctx: PassContext,
                n: int) -> tuple[ov.Model, PassRecord]:
        after, record = done
        for inst in self.instruments:
            inst.before_pass(p, model, ctx, n)
        result = PassResult(after, record.modified)
        try:
            for inst in self.instruments:
                inst.after_pass(p, result, ctx, n, record.seconds)
        except Exception as e:
            error = self._failed(p, model, after, ctx, n, e)
            if error is e:
                raise
            raise error from e
        return after, record

    def _failed(self, p: GraphPass, before: ov.Model | None, partial: ov.Model, ctx: PassContext, n: int,
                error: Exception) -> PassError:
        for inst in self.instruments:
            try:
                inst.on_failure(p, before, partial, ctx, n, error)
            except Exception as e:  # a failing failure hook must not hide the original error
                log.error("stage %d: %s.on_failure raised %s: %s", ctx.stage.index, type(inst).__name__,
                          type(e).__name__, e)
        if isinstance(error, PassError):
            return error
        return PassError(f"{ctx.where(p.name)} failed: {type(error).__name__}: {error}")
