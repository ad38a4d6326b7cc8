"""`ovshard demo` end to end: compile, fusion report, story over TCP, speculation, concurrent streams."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_reports_every_section(stories: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "demo", "-o", str(tmp_path / "demo"),
                           "--checkpoint", str(stories)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count(": OK") == 2  # both stages fused
    assert "Once upon a time" in out and "per hop" in out
    assert "== the same prompt with speculative decoding (prompt lookup, K auto)" in out and "acceptance" in out
    assert "== 4 prompts on 4 concurrent streams" in out and "tok/s in total" in out
    assert "Traceback" not in done.stderr
