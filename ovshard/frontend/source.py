"""Open what the user named as the model: a Hugging Face checkpoint folder, or a llama.cpp GGUF file.

This is the one place that tells the two apart (``checkpoint`` cannot import ``gguf``, which builds on
it). A GGUF file is recognised by its name (``*.gguf``) or its first four bytes, so Ollama's blobs
(``~/.ollama/models/blobs/sha256-...``, no suffix) open too. A name that is not a local path (a Hugging Face
Hub id, ``ollama:model:tag``) becomes one first (:mod:`ovshard.frontend.resolve`).
"""

from __future__ import annotations

from pathlib import Path

from ovshard.frontend.checkpoint import Checkpoint, open_checkpoint
from ovshard.frontend.gguf import open_gguf
from ovshard.frontend.resolve import is_gguf, resolve_model


def open_source(name: str | Path) -> Checkpoint:
    """:func:`~ovshard.frontend.gguf.open_gguf` for a GGUF file, else :func:`~ovshard.frontend.checkpoint.open_checkpoint`,
    of the local path ``name`` stands for (:func:`~ovshard.frontend.resolve.resolve_model`)."""
    path = resolve_model(name)
    return open_gguf(path) if is_gguf(path) else open_checkpoint(path)
