"""``ovshard compile`` by a model's name in a real subprocess, its Hub cache and offline mode set through the
environment as a user sets them (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, OLLAMA_MODELS)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_stores import hub_cache, ollama_folder

from ovshard.bundle.manifest import read_manifest

pytestmark = pytest.mark.e2e

OVSHARD = [sys.executable, "-m", "ovshard.cli"]


def ovshard(env: dict[str, str], *argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*OVSHARD, *map(str, argv)], capture_output=True, text=True, timeout=600,
                          env=os.environ | env)


def test_compile_a_hub_id_from_hf_home_offline(stories: Path, tmp_path: Path) -> None:
    """`ovshard compile owner/name` with HF_HOME and HF_HUB_OFFLINE=1 compiles the snapshot in $HF_HOME/hub."""
    files = {f.name: f for f in sorted(stories.iterdir()) if f.is_file()}
    snapshot = hub_cache(tmp_path / "hf-home" / "hub", "tiny-org/stories260K", files, listed=("pytorch_model.bin",))
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    done = ovshard(env, "compile", "tiny-org/stories260K", "--weights", "fp32", "-o", tmp_path / "bundle")
    assert done.returncode == 0, done.stderr
    assert Path(read_manifest(tmp_path / "bundle").source.path) == snapshot


def test_compile_a_hub_id_not_cached_offline(tmp_path: Path) -> None:
    """Offline and not cached: exit 2, no traceback, the id, the cache folder and what to do."""
    env = {"HF_HUB_CACHE": str(tmp_path / "empty-cache"), "HF_HUB_OFFLINE": "1"}
    done = ovshard(env, "compile", "Qwen/Qwen3-30B-A3B", "-o", tmp_path / "bundle")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    for text in ("ovshard compile: error: Qwen/Qwen3-30B-A3B is not in the Hugging Face cache",
                 str(tmp_path / "empty-cache" / "models--Qwen--Qwen3-30B-A3B"), "HF_HUB_OFFLINE"):
        assert text in done.stderr, done.stderr
    assert not (tmp_path / "bundle").exists()


def test_compile_an_ollama_model_not_pulled(tmp_path: Path) -> None:
    """`ovshard compile ollama:qwen3:30b` against an OLLAMA_MODELS folder without it: exit 2, where it looked."""
    root = tmp_path / "ollama"
    gguf = tmp_path / "other.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    ollama_folder(root, ("registry.ollama.ai", "library", "qwen3", "8b"), gguf)
    done = ovshard({"OLLAMA_MODELS": str(root)}, "compile", "ollama:qwen3:30b", "-o", tmp_path / "bundle")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert str(root / "manifests" / "registry.ollama.ai" / "library" / "qwen3" / "30b") in done.stderr
    assert "ollama pull qwen3:30b" in done.stderr
