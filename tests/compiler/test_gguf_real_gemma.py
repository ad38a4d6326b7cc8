"""The real Gemma 3 270M Q4_K_M GGUF (written by llama.cpp; :mod:`real_gemma`) against transformers' own GGUF
loader: config, every tensor, rows, identity, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dense_gguf import assert_config_matches
from real_gemma import gemma_gguf, gemma_hf_reference  # noqa: F401  (fixtures)

from ovshard.frontend.gguf import GGUFCheckpoint, open_gguf

pytestmark = pytest.mark.slow


PROMPT = "The capital of France is"
# transformers' GGUF tokenizer of the real Gemma 3 270M on PROMPT (bos first)
PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]


@pytest.fixture(scope="module")
def gemma(gemma_gguf: Path) -> GGUFCheckpoint:  # noqa: F811
    return open_gguf(gemma_gguf)


def test_real_gemma_config_matches_transformers(gemma: GGUFCheckpoint, gemma_hf_reference: Path) -> None:  # noqa: F811
    """The rebuilt config.json agrees with transformers' on every key both set, and describes the same model."""
    from transformers import AutoConfig

    assert_config_matches(gemma.config, AutoConfig.from_pretrained(gemma_hf_reference).to_dict())
    assert gemma.dims.model_type == "gemma3_text" and gemma.dims.num_layers == 18
    assert gemma.block.layer_types.count("full_attention") == 3 and gemma.block.sliding_window == 512


def test_real_gemma_tensors_equal_transformers(gemma: GGUFCheckpoint, gemma_hf_reference: Path) -> None:  # noqa: F811
    """Every tensor, dequantized one at a time, equals transformers' float32 state dict bit for bit."""
    from safetensors import safe_open

    gemma.validate_tensors()
    with safe_open(str(gemma_hf_reference / "model.safetensors"), framework="pt") as reference:
        assert set(gemma.tensor_names()) == set(reference.keys())
        for name in gemma.tensor_names():
            ours, theirs = gemma.load(name), reference.get_tensor(name)
            assert ours.dtype == torch.float32 and torch.equal(ours, theirs), name


def test_real_gemma_load_rows(gemma: GGUFCheckpoint) -> None:
    """Rows of the Q8_0 embedding and a Q5_0 projection equal the same rows of the whole tensor."""
    for name in ("model.embed_tokens.weight", "model.layers.3.self_attn.q_proj.weight"):
        whole = gemma.load(name)
        for start, end in ((0, 1), (300, 617), (whole.shape[0] - 7, whole.shape[0])):
            assert torch.equal(gemma.load_rows(name, start, end), whole[start:end]), (name, start, end)


def test_real_gemma_identity(gemma: GGUFCheckpoint, gemma_gguf: Path) -> None:  # noqa: F811
    """Fingerprint stable across opens; source quantization Q4_K_M over all 236 tensors."""
    assert gemma.fingerprint() == open_gguf(gemma_gguf).fingerprint()
    quant = gemma.source_quantization
    assert quant.file_type == "Q4_K_M" and quant.quantized
    assert sum(n for _, n in quant.tensor_types) == 236 and dict(quant.tensor_types)["Q4_K"] == 27
    assert gemma.generation_config == {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def test_real_gemma_tokenizer_export(gemma: GGUFCheckpoint, gemma_hf_reference: Path, tmp_path: Path) -> None:  # noqa: F811
    """The exported folder holds transformers' GGUF tokenizer file for file, and it encodes as transformers does."""
    from transformers import AutoTokenizer

    written = gemma.export_tokenizer(tmp_path)
    assert set(written) == {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"}
    for name in ("tokenizer.json", "tokenizer_config.json"):  # as AutoTokenizer.from_pretrained(dir, gguf_file=...) saves
        assert (tmp_path / name).read_bytes() == (gemma_hf_reference / name).read_bytes(), name
    exported = AutoTokenizer.from_pretrained(tmp_path)
    assert exported(PROMPT).input_ids == PROMPT_IDS
    text = "Ollama and LM Studio ship GGUF files: naïve café, 東京, emoji 🙂, code `x = 1`.\n"
    assert exported.decode(exported(text).input_ids, skip_special_tokens=True) == text
    assert json.loads((tmp_path / "config.json").read_text()) == gemma.config
    assert json.loads((tmp_path / "generation_config.json").read_text()) == gemma.generation_config
