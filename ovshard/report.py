"""What a compile tells its user about time and memory: a line after each stage, a table at the end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ovshard.bundle.plan import format_bytes, format_range
from ovshard.bundle.stage import OfStage, StageSpec
from ovshard.memory import MemoryPeak, read_status

_COLUMNS = ("stage", "layers", "seconds", "peak anon", "peak RSS")


@dataclass(frozen=True)
class StageFigures(OfStage):
    """How long one stage took to compile and the most memory the compiler held meanwhile."""

    stage: StageSpec
    seconds: float
    peak: MemoryPeak


@dataclass
class LayerProgress:
    """The compile's decoder layers done so far, and the seconds they took (layer pieces only: the embedding,
    the lm_head and the tokenizer are not counted), for one progress line a layer piece and the final summary."""

    total: int = 0  # layers this compile builds
    done: int = 0
    seconds: float = 0.0

    @property
    def seconds_per_layer(self) -> float | None:
        return self.seconds / self.done if self.done else None

    def add(self, layers: int, seconds: float) -> str:
        """Count a finished piece of ``layers`` layers; ``12 of 16 layers, 2.1 s a layer, about 8 s left, peak
        1.2 GB resident so far``."""
        self.done += layers
        self.seconds += seconds
        per = self.seconds / self.done
        left = max(self.total - self.done, 0)
        return (f"{self.done} of {self.total} layers, {per:.1f} s a layer, about {per * left:.0f} s left, peak "
                f"{_bytes(read_status().get('hwm'))} resident so far")


def stage_done(done: Sequence[StageFigures], stages: Sequence[StageSpec]) -> str:
    """``stage 0: peak memory ...; about 12 s left for 2 more stages (5 layers)``: the stages still to
    compile, at the seconds per layer of those done."""
    last = done[-1]
    line = (f"stage {last.index}: peak memory {_bytes(last.peak.anon_bytes)} anonymous, "
            f"{_bytes(last.peak.rss_bytes)} resident")
    left = [s for s in stages if s.index > last.index]
    if not left:
        return line
    per_layer = sum(f.seconds for f in done) / sum(len(f.stage.layers) for f in done)
    layers = sum(len(s.layers) for s in left)
    plural = "s" if len(left) > 1 else ""
    return f"{line}; about {per_layer * layers:.0f} s left for {len(left)} more stage{plural} ({layers} layers)"


def format_report(figures: Sequence[StageFigures], seconds: float) -> str:
    """A fixed-width table, one row a stage, then the whole compile (its time, the largest peaks)."""
    rows = [list(_COLUMNS)]
    for f in figures:
        rows.append([str(f.index), format_range(f.layers), f"{f.seconds:.1f}", _bytes(f.peak.anon_bytes),
                     _bytes(f.peak.rss_bytes)])
    anon = [f.peak.anon_bytes for f in figures if f.peak.anon_bytes is not None]
    rss = [f.peak.rss_bytes for f in figures if f.peak.rss_bytes is not None]
    span = (figures[0].stage.start, figures[-1].stage.end) if figures else (0, 0)
    rows.append(["total", format_range(span), f"{seconds:.1f}", _bytes(max(anon, default=None)),
                 _bytes(max(rss, default=None))])
    widths = [max(len(r[c]) for r in rows) for c in range(len(_COLUMNS))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _bytes(n: int | None) -> str:
    return "n/a" if n is None else format_bytes(n)
