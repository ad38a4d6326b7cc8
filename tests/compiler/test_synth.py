"""Random-weight checkpoints: loadable by transformers, faithful in every dtype, streamed in bounded memory."""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO
from families import as_saved_state
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV2Config,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
)

from ovshard.frontend.arch import ARCHITECTURES
from ovshard.frontend.checkpoint import INDEX_FILE, open_checkpoint
from ovshard.frontend.description import describe
from ovshard.frontend.tensors import model_tensors
from ovshard.tools import synth
from ovshard.tools.shapes import FAMILY_DEFAULTS
from ovshard.tools.synth import (
    SHAPES,
    family_config,
    float32_to_bfloat16_bits,
    llama_config,
    preset,
    write_checkpoint,
)

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def test_tiny_loads_in_transformers_tensor_by_tensor(tmp_path: Path) -> None:
    """transformers loads the tiny checkpoint with no missing/unexpected keys and the same tensor values."""
    root = write_checkpoint(tmp_path / "tiny", SHAPES["tiny"])
    model, info = LlamaForCausalLM.from_pretrained(root, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.rope_parameters == SHAPES["tiny"]["rope_parameters"]
    ckpt = open_checkpoint(root)
    state = model.state_dict()
    assert set(state) == set(ckpt.tensor_names())
    for name in ckpt.tensor_names():
        assert torch.equal(state[name], ckpt.load(name)), name


def test_tied_tiny_loads_with_shared_head(tmp_path: Path) -> None:
    """A tied tiny checkpoint stores no lm_head and transformers ties it to the embedding."""
    root = write_checkpoint(tmp_path / "tied", preset("tiny", tie_word_embeddings=True))
    assert "lm_head.weight" not in open_checkpoint(root).tensor_names()
    model = LlamaForCausalLM.from_pretrained(root)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tiny_greedy_top2_logits_are_not_tied(tmp_path: Path) -> None:
    """The tiny preset's logits spread widely and the top two differ by far more than f32 noise (~3e-5)."""
    model = LlamaForCausalLM.from_pretrained(write_checkpoint(tmp_path / "tiny", SHAPES["tiny"]))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 7, 9, 11, 3, 40, 17]])).logits[0]  # [seq, vocab]
    top2 = logits.topk(2).values
    gaps = top2[:, 0] - top2[:, 1]
    assert logits.std() > 0.5
    assert gaps.min() > 1e-3, f"near-tie: top-2 gaps per position {gaps.tolist()}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_round_trips(tmp_path: Path, dtype: str) -> None:
    """A f16/bf16 checkpoint holds torch's own rounding of the float32 checkpoint with the same seed."""
    full = open_checkpoint(write_checkpoint(tmp_path / "f32", SHAPES["tiny"]))
    half = open_checkpoint(write_checkpoint(tmp_path / dtype, SHAPES["tiny"], dtype=dtype))
    assert half.config["dtype"] == dtype
    expected_tag = {"float16": "F16", "bfloat16": "BF16"}[dtype]
    for name in full.tensor_names():
        assert half.tensor_info(name) == (expected_tag, full.tensor_info(name)[1])
        assert half.nbytes(name) * 2 == full.nbytes(name)
        rounded = full.load(name).to(TORCH_DTYPES[dtype]).float()
        assert torch.equal(half.load(name), rounded), name
    model = LlamaForCausalLM.from_pretrained(half.path, dtype=TORCH_DTYPES[dtype])
    assert torch.equal(model.model.embed_tokens.weight.float(), half.load("model.embed_tokens.weight"))


def test_bfloat16_rounding_matches_torch() -> None:
    """float32 -> bfloat16 rounds to nearest, ties to even, like torch, including inf, NaN and overflow."""
    one_bits = 0x3F800000
    ties = np.array([one_bits | 0x8000, one_bits | 0x18000], dtype=np.uint32).view(
        np.float32
    )  # 1+2^-8, 1+3*2^-8
    special = np.array([np.inf, -np.inf, 3.4e38, -0.0, 1e-45, np.finfo(np.float32).max], dtype=np.float32)
    values = np.concatenate(
        [ties, special, np.random.default_rng(0).standard_normal(10_000, dtype=np.float32) * 50]
    )
    ours = float32_to_bfloat16_bits(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    assert ours[0] == 0x3F80 and ours[1] == 0x3F82  # both ties go to the even neighbour
    nan = float32_to_bfloat16_bits(np.array([np.nan], dtype=np.float32))
    assert np.isnan(torch.from_numpy(nan.view(np.int16)).view(torch.bfloat16).float().numpy()).all()


@pytest.mark.parametrize(
    ("name", "parameters"),
    [("llama-3.2-1b", 1_235_814_400), ("llama-3.1-8b", 8_030_261_248), ("llama-3.1-70b", 70_553_706_496)],
)
def test_preset_builds_llama_config_of_real_size(name: str, parameters: int) -> None:
    """Each real-shape preset is a valid transformers LlamaConfig whose tensors add up to the real model."""
    config = LlamaConfig(**SHAPES[name])
    assert config.rope_parameters == SHAPES[name]["rope_parameters"]
    assert config.tie_word_embeddings is SHAPES[name]["tie_word_embeddings"]
    as_saved = config.to_dict()
    model = describe(as_saved)
    shapes = model_tensors(model.arch, model.dims)
    assert sum(math.prod(s) for s in shapes.values()) == parameters


def test_llama_3_2_1b_preset_is_the_real_config() -> None:
    """The 1B preset carries Llama-3.2-1B's published dimensions and llama3 rope scaling."""
    c = SHAPES["llama-3.2-1b"]
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]) == (
        2048,
        16,
        32,
        8,
    )
    assert (c["head_dim"], c["intermediate_size"], c["vocab_size"], c["max_position_embeddings"]) == (
        64,
        8192,
        128256,
        131072,
    )
    assert c["tie_word_embeddings"] is True
    assert c["rope_parameters"] == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_overrides_replace_keys() -> None:
    """llama_config/preset apply overrides and return fresh dicts that never alias the presets."""
    config = preset("tiny", num_hidden_layers=2)
    config["rope_parameters"]["factor"] = 99.0
    assert config["num_hidden_layers"] == 2 and SHAPES["tiny"]["num_hidden_layers"] == 4
    assert SHAPES["tiny"]["rope_parameters"]["factor"] == 8.0
    assert llama_config(vocab_size=300)["vocab_size"] == 300
    with pytest.raises(ValueError, match="choose one of tiny"):
        preset("llama-9")


def test_sharded_write_respects_shard_limit(tmp_path: Path) -> None:
    """max_shard_bytes splits tensors in order into numbered shards with an index transformers can load."""
    limit = 64 * 1024
    root = write_checkpoint(tmp_path / "sharded", SHAPES["tiny"], max_shard_bytes=limit)
    index = json.loads((root / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors" and len(shards) > 2
    ckpt = open_checkpoint(root)
    assert index["metadata"]["total_size"] == sum(ckpt.nbytes(n) for n in ckpt.tensor_names())
    for shard in shards:
        names = [n for n, f in index["weight_map"].items() if f == shard]
        assert len(names) == 1 or sum(ckpt.nbytes(n) for n in names) <= limit
    _, info = LlamaForCausalLM.from_pretrained(root, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_seed_determines_values(tmp_path: Path) -> None:
    """The same seed writes identical bytes; another seed writes other values."""
    a = write_checkpoint(tmp_path / "a", SHAPES["tiny"], seed=7)
    b = write_checkpoint(tmp_path / "b", SHAPES["tiny"], seed=7)
    c = write_checkpoint(tmp_path / "c", SHAPES["tiny"], seed=8)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_norm_weights_are_near_one(tmp_path: Path) -> None:
    """RMSNorm scales are 1 plus noise; projection weights are centred on 0 with std initializer_range."""
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "tiny", SHAPES["tiny"]))
    norm, weight = ckpt.load("model.norm.weight"), ckpt.load("model.layers.0.mlp.up_proj.weight")
    assert abs(norm.mean().item() - 1.0) < 0.05
    assert abs(weight.mean().item()) < 0.01 and abs(weight.std().item() - 0.1) < 0.01


def test_generation_config_carries_special_ids(tmp_path: Path) -> None:
    """generation_config.json repeats the config's bos/eos ids."""
    root = write_checkpoint(tmp_path / "tiny", preset("tiny", bos_token_id=5, eos_token_id=[6, 7]))
    generation = json.loads((root / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (5, [6, 7])


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails midway leaves neither the output directory nor its temporary directory."""

    def explode(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(synth, "_write_shard", explode)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path / "out", SHAPES["tiny"])
    assert list(tmp_path.iterdir()) == []


def test_refuses_non_empty_output(tmp_path: Path) -> None:
    """An existing non-empty output directory is not overwritten; an empty one is filled."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        write_checkpoint(tmp_path / "full", SHAPES["tiny"])
    (tmp_path / "empty").mkdir()
    write_checkpoint(tmp_path / "empty", SHAPES["tiny"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full"]


def test_rejects_unknown_dtype(tmp_path: Path) -> None:
    """Only float32, float16 and bfloat16 storage is offered."""
    with pytest.raises(ValueError, match="choose one of float32, float16, bfloat16"):
        write_checkpoint(tmp_path / "x", SHAPES["tiny"], dtype="int8")


MEMORY_PROBE = """
import json, resource, sys
from ovshard.tools.synth import llama_config, write_checkpoint
# five 64 MiB float32 tensors (embed, lm_head, gate, up, down) plus 16 MiB of attention: 336 MiB
config = llama_config(vocab_size=16384, hidden_size=1024, num_hidden_layers=1, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=128, intermediate_size=16384)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
write_checkpoint(sys.argv[1], config)
print(json.dumps({"growth_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024}))
"""


def test_writing_streams_in_bounded_memory(tmp_path: Path) -> None:
    """Writing 336 MiB of 64 MiB tensors raises peak RSS by less than one tensor: values are streamed."""
    out = tmp_path / "big"
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr
    growth = json.loads(run.stdout)["growth_bytes"]
    ckpt = open_checkpoint(out)
    total = sum(ckpt.nbytes(n) for n in ckpt.tensor_names())
    assert total > 330 * 2**20
    assert growth < 64 * 2**20, (
        f"peak RSS grew by {growth / 2**20:.0f} MiB while writing {total / 2**20:.0f} MiB"
    )


# `ovshard synth`: the command line over write_checkpoint


def _synth(*args: str) -> tuple[int, str]:
    """Run ``ovshard synth ARGS`` in this process; return the exit code and stdout."""
    import contextlib
    import io

    from ovshard.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["synth", *args])
    return code, out.getvalue()


def _summary(stdout: str) -> tuple[int, int, int]:
    """(parameters, bytes, files) from synth's final line."""
    m = re.search(r"([\d,]+) parameters, ([\d,]+) bytes .* in (\d+) safetensors file", stdout.splitlines()[-1])
    assert m, stdout
    return int(m.group(1).replace(",", "")), int(m.group(2).replace(",", "")), int(m.group(3))


def test_cli_writes_tiny_checkpoint_that_transformers_loads(tmp_path: Path) -> None:
    """`ovshard synth tiny` writes a checkpoint AutoModelForCausalLM loads with the tiny config and no gaps."""
    out = tmp_path / "tiny"
    code, stdout = _synth("tiny", "-o", str(out), "--seed", "3")
    assert code == 0
    assert stdout.startswith(f"wrote {out}: ")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tiny = SHAPES["tiny"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(model.config, key) == tiny[key], key
    parameters, nbytes, files = _summary(stdout)
    assert parameters == sum(p.numel() for p in model.parameters()) and nbytes == 4 * parameters and files == 1
    again = write_checkpoint(tmp_path / "api", SHAPES["tiny"], seed=3)
    assert (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    ("name", "parameters"),
    [("llama-3.2-1b", 1_235_814_400), ("llama-3.1-8b", 8_030_261_248), ("llama-3.1-70b", 70_553_706_496),
     ("qwen3-8b", 8_190_735_360), ("phi-4-mini", 3_836_021_760), ("gemma-3-4b", 3_880_263_168)],
)
def test_cli_dry_run_reports_real_size_and_writes_nothing(tmp_path: Path, name: str, parameters: int) -> None:
    """`--dry-run` on a real shape reports its true parameter count and bytes, and leaves no folder."""
    code, stdout = _synth(name, "-o", str(tmp_path / name), "--dry-run", "--dtype", "bfloat16")
    assert code == 0
    assert stdout.startswith(f"would write {tmp_path / name}: ")
    reported, nbytes, files = _summary(stdout)
    assert (reported, nbytes) == (parameters, 2 * parameters)
    assert files == len(synth.checkpoint_layout(preset(name), "bfloat16", 2 * 10**9).files) > 1
    assert list(tmp_path.iterdir()) == []


def _header_dtypes(folder: Path) -> set[str]:
    """The dtypes the safetensors headers in ``folder`` declare, read from the files' bytes."""
    found = set()
    for file in folder.glob("*.safetensors"):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        found |= {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}
    return found


def test_cli_one_layer_of_llama_3_2_1b_has_the_real_tensor_shapes(tmp_path: Path) -> None:
    """`synth llama-3.2-1b --layers 1` writes the real 1B tensor shapes for one layer, tied, in bf16 (~620 MB):
    the dtype Llama-3.2-1B is published in, without --dtype."""
    out = tmp_path / "1b"
    code, stdout = _synth("llama-3.2-1b", "-o", str(out), "--layers", "1")
    assert code == 0 and "bfloat16" in stdout
    assert _header_dtypes(out) == {"BF16"}
    ckpt = open_checkpoint(out)
    expected = {
        "model.embed_tokens.weight": (128256, 2048),
        "model.layers.0.input_layernorm.weight": (2048,),
        "model.layers.0.self_attn.q_proj.weight": (2048, 2048),
        "model.layers.0.self_attn.k_proj.weight": (512, 2048),
        "model.layers.0.self_attn.v_proj.weight": (512, 2048),
        "model.layers.0.self_attn.o_proj.weight": (2048, 2048),
        "model.layers.0.post_attention_layernorm.weight": (2048,),
        "model.layers.0.mlp.gate_proj.weight": (8192, 2048),
        "model.layers.0.mlp.up_proj.weight": (8192, 2048),
        "model.layers.0.mlp.down_proj.weight": (2048, 8192),
        "model.norm.weight": (2048,),
    }  # no lm_head: the 1B ties it to the embedding
    assert {n: ckpt.tensor_info(n) for n in ckpt.tensor_names()} == {n: ("BF16", s) for n, s in expected.items()}
    assert ckpt.config == {**preset("llama-3.2-1b"), "num_hidden_layers": 1, "dtype": "bfloat16"}
    shutil.rmtree(out)  # 620 MB: do not keep it among pytest's retained temp folders


def test_cli_accepts_a_llama_config_json(tmp_path: Path) -> None:
    """A Hugging Face config.json path works, and its legacy torch_dtype becomes the default storage dtype."""
    config = llama_config(hidden_size=32, head_dim=8, intermediate_size=64, num_hidden_layers=2)
    del config["dtype"]
    config["torch_dtype"] = "float16"
    path = tmp_path / "src" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    code, _ = _synth(str(path), "-o", str(tmp_path / "out"))
    assert code == 0
    ckpt = open_checkpoint(tmp_path / "out")
    assert ckpt.config["dtype"] == "float16" and "torch_dtype" not in ckpt.config
    assert ckpt.tensor_info("model.layers.1.mlp.up_proj.weight") == ("F16", (64, 32))
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.mark.parametrize(("override", "stored"), [(None, "BF16"), ("float32", "F32")])
def test_cli_config_json_keeps_its_dtype_unless_told_otherwise(tmp_path: Path, override: str | None,
                                                              stored: str) -> None:
    """A config.json published in bfloat16 (Qwen3-0.6B's, shrunk) is written in bf16; --dtype float32 wins."""
    config = preset("qwen3-0.6b", hidden_size=32, head_dim=8, intermediate_size=64, num_hidden_layers=2,
                    num_key_value_heads=2, num_attention_heads=4, vocab_size=128, layer_types=["full_attention"] * 2,
                    max_window_layers=2)
    assert config["dtype"] == "bfloat16"
    path = tmp_path / "src" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    code, _ = _synth(str(path), "-o", str(tmp_path / "out"), *(["--dtype", override] if override else []))
    assert code == 0
    assert _header_dtypes(tmp_path / "out") == {stored}
    assert open_checkpoint(tmp_path / "out").config["dtype"] == (override or "bfloat16")


@pytest.mark.parametrize(("name", "override", "dtype", "width"),
                         [("qwen3-0.6b", None, "bfloat16", 2), ("gemma-3-1b", None, "bfloat16", 2),
                          ("gemma-2-2b", None, "float32", 4), ("qwen3-0.6b", "float32", "float32", 4),
                          ("tiny", None, "float32", 4)])
def test_cli_named_shapes_default_to_their_published_dtype(tmp_path: Path, name: str, override: str | None,
                                                           dtype: str, width: int) -> None:
    """Without --dtype a named shape is stored as its public model is (Gemma 2 base: float32, the synthetic tiny
    shape: float32); an explicit --dtype overrides it."""
    code, stdout = _synth(name, "-o", str(tmp_path / name), "--dry-run", *(["--dtype", override] if override else []))
    assert code == 0
    parameters, nbytes, _ = _summary(stdout)
    assert f", {dtype})" in stdout and nbytes == width * parameters, stdout


def test_layout_matches_what_is_written(tmp_path: Path) -> None:
    """checkpoint_layout (what --dry-run reports) names the same files and tensors write_checkpoint writes."""
    limit = 64 * 1024
    layout = synth.checkpoint_layout(SHAPES["tiny"], "float32", limit)
    root = write_checkpoint(tmp_path / "sharded", SHAPES["tiny"], max_shard_bytes=limit)
    weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
    assert {n: f for f, names, _ in layout.files for n in names} == weight_map
    for file, _, nbytes in layout.files:  # a file is an 8-byte header length, the header, then the data
        with (root / file).open("rb") as f:
            (header_bytes,) = struct.unpack("<Q", f.read(8))
        assert (root / file).stat().st_size == 8 + header_bytes + nbytes, file
    assert sum(b for _, _, b in layout.files) == layout.nbytes


def test_cli_unknown_shape_fails_with_the_known_ones() -> None:
    """An unknown shape name exits 2 with one line listing the shapes and the supported families, no traceback."""
    run = subprocess.run([sys.executable, "-m", "ovshard.cli", "synth", "llama-9", "-o", "never"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"ovshard synth: error: unknown shape 'llama-9': expected one of {', '.join(SHAPES)}, or the path of a "
        "Hugging Face config.json (or of the folder holding it) of a supported family: "
        f"{', '.join(sorted(ARCHITECTURES))}"
    ]
    assert "qwen2.5-7b" in SHAPES and "gemma3_text" in ARCHITECTURES
    assert not (REPO / "never").exists()


def test_cli_help_lists_every_shape() -> None:
    """`ovshard synth --help` names every preset."""
    run = subprocess.run([sys.executable, "-m", "ovshard.cli", "synth", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert run.returncode == 0
    text = " ".join(run.stdout.split())  # argparse wraps the help text
    assert [name for name in SHAPES if name not in text] == []


# families: every family of the architecture table, and the public shapes of each

# keys every PretrainedConfig writes whatever the family; the presets leave them to transformers
GENERIC_CONFIG_KEYS = {"_name_or_path", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
                       "output_attentions", "output_hidden_states", "problem_type", "return_dict",
                       "transformers_version"}


def _transformers_config(config: dict) -> dict:
    fields = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **fields).to_dict()


@pytest.mark.parametrize("name", [*SHAPES, *(f"family:{t}" for t in FAMILY_DEFAULTS)])
def test_shape_is_a_complete_transformers_config(name: str) -> None:
    """The family's transformers config class writes back exactly the shape's keys and values, no key missing."""
    config = SHAPES[name] if name in SHAPES else FAMILY_DEFAULTS[name.removeprefix("family:")]
    written = _transformers_config(config)
    assert sorted(set(written) - GENERIC_CONFIG_KEYS - set(config)) == [], "keys the shape lacks"
    assert sorted(set(config) - set(written)) == [], "keys transformers does not know"
    assert {k: v for k, v in written.items() if k in config} == config


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_tensors_are_the_transformers_model_state(name: str) -> None:
    """The tensors checkpoint_layout lists (what --dry-run counts) are the state dict of the transformers model."""
    fields = {k: v for k, v in SHAPES[name].items() if k != "model_type"}
    config = AutoConfig.for_model(SHAPES[name]["model_type"], **fields)
    with torch.device("meta"):  # shapes only: a 70B model costs no memory
        model = AutoModelForCausalLM.from_config(config)
    state = {n: tuple(t.shape) for n, t in as_saved_state(model.state_dict(), SHAPES[name]["model_type"]).items()}
    if config.tie_word_embeddings:
        del state["lm_head.weight"]  # tied: transformers stores only the embedding
    layout = synth.checkpoint_layout(SHAPES[name])
    assert layout.shapes == state
    stored_buffers = [b for n, b in model.named_buffers() if n in model.state_dict()]  # GLM's correction bias
    assert layout.parameters == sum(p.numel() for p in [*model.parameters(), *stored_buffers])


@pytest.mark.parametrize("model_type", sorted(FAMILY_DEFAULTS))
def test_each_family_writes_a_checkpoint_transformers_loads(tmp_path: Path, model_type: str) -> None:
    """A tiny checkpoint of each family loads in transformers with no key missing or unexpected, value for value."""
    root = write_checkpoint(tmp_path / model_type, family_config(model_type), seed=1)
    model, info = AutoModelForCausalLM.from_pretrained(root, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ckpt = open_checkpoint(root)
    ckpt.validate_tensors()
    state = as_saved_state(model.state_dict(), model_type)
    for name in ckpt.tensor_names():
        assert torch.equal(state[name], ckpt.load(name)), name


@pytest.mark.parametrize(("model_type", "applied_minus_stored"), [("llama", 0.0), ("qwen3", 0.0), ("gemma2", 1.0),
                                                                   ("gemma3_text", 1.0)])
def test_norm_scales_apply_as_one_plus_noise(tmp_path: Path, model_type: str, applied_minus_stored: float) -> None:
    """Every RMSNorm (q/k norms too) stores w ~ N(1, r^2) for w * x norms and w ~ N(0, r^2) for Gemma's x * (1 + w)."""
    config = family_config(model_type, hidden_size=256, head_dim=128, intermediate_size=64, vocab_size=64)
    ckpt = open_checkpoint(write_checkpoint(tmp_path / model_type, config))
    norms = [n for n in ckpt.tensor_names() if n.endswith("norm.weight")]
    assert len(norms) == 1 + config["num_hidden_layers"] * (4 if model_type.startswith("gemma") else 2) + (
        2 * config["num_hidden_layers"] if model_type in ("qwen3", "gemma3_text") else 0)
    for name in norms:
        applied = ckpt.load(name) + applied_minus_stored  # the scale the block multiplies by
        assert abs(applied.mean().item() - 1.0) < 0.05 and abs(applied.std().item() - 0.1) < 0.03, name


def test_layers_override_keeps_the_sliding_pattern() -> None:
    """--layers cuts or extends layer_types along the model's own period (Gemma 3: five sliding, one full)."""
    config = synth.shape_config("gemma-3-1b", layers=8)
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    assert synth.shape_config("gemma-2-2b", layers=3)["layer_types"] == [
        "sliding_attention", "full_attention", "sliding_attention"]
    assert synth.shape_config("qwen3-8b", layers=40)["layer_types"] == ["full_attention"] * 40
    _transformers_config(config)  # transformers checks layer_types against num_hidden_layers


def test_cli_accepts_a_config_json_of_another_family(tmp_path: Path) -> None:
    """A Qwen3 config.json as transformers writes it (legacy torch_dtype) gives a checkpoint transformers loads."""
    config = Qwen3Config(vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16).to_dict()
    config["torch_dtype"] = "float16"
    del config["dtype"]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    code, _ = _synth(str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--layers", "3")
    assert code == 0
    ckpt = open_checkpoint(tmp_path / "out")
    assert ckpt.tensor_info("model.layers.2.self_attn.q_norm.weight") == ("F16", (16,))
    assert ckpt.config["layer_types"] == ["full_attention"] * 3
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_cli_writes_the_language_model_of_a_multimodal_config(tmp_path: Path) -> None:
    """A Gemma 3 multimodal config.json gets its language model's tensors under their stored names, nothing else."""
    text = family_config("gemma3_text", num_hidden_layers=2)
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16}, "initializer_range": 0.1,
              "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _ = _synth(str(tmp_path / "config.json"), "-o", str(tmp_path / "out"))
    assert code == 0
    ckpt = open_checkpoint(tmp_path / "out")
    names = set(ckpt.tensor_names())
    assert "language_model.model.layers.1.self_attn.k_norm.weight" in names
    assert all(n.startswith("language_model.model.") for n in names), sorted(names)
    assert abs(ckpt.load("language_model.model.embed_tokens.weight").std().item() - 0.1) < 0.01


def test_cli_refuses_an_unsupported_mixture_of_experts_config(tmp_path: Path) -> None:
    """A DeepSeek-V2 config.json exits 2 with a message naming the model type and MoE, and writes nothing."""
    (tmp_path / "config.json").write_text(json.dumps(DeepseekV2Config(num_hidden_layers=1).to_dict()))
    run = subprocess.run([sys.executable, "-m", "ovshard.cli", "synth", str(tmp_path), "-o", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 2
    assert "deepseek_v2" in run.stderr and "MoE" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()
