"""The partition plan as the bundle records it: the stages chosen, their bytes, how they were chosen.

The planner (``ovshard.plan``) builds it; the manifest keeps it; ``ovshard inspect`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ovshard.bundle.stage import OfStage, StageSpec

_COLUMNS = ("stage", "layers", "weights", "KV/token", "memory @ {ctx}", "budget", "act in")


@dataclass(frozen=True)
class StagePlan(OfStage):
    """One planned stage: the stage, its bytes, and what it receives per token over the cut before it."""

    stage: StageSpec
    weight_bytes: int  # layers + embed (stage 0) + head (last stage)
    kv_bytes_per_token: int
    memory_bytes: int  # weight_bytes + kv_bytes_per_token * context_tokens
    budget_bytes: int | None
    activation_bytes_in: int  # per token, 0 for stage 0


@dataclass(frozen=True)
class PartitionPlan:
    """The chosen stages, how they were chosen, and the context length their memory was sized for."""

    strategy: str  # "balanced-reads" | "balanced" (by memory) | "layers" | "budgets" | "budgets-reads"
    context_tokens: int
    stages: tuple[StagePlan, ...]

    @property
    def specs(self) -> tuple[StageSpec, ...]:
        return tuple(s.stage for s in self.stages)

    def format_table(self) -> str:
        """A fixed-width table, one row a stage, then a total row."""
        head = [c.format(ctx=self.context_tokens) for c in _COLUMNS]
        rows = [head, *(_table_row(s) for s in self.stages)]
        budgets = [s.budget_bytes for s in self.stages]
        total_budget = None if None in budgets else sum(b or 0 for b in budgets)
        sizes = [sum(s.weight_bytes for s in self.stages), sum(s.kv_bytes_per_token for s in self.stages)]
        sizes.append(sum(s.memory_bytes for s in self.stages))
        span = format_range((self.stages[0].stage.start, self.stages[-1].stage.end))
        rows.append(["total", span, *map(format_bytes, sizes), _fmt_opt(total_budget), "-"])
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _table_row(s: StagePlan) -> list[str]:
    sizes = (s.weight_bytes, s.kv_bytes_per_token, s.memory_bytes)
    budget, act_in = _fmt_opt(s.budget_bytes), format_bytes(s.activation_bytes_in)
    return [str(s.index), format_range(s.layers), *map(format_bytes, sizes), budget, act_in]


def format_range(r: tuple[int, int]) -> str:
    return f"[{r[0]}, {r[1]})"


def _fmt_opt(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def format_bytes(n: int) -> str:
    """Binary human units with one decimal: ``512 B``, ``310.5 MiB``, ``2.0 GiB``."""
    sign, value = ("-" if n < 0 else ""), float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if round(value, 1) < 1024 or unit == "TiB":
            return f"{sign}{value:.1f} {unit}"
    raise AssertionError("unreachable")
