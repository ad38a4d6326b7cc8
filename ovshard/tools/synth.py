"""Random-weight Hugging Face checkpoints of a given shape, written one chunk at a time.

Tests and scale experiments need Llama-shaped checkpoints without downloading real weights. A
70B-shaped checkpoint is ~280 GB in float32, so :func:`write_checkpoint` never holds more than one
chunk of one tensor: it computes each safetensors header from the shapes alone, then generates and
appends the tensors in header order.

Values: tensor ``name`` is drawn from ``numpy.random.default_rng([seed, crc32(name)])`` (stable
across runs, platforms and layer counts), ``N(0, initializer_range**2)`` for weights and
``1 + N(0, initializer_range**2)`` for RMSNorm scales. A large ``initializer_range`` (the tiny
preset uses 0.1) keeps greedy decoding clear of near-ties between the top two logits.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ovshard.bundle.dims import ModelDims
from ovshard.bundle.plan import format_bytes
from ovshard.errors import CheckpointError, OvshardError, PlanError
from ovshard.frontend.arch import ArchSpec, arch_for, model_tensors, read_dims
from ovshard.frontend.checkpoint import CONFIG_FILE, GENERATION_CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from ovshard.plan.partition import parse_budgets

logger = logging.getLogger(__name__)

# config["dtype"] value -> (safetensors dtype string, little-endian numpy storage dtype)
STORAGE_DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("F32", "<f4"),
    "float16": ("F16", "<f2"),
    "bfloat16": ("BF16", "<u2"),  # raw bit patterns; numpy has no bfloat16
}
# elements generated at once: bounds memory to ~4 MiB of float32 whatever the tensor size
CHUNK_ELEMENTS = 1 << 20

_LLAMA_DEFAULTS: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
    "dtype": "float32",
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.1,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "mlp_bias": False,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-5,
    # llama3 scaling with a short original context, so the scaled and unscaled bands both occur
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 256,
}


def llama_config(**overrides: Any) -> dict[str, Any]:
    """A complete transformers-5 ``LlamaForCausalLM`` config.json dict (the tiny shape) with overrides.

    Each override replaces its key whole; ``rope_parameters`` is replaced, not merged.
    """
    config = copy.deepcopy(_LLAMA_DEFAULTS)
    config.update(copy.deepcopy(overrides))
    return config


def _llama3_rope(theta: float, factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


_META_LLAMA3 = {
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": llama_config(),
    "llama-3.2-1b": llama_config(
        **_META_LLAMA3, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64,
        intermediate_size=8192, tie_word_embeddings=True, rope_parameters=_llama3_rope(500000.0, 32.0),
    ),
    "llama-3.1-8b": llama_config(
        **_META_LLAMA3, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, head_dim=128,
        intermediate_size=14336, tie_word_embeddings=False, rope_parameters=_llama3_rope(500000.0, 8.0),
    ),
    "llama-3.1-70b": llama_config(
        **_META_LLAMA3, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, head_dim=128,
        intermediate_size=28672, tie_word_embeddings=False, rope_parameters=_llama3_rope(500000.0, 8.0),
    ),
}  # fmt: skip


def preset(name: str, **overrides: Any) -> dict[str, Any]:
    """A fresh copy of ``SHAPES[name]`` with ``overrides`` applied."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape preset {name!r}; choose one of {', '.join(SHAPES)}")
    config = copy.deepcopy(SHAPES[name])
    config.update(copy.deepcopy(overrides))
    return config


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even); return the uint16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # adding 0x7FFF plus the lowest kept bit, then dropping 16 bits, rounds half to even
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # keep sign and quiet the NaN; rounding could have carried it into infinity
        rounded[nan] = (bits[nan] >> 16).astype(np.uint16) | np.uint16(0x0040)
    return rounded


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 chunk -> the little-endian storage array of ``dtype``."""
    if dtype == "bfloat16":
        return float32_to_bfloat16_bits(values).astype("<u2", copy=False)
    return values.astype(STORAGE_DTYPES[dtype][1], copy=False)


def tensor_chunks(name: str, numel: int, *, std: float, is_norm: bool, seed: int) -> Iterator[np.ndarray]:
    """The float32 values of tensor ``name``, flattened, in chunks of at most ``CHUNK_ELEMENTS``."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    for start in range(0, numel, CHUNK_ELEMENTS):
        values = rng.standard_normal(min(CHUNK_ELEMENTS, numel - start), dtype=np.float32)
        values *= np.float32(std)
        if is_norm:
            values += np.float32(1.0)
        yield values


def _norm_names(spec: ArchSpec, dims: ModelDims) -> set[str]:
    per_layer = (spec.input_norm, spec.post_attention_norm)
    return {spec.final_norm} | {t.format(i=i) for i in range(dims.num_layers) for t in per_layer}


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int | None) -> list[list[str]]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if max_shard_bytes is not None and shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _header_bytes(
    names: list[str], shapes: dict[str, tuple[int, ...]], sizes: dict[str, int], st_dtype: str
) -> bytes:
    """The safetensors prefix (length + JSON, space-padded to 8 bytes) for ``names`` in this order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        header[name] = {
            "dtype": st_dtype,
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + sizes[name]],
        }
        offset += sizes[name]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_config_files(root: Path, config: dict[str, Any]) -> None:
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {
        "_from_model_config": True,
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
    }
    if config.get("pad_token_id") is not None:
        generation["pad_token_id"] = config["pad_token_id"]
    (root / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class _ValueSource:
    """How tensor values are drawn and stored: see the module docstring."""

    seed: int
    dtype: str
    std: float
    norms: set[str]

    def encoded_chunks(self, name: str, numel: int) -> Iterator[np.ndarray]:
        for values in tensor_chunks(name, numel, std=self.std, is_norm=name in self.norms, seed=self.seed):
            yield _encode(values, self.dtype)


def _write_shard(
    path: Path,
    names: list[str],
    shapes: dict[str, tuple[int, ...]],
    sizes: dict[str, int],
    values: _ValueSource,
) -> None:
    """Write one safetensors file: the header computed from shapes, then each tensor chunk by chunk."""
    with path.open("wb") as f:
        f.write(_header_bytes(names, shapes, sizes, STORAGE_DTYPES[values.dtype][0]))
        for name in names:
            logger.debug("writing %s %s", name, shapes[name])
            for chunk in values.encoded_chunks(name, math.prod(shapes[name])):
                f.write(chunk.data)


def write_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any],
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a random-weight checkpoint of ``config``'s shape to ``out_dir`` and return its path.

    ``dtype`` is ``"float32"``, ``"float16"`` or ``"bfloat16"``; the written config.json says so.
    With ``max_shard_bytes`` the tensors are split, in order, into ``model-0000k-of-0000N.safetensors``
    plus ``model.safetensors.index.json`` (one ``model.safetensors`` if they fit in one shard). The
    checkpoint appears atomically: it is written to a temporary directory beside ``out_dir`` and
    renamed. ``out_dir`` must not exist or be empty.
    """
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {', '.join(STORAGE_DTYPES)}")
    spec, dims = arch_for(config), read_dims(config)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"{out} already exists and is not an empty directory; choose a new path or remove it"
        )
    shapes = model_tensors(spec, dims)
    itemsize = np.dtype(STORAGE_DTYPES[dtype][1]).itemsize
    sizes = {name: math.prod(shape) * itemsize for name, shape in shapes.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary directory
    try:
        _write_config_files(tmp, {**config, "dtype": dtype})
        values = _ValueSource(
            seed=seed,
            dtype=dtype,
            std=float(config.get("initializer_range", 0.02)),
            norms=_norm_names(spec, dims),
        )
        written, total = 0, sum(sizes.values())
        for k, (file, names) in enumerate(zip(files, shards, strict=True)):
            logger.info("writing %s (%d/%d, %d tensors; %.0f%% of %s done)", file, k + 1, len(files),
                        len(names), 100 * written / total, format_bytes(total))
            _write_shard(tmp / file, names, shapes, sizes, values)
            written += sum(sizes[n] for n in names)
        if len(files) > 1:
            index = {
                "metadata": {"total_size": sum(sizes.values())},
                "weight_map": {n: file for file, names in zip(files, shards, strict=True) for n in names},
            }
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s: %d tensors, %d bytes", out, len(shapes), sum(sizes.values()))
    return out


@dataclass(frozen=True)
class CheckpointLayout:
    """What :func:`write_checkpoint` would write for a config: files with their tensors, and the totals."""

    files: tuple[tuple[str, tuple[str, ...], int], ...]  # (file name, tensor names in file order, bytes)
    shapes: dict[str, tuple[int, ...]]
    parameters: int
    nbytes: int


def checkpoint_layout(config: dict[str, Any], dtype: str = "float32",
                      max_shard_bytes: int | None = None) -> CheckpointLayout:
    """The files, tensor shapes, parameter count and bytes of ``config``'s checkpoint, computed from shapes alone."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {', '.join(STORAGE_DTYPES)}")
    shapes = model_tensors(arch_for(config), read_dims(config))
    itemsize = np.dtype(STORAGE_DTYPES[dtype][1]).itemsize
    sizes = {name: math.prod(shape) * itemsize for name, shape in shapes.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))
    ]  # the same naming as write_checkpoint
    files = tuple((file, tuple(tensors), sum(sizes[t] for t in tensors))
                  for file, tensors in zip(names, shards, strict=True))
    parameters = sum(math.prod(shape) for shape in shapes.values())
    return CheckpointLayout(files, shapes, parameters, parameters * itemsize)


def shape_config(source: str, layers: int | None = None) -> dict[str, Any]:
    """The config of a named shape (``SHAPES``) or of a Llama config.json (a file or the folder holding it)."""
    path = Path(source)
    if source in SHAPES:
        config = preset(source)
    elif path.is_file() or (path / CONFIG_FILE).is_file():
        config = _read_config(path if path.is_file() else path / CONFIG_FILE)
    else:
        raise OvshardError(f"unknown shape {source!r}: expected one of {', '.join(SHAPES)}, or the path of a "
                           "Hugging Face config.json of a Llama model (or of the folder holding it)")
    if layers is not None:
        if layers < 1:
            raise OvshardError(f"--layers {layers}: expected at least 1 layer")
        config["num_hidden_layers"] = layers
    read_dims(config)  # a non-Llama model_type or a missing key fails here, naming what is wrong
    return config


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read it as JSON ({e}); expected a Hugging Face config.json") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object (a Hugging Face config.json), found "
                              f"{type(config).__name__}")
    return config


def main_synth(args: argparse.Namespace) -> int:
    """``ovshard synth``: write (or with ``--dry-run`` only describe) a random-weight checkpoint."""
    config = shape_config(args.shape, args.layers)
    legacy_dtype = config.pop("torch_dtype", None)  # written back once, as the transformers-5 "dtype"
    dtype = args.dtype or config.get("dtype") or legacy_dtype or "float32"
    if dtype not in STORAGE_DTYPES:
        raise OvshardError(f"the config's dtype is {dtype!r}; pass --dtype with one of {', '.join(STORAGE_DTYPES)}")
    max_shard_bytes = _parse_size(args.max_shard_size)
    layout = checkpoint_layout(config, dtype, max_shard_bytes)
    logger.info("%s: %d layers, %d tensors in %d file(s)", args.shape, config["num_hidden_layers"],
                len(layout.shapes), len(layout.files))
    for file, tensors, nbytes in layout.files:
        logger.debug("%s: %d tensors, %s", file, len(tensors), format_bytes(nbytes))
    if not args.dry_run:
        try:
            write_checkpoint(args.output, config, seed=args.seed, dtype=dtype, max_shard_bytes=max_shard_bytes)
        except FileExistsError as e:
            raise OvshardError(str(e)) from e
    verb = "would write" if args.dry_run else "wrote"
    print(f"{verb} {args.output}: {layout.parameters:,} parameters, {layout.nbytes:,} bytes "
          f"({format_bytes(layout.nbytes)}, {dtype}) in {len(layout.files)} safetensors file(s)")
    return 0


def _parse_size(text: str) -> int:
    try:
        (size,) = parse_budgets(text)
    except (PlanError, ValueError) as e:
        raise OvshardError(f"--max-shard-size {text!r}: expected one size such as 2GB, 500MB or 1.5GiB") from e
    return size
