"""The one description of a pipeline stage: its index among N and its half-open layer range."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING


@dataclass(frozen=True)
class StageSpec:
    """Stage ``index`` of ``num_stages``, holding decoder layers [start, end)."""

    index: int
    num_stages: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.num_stages:
            raise ValueError(f"stage index {self.index} is outside 0..{self.num_stages - 1}")
        if not 0 <= self.start < self.end:
            raise ValueError(f"stage {self.index} has layers [{self.start}, {self.end}); expected 0 <= start < end")

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    @property
    def span(self) -> tuple[int, int]:
        return (self.start, self.end)

    def __str__(self) -> str:
        return f"stage {self.index} [{self.start}, {self.end})"


class OfStage:
    """Mixin for a record about one stage (a plan row, a bundle entry): ``index`` and ``layers`` via ``stage``."""

    if TYPE_CHECKING:
        stage: StageSpec

    @property
    def index(self) -> int:
        return self.stage.index

    @property
    def layers(self) -> tuple[int, int]:
        return self.stage.span


def check_tiling(stages: tuple[StageSpec, ...] | list[StageSpec], num_layers: int) -> None:
    """Raise ValueError unless ``stages`` are 0..N-1 in order and tile [0, num_layers) contiguously."""
    if not stages:
        raise ValueError("expected at least one stage, found none")
    prev_end = 0
    for k, s in enumerate(stages):
        if s.index != k or s.num_stages != len(stages):
            raise ValueError(f"stage {k} is recorded as stage {s.index} of {s.num_stages}; expected {k} of {len(stages)}")
        if s.start != prev_end:
            raise ValueError(f"stage {k} starts at layer {s.start}, expected {prev_end}: the ranges must be "
                             "contiguous and half-open")
        prev_end = s.end
    if prev_end != num_layers:
        raise ValueError(f"the stages cover layers [0, {prev_end}) but the model has {num_layers} layers")
