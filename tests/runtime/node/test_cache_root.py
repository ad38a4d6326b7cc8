"""One cache root for everything ovshard may rebuild: the compiler's layer cache and a node's compiled models,
bundles and regrouped stages all follow $OVSHARD_CACHE_DIR, else $XDG_CACHE_HOME/ovshard, else ~/.cache/ovshard."""

from __future__ import annotations

from pathlib import Path

import pytest

from ovshard.bundle.places import cache_root
from ovshard.cache import default_cache_dir
from ovshard.runtime.node.config import model_cache


@pytest.fixture
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("OVSHARD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "ovshard"


def test_every_cache_follows_xdg_cache_home(xdg: Path) -> None:
    """With $XDG_CACHE_HOME set, the layer cache and a node's compiled-model cache live under it."""
    assert cache_root() == xdg
    assert default_cache_dir() == xdg
    assert model_cache(None) == xdg / "ov_cache" and (xdg / "ov_cache").is_dir()


def test_ovshard_cache_dir_wins_over_xdg(xdg: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$OVSHARD_CACHE_DIR names the root outright, for the compiler and the node alike."""
    monkeypatch.setenv("OVSHARD_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == default_cache_dir() == tmp_path / "mine"
    assert model_cache(None) == tmp_path / "mine" / "ov_cache"


def test_without_either_the_root_is_in_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither variable set: ~/.cache/ovshard."""
    monkeypatch.delenv("OVSHARD_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == default_cache_dir() == tmp_path / ".cache" / "ovshard"
