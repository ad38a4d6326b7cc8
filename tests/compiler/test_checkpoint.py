"""The lazy checkpoint reader: names, shapes and bytes from headers; one tensor per load; clear errors."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import STORIES
from safetensors import safe_open

from ovshard.errors import CheckpointError, UnsupportedArchitectureError
from ovshard.frontend.checkpoint import INDEX_FILE, SINGLE_FILE, open_checkpoint
from ovshard.frontend.tensors import model_tensors
from ovshard.tools.synth import preset, write_checkpoint

needs_stories = pytest.mark.skipif(not STORIES.is_dir(), reason=f"{STORIES} is not present")


def tiny(tmp_path: Path, name: str = "ckpt", **overrides: Any) -> Path:
    """A freshly written tiny random checkpoint (ours to break; stories260K is read only)."""
    return write_checkpoint(tmp_path / name, preset("tiny", **overrides))


def edit_config(root: Path, **changes: Any) -> None:
    config = json.loads((root / "config.json").read_text())
    config.update(changes)
    (root / "config.json").write_text(json.dumps(config))


@needs_stories
def test_stories_names_and_shapes_match_architecture_table() -> None:
    """stories260K's headers list exactly the tensors and shapes model_tensors predicts (tied: no lm_head)."""
    ckpt = open_checkpoint(STORIES)
    expected = model_tensors(ckpt.spec, ckpt.dims)
    assert {n: ckpt.tensor_info(n)[1] for n in ckpt.tensor_names()} == expected
    assert {ckpt.tensor_info(n)[0] for n in ckpt.tensor_names()} == {"F32"}
    assert ckpt.nbytes("model.embed_tokens.weight") == 512 * 64 * 4
    ckpt.validate_tensors()
    assert ckpt.has_tokenizer and ckpt.generation_config is not None
    assert ckpt.loaded == []


@needs_stories
def test_load_reads_only_the_requested_tensor() -> None:
    """load() returns the tensor safetensors itself reads, as float32, and records only that name."""
    ckpt = open_checkpoint(STORIES)
    name = "model.layers.2.self_attn.k_proj.weight"
    tensor = ckpt.load(name)
    with safe_open(str(STORIES / SINGLE_FILE), framework="pt") as f:
        reference = f.get_tensor(name)
    assert tensor.dtype == torch.float32
    assert torch.equal(tensor, reference)
    assert ckpt.loaded == [name]


def test_listing_needs_no_tensor_data(tmp_path: Path) -> None:
    """Names, shapes, sizes and the fingerprint come from headers: zeroing all data changes none of them."""
    root = tiny(tmp_path)
    before = open_checkpoint(root)
    listing = [(n, before.tensor_info(n), before.nbytes(n)) for n in before.tensor_names()]
    path = root / SINGLE_FILE
    blob = bytearray(path.read_bytes())
    data_start = 8 + struct.unpack("<Q", blob[:8])[0]
    blob[data_start:] = bytes(len(blob) - data_start)
    path.write_bytes(bytes(blob))
    after = open_checkpoint(root)
    assert [(n, after.tensor_info(n), after.nbytes(n)) for n in after.tensor_names()] == listing
    assert after.fingerprint() == before.fingerprint()
    assert before.loaded == after.loaded == []


def test_sharded_checkpoint_reads_like_single_file(tmp_path: Path) -> None:
    """A checkpoint split into shards by an index lists and loads the same tensors as one file."""
    single = open_checkpoint(write_checkpoint(tmp_path / "single", preset("tiny")))
    sharded = open_checkpoint(
        write_checkpoint(tmp_path / "sharded", preset("tiny"), max_shard_bytes=64 * 1024)
    )
    assert len(sharded.weight_files) > 2 and (sharded.path / INDEX_FILE).is_file()
    assert sharded.tensor_names() == single.tensor_names()
    sharded.validate_tensors()
    for name in single.tensor_names():
        assert sharded.tensor_info(name) == single.tensor_info(name)
        assert torch.equal(sharded.load(name), single.load(name)), name
    assert sharded.loaded == single.tensor_names()


def test_fingerprint_is_stable_and_tracks_config(tmp_path: Path) -> None:
    """The fingerprint is the same on every open and changes when config.json changes."""
    root = tiny(tmp_path)
    first = open_checkpoint(root).fingerprint()
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", first)
    assert open_checkpoint(root).fingerprint() == first
    edit_config(root, rms_norm_eps=1e-6)
    assert open_checkpoint(root).fingerprint() != first


def test_fingerprint_tracks_headers(tmp_path: Path) -> None:
    """Resharding the same tensors changes the fingerprint (file names and headers are hashed)."""
    single = open_checkpoint(write_checkpoint(tmp_path / "a", preset("tiny"))).fingerprint()
    sharded = open_checkpoint(write_checkpoint(tmp_path / "b", preset("tiny"), max_shard_bytes=64 * 1024))
    assert sharded.fingerprint() != single


def test_missing_path(tmp_path: Path) -> None:
    """A path that does not exist is reported as such."""
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "nowhere")


def test_path_is_a_file(tmp_path: Path) -> None:
    """A file where a directory is expected says a directory is expected."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file; expected the directory"):
        open_checkpoint(tmp_path / "model.safetensors")


def test_missing_config(tmp_path: Path) -> None:
    """A directory without config.json names the missing file."""
    root = tiny(tmp_path)
    (root / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        open_checkpoint(root)


def test_config_not_json(tmp_path: Path) -> None:
    """A config.json that does not parse is reported with the parser's complaint."""
    root = tiny(tmp_path)
    (root / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        open_checkpoint(root)


def test_pytorch_bin_checkpoint_is_refused_with_conversion_hint(tmp_path: Path) -> None:
    """A .bin-only checkpoint names the file it found and how to convert to safetensors."""
    root = tiny(tmp_path)
    (root / SINGLE_FILE).rename(root / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(root)
    message = str(info.value)
    assert "pytorch_model.bin" in message and "not supported" in message
    assert "save_pretrained(new_dir, safe_serialization=True)" in message


def test_truncated_safetensors(tmp_path: Path) -> None:
    """A file cut short after its header is reported as truncated, naming the tensor past the end."""
    root = tiny(tmp_path)
    path = root / SINGLE_FILE
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        open_checkpoint(root)
    assert "data bytes" in str(info.value)


def test_header_length_beyond_file(tmp_path: Path) -> None:
    """A header length larger than the file is reported with both numbers."""
    root = tiny(tmp_path)
    path = root / SINGLE_FILE
    blob = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(blob) * 2) + blob[8:])
    with pytest.raises(
        CheckpointError, match=f"declares a {len(blob) * 2}-byte header but the file is {len(blob)}"
    ):
        open_checkpoint(root)


def test_file_shorter_than_header_length_field(tmp_path: Path) -> None:
    """A file of fewer than 8 bytes cannot hold a header length."""
    root = tiny(tmp_path)
    (root / SINGLE_FILE).write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short to be safetensors"):
        open_checkpoint(root)


def test_header_not_json(tmp_path: Path) -> None:
    """A header whose bytes are not JSON is reported as corrupt."""
    root = tiny(tmp_path)
    path = root / SINGLE_FILE
    blob = path.read_bytes()
    length = struct.unpack("<Q", blob[:8])[0]
    path.write_bytes(blob[:8] + b"\xff" * length + blob[8 + length :])
    with pytest.raises(CheckpointError, match="header of .* is not valid JSON"):
        open_checkpoint(root)


def test_index_names_missing_shard(tmp_path: Path) -> None:
    """An index that points at a shard not on disk names that shard."""
    root = write_checkpoint(tmp_path / "ckpt", preset("tiny"), max_shard_bytes=64 * 1024)
    shard = json.loads((root / INDEX_FILE).read_text())["weight_map"]["model.norm.weight"]
    (root / shard).unlink()
    with pytest.raises(CheckpointError, match=f"not in .*: {shard}; the download is incomplete"):
        open_checkpoint(root)


def test_index_maps_tensor_to_wrong_shard(tmp_path: Path) -> None:
    """An index that maps a tensor to a shard that does not hold it says the two disagree."""
    root = write_checkpoint(tmp_path / "ckpt", preset("tiny"), max_shard_bytes=64 * 1024)
    index = json.loads((root / INDEX_FILE).read_text())
    first, last = sorted(set(index["weight_map"].values()))[0], sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"]["model.norm.weight"] = (
        first if index["weight_map"]["model.norm.weight"] != first else last
    )
    (root / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.norm.weight' -> .*index and shards disagree"):
        open_checkpoint(root)


def test_unsupported_model_type_lists_supported(tmp_path: Path) -> None:
    """model_type gpt2 is refused with an UnsupportedArchitectureError that lists llama."""
    root = tiny(tmp_path)
    edit_config(root, model_type="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2'.*supports: .*llama"):
        open_checkpoint(root)


def test_wrong_tensor_shape_names_tensor_and_shapes(tmp_path: Path) -> None:
    """A tensor whose shape disagrees with config.json is named with the expected and found shapes."""
    root = tiny(tmp_path)  # intermediate_size 128, hidden 64
    edit_config(root, intermediate_size=96)
    ckpt = open_checkpoint(root)
    with pytest.raises(
        CheckpointError,
        match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \[128, 64\].*implies \[96, 64\]",
    ):
        ckpt.validate_tensors()


def test_untied_checkpoint_needs_lm_head(tmp_path: Path) -> None:
    """A config saying untied over weights without lm_head.weight names the tensor and the setting."""
    root = tiny(tmp_path, tie_word_embeddings=True)
    edit_config(root, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="lm_head.weight.*tie_word_embeddings"):
        open_checkpoint(root).validate_tensors()


def test_tied_checkpoint_may_store_lm_head(tmp_path: Path) -> None:
    """A tied config over weights that also store lm_head.weight is accepted (transformers ignores it)."""
    root = tiny(tmp_path, tie_word_embeddings=False)
    edit_config(root, tie_word_embeddings=True)
    open_checkpoint(root).validate_tensors()


def test_unused_tensors_are_reported(tmp_path: Path) -> None:
    """Weights for more layers than config.json declares are an error naming a surplus tensor."""
    root = tiny(tmp_path)  # 4 layers
    edit_config(root, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"does not use, e\.g\. model\.layers\.3\."):
        open_checkpoint(root).validate_tensors()
