"""The calibration run ahead of the compression (ovshard/frontend/fit_ahead.py) stores the bytes of fitting in turn.

stories260K's default compile (calibrated, the scale fit) at 2 stages, three ways: the activations alone (each
layer run and fitted when its compression asks), the fits on their own thread beside the conversion, and each
next layer loaded and prepared ahead (what a machine with ``AHEAD_THREADS`` torch threads does). Every stored
weight is the same byte for byte, and the compression took every fit from the thread rather than fitting again.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from ovshard import compile as compile_module
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.frontend import fit_ahead

pytestmark = pytest.mark.slow


def _bins(bundle: Path) -> dict[str, str]:
    return {str(f.relative_to(bundle)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(bundle.rglob("*.bin"))}


def test_fitting_ahead_stores_the_same_bytes(stories: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[fit_ahead.FitAhead] = []

    class Recorded(fit_ahead.FitAhead):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)  # type: ignore[arg-type]
            made.append(self)

    def compile_with(name: str, kind: object, ahead_threads: int) -> dict[str, str]:
        monkeypatch.setattr(compile_module, "FitAhead", kind)
        monkeypatch.setattr(fit_ahead, "AHEAD_THREADS", ahead_threads)
        compile_bundle(CompileConfig(stories, tmp_path / name, stages=2, cache_dir=None))
        return _bins(tmp_path / name)

    in_turn = compile_with("in-turn", lambda activations, fmt: activations, 1)
    beside = compile_with("beside", Recorded, 10**6)
    ahead = compile_with("ahead", Recorded, 1)
    assert in_turn and beside == in_turn and ahead == in_turn
    assert not made[0].load_ahead and made[1].load_ahead
    for done in made:
        assert done.handed > 0 and not done.fitted and not done.loaded, (done.handed, done.fitted, done.loaded)
    assert made[0].handed == made[1].handed
