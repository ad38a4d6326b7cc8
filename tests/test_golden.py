"""Golden text dumps of stories260K after each pass: a diff in review shows what a change did to the graphs.

Rewrite them with ``pytest tests/test_golden.py --update-golden`` and review the diff.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import GOLDEN

from ovshard.compile import CompileConfig, DumpOptions, compile_bundle
from ovshard.printer import text_diff

GOLDEN_DIR = GOLDEN / "stories260K-2stages-int4_asym"


def test_pass_dumps_match_golden(stories: Path, tmp_path: Path, update_golden: bool) -> None:
    """Text dumps of both stages after every pass (default INT4 weights) equal golden/ byte for byte."""
    dumps = tmp_path / "dumps"
    compile_bundle(CompileConfig(stories, tmp_path / "bundle", stages=2,
                                 dumps=DumpOptions(dumps, after="all", with_ir=False)))
    produced = {p.relative_to(dumps): p.read_text() for p in sorted(dumps.rglob("*.txt"))}
    assert len(produced) == 2 * 5, sorted(produced)  # 00_input + 4 passes, per stage
    if update_golden:
        shutil.rmtree(GOLDEN_DIR, ignore_errors=True)
        for rel, text in produced.items():
            (GOLDEN_DIR / rel).parent.mkdir(parents=True, exist_ok=True)
            (GOLDEN_DIR / rel).write_text(text)
    expected = {p.relative_to(GOLDEN_DIR): p.read_text() for p in sorted(GOLDEN_DIR.rglob("*.txt"))}
    assert sorted(expected) == sorted(produced), "golden files differ in number; run with --update-golden"
    for rel, text in produced.items():
        diff = text_diff(expected[rel], text, f"golden/{rel}", f"now/{rel}")
        assert not diff, f"{rel} differs from golden (run with --update-golden if intended):\n{diff[:3000]}"
