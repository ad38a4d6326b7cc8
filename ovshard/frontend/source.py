"""Open what the user named as the model: a Hugging Face checkpoint folder, or a llama.cpp GGUF file.

This is the one place that tells the two apart (``checkpoint`` cannot import ``gguf``, which builds on
it). A GGUF file is recognised by its name (``*.gguf``) or its first four bytes, so Ollama's blobs
(``~/.ollama/models/blobs/sha256-...``, no suffix) open too.
"""

from __future__ import annotations

from pathlib import Path

from ovshard.frontend.checkpoint import Checkpoint, open_checkpoint
from ovshard.frontend.gguf import open_gguf

GGUF_MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    """Whether ``path`` names a GGUF file (by suffix, or by content for a file without one)."""
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_source(path: str | Path) -> Checkpoint:
    """:func:`~ovshard.frontend.gguf.open_gguf` for a GGUF file, else :func:`~ovshard.frontend.checkpoint.open_checkpoint`."""
    path = Path(path)
    return open_gguf(path) if is_gguf(path) else open_checkpoint(path)
