"""`ovshard demo` end to end: compile, fusion report, story over TCP, speculation, concurrent streams."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GOLDEN

pytestmark = pytest.mark.e2e


STORY_FILE = GOLDEN / "demo-story.txt"
STORY_HEADER = "== greedy story over TCP, prompt 'Once upon a time'\n"


def test_demo_tells_the_golden_story(stories: Path, tmp_path: Path, update_golden: bool) -> None:
    """The demo fuses both stages, generates golden/demo-story.txt over TCP, and reports every section."""
    done = subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "demo", "-o", str(tmp_path / "demo"),
                           "--checkpoint", str(stories)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    story = out.split(STORY_HEADER, 1)[1].split("\n\nworkers: ", 1)[0].rstrip("\n")  # a story ended by eos
    if update_golden:
        STORY_FILE.write_text(story + "\n")
    assert story == STORY_FILE.read_text().rstrip("\n"), "the demo's story differs from golden (make golden?)"
    assert out.count(": OK") == 2  # both stages fused
    assert "per hop" in out
    assert "== the same prompt with speculative decoding (prompt lookup, K auto)" in out and "acceptance" in out
    assert "== 4 prompts on 4 concurrent streams" in out and "tok/s in total" in out
    assert "Traceback" not in done.stderr
