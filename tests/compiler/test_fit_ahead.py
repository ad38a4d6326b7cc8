"""The calibration run ahead of the compression (ovshard/frontend/fit_ahead.py) stores the bytes of fitting in turn.

stories260K's default compile (calibrated, the scale fit) at 2 stages, three ways: the activations alone (each
layer run and fitted when its compression asks), the fits on their own thread beside the conversion, and each
next layer loaded and prepared ahead, each weight fitted while its layer's float32 run goes on (what a machine
with ``AHEAD_THREADS`` torch threads does). Every stored weight is the same byte for byte, and the compression
took every fit from the thread rather than fitting again. The same for a mixture of experts, whose stacked experts
are fitted after their layer's run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from families import moe_with_tokenizer

from ovshard import compile as compile_module
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.frontend import fit_ahead

pytestmark = pytest.mark.slow


def _bins(bundle: Path) -> dict[str, str]:
    return {str(f.relative_to(bundle)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(bundle.rglob("*.bin"))}


def _recorded() -> tuple[type[fit_ahead.FitAhead], list[fit_ahead.FitAhead]]:
    """A FitAhead that keeps each one made, and the list it keeps them in."""
    made: list[fit_ahead.FitAhead] = []

    class Recorded(fit_ahead.FitAhead):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)  # type: ignore[arg-type]
            made.append(self)

    return Recorded, made


def test_fitting_ahead_stores_the_same_bytes(stories: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Recorded, made = _recorded()

    def compile_with(name: str, kind: object, ahead_threads: int) -> dict[str, str]:
        monkeypatch.setattr(compile_module, "FitAhead", kind)
        monkeypatch.setattr(fit_ahead, "AHEAD_THREADS", ahead_threads)
        compile_bundle(CompileConfig(stories, tmp_path / name, stages=2, cache_dir=None))
        return _bins(tmp_path / name)

    class InTurn:  # the activations alone: each layer run and fitted when the compression asks
        def __new__(cls, activations: object, fmt: object) -> object:  # type: ignore[misc]
            return activations

    in_turn = compile_with("in-turn", InTurn, 1)
    beside = compile_with("beside", Recorded, 10**6)
    ahead = compile_with("ahead", Recorded, 1)
    assert in_turn and beside == in_turn and ahead == in_turn
    assert not made[0].load_ahead and made[1].load_ahead
    assert made[0].early == 0 and made[1].early > 0  # loaded ahead: fitted while their layer's run went on
    for done in made:
        assert done.handed > 0 and not done.fitted and not done.loaded, (done.handed, done.fitted, done.loaded)
    assert made[0].handed == made[1].handed


def test_a_layer_prepared_ahead_for_a_cached_piece_is_not_held(stories: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 1 compiled alone fills the piece cache; the whole compile then takes stage 1's piece from it, so the
    layer prepared ahead for that piece is never traced: the bundle is still the uncached one, and nothing loaded
    ahead is left held."""
    Recorded, made = _recorded()

    monkeypatch.setattr(compile_module, "FitAhead", Recorded)
    monkeypatch.setattr(fit_ahead, "AHEAD_THREADS", 1)
    cache = tmp_path / "cache"
    compile_bundle(CompileConfig(stories, tmp_path / "part", stages=2, only_stage=1, cache_dir=cache))
    compile_bundle(CompileConfig(stories, tmp_path / "cached", stages=2, cache_dir=cache))
    compile_bundle(CompileConfig(stories, tmp_path / "fresh", stages=2, cache_dir=None))
    assert _bins(tmp_path / "cached") == _bins(tmp_path / "fresh")
    assert not made[1].loaded and made[1].handed < made[2].handed  # stage 1's fits came from the cache


def test_a_mixture_of_experts_fitted_beside_its_run_stores_the_same_bytes(stories: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A random Qwen3-MoE's default compile: with the layers prepared ahead, its dense weights fitted during their
    layer's run and its stacked experts after it, the bytes are those of the fits beside the conversion."""
    checkpoint = moe_with_tokenizer(stories, tmp_path / "ckpt")
    Recorded, made = _recorded()

    monkeypatch.setattr(compile_module, "FitAhead", Recorded)
    bins = {}
    for name, ahead_threads in (("beside", 10**6), ("ahead", 1)):
        monkeypatch.setattr(fit_ahead, "AHEAD_THREADS", ahead_threads)
        compile_bundle(CompileConfig(checkpoint, tmp_path / name, stages=2, cache_dir=None))
        bins[name] = _bins(tmp_path / name)
    assert bins["beside"] and bins["ahead"] == bins["beside"]
    assert made[0].early == 0 and made[1].early > 0 and made[1].handed == made[0].handed
