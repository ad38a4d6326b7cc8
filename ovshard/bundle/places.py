"""Where ovshard keeps what it may rebuild: one root for the compiler's layer cache and a node's bundles,
regrouped stages and compiled models."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$OVSHARD_CACHE_DIR``, else ``$XDG_CACHE_HOME/ovshard``, else ``~/.cache/ovshard``."""
    chosen = os.environ.get("OVSHARD_CACHE_DIR")
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "ovshard"
