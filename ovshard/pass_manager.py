"""Pass infrastructure: a pass is a small class; a manager runs an ordered list with instruments.

Modelled on onnx-ir's ``PassBase`` and TVM's ``PassContext(instruments=...)``: a pass checks its
preconditions in ``requires`` and its promises in ``ensures`` and raises :class:`PassError` with context
when either fails, never silently doing nothing; instrumentation (dumps, timing, validation,
progress) lives outside the passes.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import openvino as ov

from ovshard.errors import PassError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassResult:
    model: ov.Model
    modified: bool


@dataclass(frozen=True)
class StageSpec:
    """One stage of an N-stage split: layers [start, end)."""

    index: int
    num_stages: int
    start: int
    end: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


@dataclass
class PassContext:
    """What a pass may know about the stage it runs on. ``history`` lists the passes run so far."""

    stage: StageSpec
    dims: Any  # ovshard.arch.ModelDims
    max_positions: int
    history: list[str] = field(default_factory=list)

    def where(self, pass_name: str) -> str:
        done = ", ".join(self.history) or "none"
        return f"stage {self.stage.index}, {pass_name} (after passes [{done}])"


class GraphPass(ABC):
    """One named graph rewrite. Subclasses implement ``call``; a second run returns modified=False."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def requires(self, model: ov.Model, ctx: PassContext) -> None:
        """Raise PassError if the graph lacks a fact this pass needs."""

    def ensures(self, model: ov.Model, ctx: PassContext) -> None:
        """Raise PassError if the graph lacks a fact this pass promises."""

    @abstractmethod
    def call(self, model: ov.Model, ctx: PassContext) -> PassResult: ...

    def fail(self, ctx: PassContext, message: str) -> PassError:
        return PassError(f"{ctx.where(self.name)}: {message}")

    def __call__(self, model: ov.Model, ctx: PassContext) -> PassResult:
        self.requires(model, ctx)
        result = self.call(model, ctx)
        self.ensures(result.model, ctx)
        return result


@dataclass(frozen=True)
class PassRecord:
    """One line of the pass log kept in the manifest."""

    stage: int
    name: str
    modified: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "name": self.name, "modified": self.modified, "seconds": round(self.seconds, 4)}


class Instrument:
    """Hooks around every pass. The default implementation does nothing."""

    def run_begin(self, model: ov.Model, ctx: PassContext) -> None: ...

    def before_pass(self, p: GraphPass, model: ov.Model, ctx: PassContext, n: int) -> None: ...

    def after_pass(self, p: GraphPass, result: PassResult, ctx: PassContext, n: int, seconds: float) -> None: ...

    def on_failure(self, p: GraphPass, model: ov.Model, ctx: PassContext, n: int, error: Exception) -> None: ...


class PassManager:
    """Runs an ordered pipeline of passes on one stage's graph."""

    def __init__(self, passes: Sequence[GraphPass], instruments: Sequence[Instrument] = ()) -> None:
        self.passes = list(passes)
        self.instruments = list(instruments)

    def run(self, model: ov.Model, ctx: PassContext) -> tuple[ov.Model, list[PassRecord]]:
        records = []
        for inst in self.instruments:
            inst.run_begin(model, ctx)
        for n, p in enumerate(self.passes, start=1):
            for inst in self.instruments:
                inst.before_pass(p, model, ctx, n)
            start = time.perf_counter()
            try:
                result = p(model, ctx)
            except Exception as e:
                for inst in self.instruments:
                    inst.on_failure(p, model, ctx, n, e)
                if isinstance(e, PassError):
                    raise
                raise PassError(f"{ctx.where(p.name)} failed: {type(e).__name__}: {e}") from e
            seconds = time.perf_counter() - start
            for inst in self.instruments:
                inst.after_pass(p, result, ctx, n, seconds)
            records.append(PassRecord(ctx.stage.index, p.name, result.modified, seconds))
            ctx.history.append(p.name)
            model = result.model
        return model, records
