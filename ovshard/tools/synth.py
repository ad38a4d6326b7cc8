"""Random-weight Hugging Face checkpoints of a given shape, written one chunk at a time.

Tests and scale experiments need real-shaped checkpoints (any family of the architecture table, named
shapes in :mod:`ovshard.tools.shapes`) without downloading real weights. A 70B-shaped checkpoint is
~280 GB in float32, so :func:`write_checkpoint` never holds more than one chunk of one tensor: it
computes each safetensors header from the shapes alone (the family's ``model_tensors``), then
generates and appends the tensors in header order.

Values: tensor ``name`` is drawn from ``numpy.random.default_rng([seed, crc32(name)])`` (stable
across runs, platforms and layer counts), ``N(0, initializer_range**2)`` for weights and
``1 - norm_offset + N(0, initializer_range**2)`` for RMSNorm scales, so the scale the block applies
(``norm_offset + w``) is 1 plus noise: ``w`` near 1 for Llama-style ``w * x`` norms, near 0 for Gemma's
``x * (1 + w)``. A large ``initializer_range`` (the tiny shapes use 0.1) keeps greedy decoding clear of
near-ties between the top two logits.
"""

from __future__ import annotations

import argparse
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
from ovshard.frontend.arch import ARCHITECTURES, ArchSpec
from ovshard.frontend.checkpoint import CONFIG_FILE, GENERATION_CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from ovshard.frontend.description import ModelDescription, describe
from ovshard.frontend.tensors import model_tensors, norm_templates
from ovshard.plan.partition import parse_budgets
from ovshard.tools.shapes import SHAPES, family_config, llama_config, preset, resize_layer_types

logger = logging.getLogger(__name__)

# the shapes are defined in ovshard.tools.shapes and offered here too, beside the writer
__all__ = ["SHAPES", "CheckpointLayout", "SynthConfig", "checkpoint_layout", "family_config", "llama_config",
           "main_synth", "preset", "shape_config", "storage_dtype", "synth", "tensor_chunks", "with_layers",
           "write_checkpoint"]

# config["dtype"] value -> (safetensors dtype string, little-endian numpy storage dtype)
STORAGE_DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("F32", "<f4"),
    "float16": ("F16", "<f2"),
    "bfloat16": ("BF16", "<u2"),  # raw bit patterns; numpy has no bfloat16
}
# elements generated at once: bounds memory to ~4 MiB of float32 whatever the tensor size
CHUNK_ELEMENTS = 1 << 20


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


def tensor_chunks(name: str, numel: int, *, std: float, mean: float = 0.0, seed: int) -> Iterator[np.ndarray]:
    """The float32 values of tensor ``name``, ``N(mean, std**2)`` flattened, in chunks of at most ``CHUNK_ELEMENTS``."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    for start in range(0, numel, CHUNK_ELEMENTS):
        values = rng.standard_normal(min(CHUNK_ELEMENTS, numel - start), dtype=np.float32)
        values *= np.float32(std)
        if mean:
            values += np.float32(mean)
        yield values


def _norm_names(spec: ArchSpec, dims: ModelDims) -> set[str]:
    """Every RMSNorm scale of the checkpoint: the final norm and each layer's (q/k norms included)."""
    return {spec.final_norm} | {t.format(i=i) for i in range(dims.num_layers) for t in norm_templates(spec, dims)}


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


def _write_config_files(root: Path, config: dict[str, Any], model: ModelDescription) -> None:
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation: dict[str, Any] = {
        "_from_model_config": True,
        "bos_token_id": _json_ids(model.bos_token_id),
        "eos_token_id": _json_ids(model.eos_token_id),
    }
    if model.pad_token_id is not None:
        generation["pad_token_id"] = _json_ids(model.pad_token_id)
    (root / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


def _json_ids(ids: int | tuple[int, ...] | None) -> int | list[int] | None:
    return list(ids) if isinstance(ids, tuple) else ids


def _initializer_range(config: dict[str, Any]) -> float:
    """The weights' std: ``initializer_range``, or the language model's in a multimodal config."""
    text = config.get("text_config")
    fallback = text.get("initializer_range", 0.02) if isinstance(text, dict) else 0.02
    value = config.get("initializer_range", fallback)
    return float(value if value is not None else 0.02)


@dataclass(frozen=True)
class _ValueSource:
    """How tensor values are drawn and stored: see the module docstring."""

    seed: int
    dtype: str
    std: float
    norms: set[str]
    norm_mean: float  # 1 - the family's norm_offset: the applied scale (offset + w) is 1 plus noise

    def encoded_chunks(self, name: str, numel: int) -> Iterator[np.ndarray]:
        mean = self.norm_mean if name in self.norms else 0.0
        for values in tensor_chunks(name, numel, std=self.std, mean=mean, seed=self.seed):
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

    The tensors are those of the family's table (``model_tensors``), under its stored names; of a
    multimodal config (Gemma 3) only the language model's, what ovshard compiles.

    ``dtype`` is ``"float32"``, ``"float16"`` or ``"bfloat16"``; the written config.json says so.
    With ``max_shard_bytes`` the tensors are split, in order, into ``model-0000k-of-0000N.safetensors``
    plus ``model.safetensors.index.json`` (one ``model.safetensors`` if they fit in one shard). The
    checkpoint appears atomically: it is written to a temporary directory beside ``out_dir`` and
    renamed. ``out_dir`` must not exist or be empty.
    """
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {', '.join(STORAGE_DTYPES)}")
    model = describe(config)
    spec, dims = model.arch, model.dims
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
        _write_config_files(tmp, {**config, "dtype": dtype}, model)
        values = _ValueSource(
            seed=seed,
            dtype=dtype,
            std=_initializer_range(config),
            norms=_norm_names(spec, dims),
            norm_mean=1.0 - spec.norm_offset,
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
    model = describe(config)
    shapes = model_tensors(model.arch, model.dims)
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
    """The config of a named shape (``SHAPES``) or of a config.json of a supported family (a file or its folder)."""
    path = Path(source)
    if source in SHAPES:
        config = preset(source)
    elif path.is_file() or (path / CONFIG_FILE).is_file():
        config = _read_config(path if path.is_file() else path / CONFIG_FILE)
    else:
        raise OvshardError(f"unknown shape {source!r}: expected one of {', '.join(SHAPES)}, or the path of a "
                           f"Hugging Face config.json (or of the folder holding it) of a supported family: "
                           f"{', '.join(sorted(ARCHITECTURES))}")
    if layers is not None:
        config = with_layers(config, layers)
    describe(config)  # an unsupported model_type, key or value, or a missing key, fails here, naming what is wrong
    return config


def with_layers(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """``config`` cut (or grown) to ``layers`` layers: ``num_hidden_layers`` and ``layer_types`` follow.

    A multimodal config (Gemma 3) changes its ``text_config``, the language model's.
    """
    if layers < 1:
        raise OvshardError(f"--layers {layers}: expected at least 1 layer")
    if isinstance(config.get("text_config"), dict):
        return {**config, "text_config": with_layers(config["text_config"], layers)}
    config = {**config, "num_hidden_layers": layers}
    if isinstance(config.get("layer_types"), list) and config["layer_types"]:
        config["layer_types"] = resize_layer_types(config["layer_types"], layers)
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


@dataclass(frozen=True)
class SynthConfig:
    """What ``ovshard synth`` writes: a named shape (``SHAPES``) or a config.json, where, and how."""

    shape: str
    output: Path
    dtype: str | None = None  # None: the shape's published dtype, or the config.json's own (see storage_dtype)
    seed: int = 0
    layers: int | None = None  # num_hidden_layers override
    max_shard_size: str = "2GB"
    dry_run: bool = False


def storage_dtype(config: dict[str, Any], override: str | None = None) -> str:
    """The dtype to store: ``override``, else the config's ``dtype`` (a named shape's is its published model's:
    bfloat16 for Llama 3.x, Qwen, Mistral, Phi and Gemma 3, float32 for Gemma 2), else its legacy
    ``torch_dtype``, else float32."""
    dtype = override or config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in STORAGE_DTYPES:
        raise OvshardError(f"the config's dtype is {dtype!r}, which synth does not write; expected one of "
                           f"{', '.join(STORAGE_DTYPES)}: pass --dtype with one of them")
    return str(dtype)


def main_synth(args: argparse.Namespace) -> int:
    """``ovshard synth``: the command line's arguments as a :class:`SynthConfig`, run by :func:`synth`."""
    return synth(SynthConfig(shape=args.shape, output=Path(args.output), dtype=getattr(args, "dtype", None),
                             seed=args.seed, layers=args.layers, max_shard_size=args.max_shard_size,
                             dry_run=args.dry_run))


def synth(job: SynthConfig) -> int:
    """Write (or with ``dry_run`` only describe) a random-weight checkpoint; print one summary line."""
    config = shape_config(job.shape, job.layers)
    dtype = storage_dtype(config, job.dtype)
    config.pop("torch_dtype", None)  # written back once, as the transformers-5 "dtype"
    max_shard_bytes = _parse_size(job.max_shard_size)
    layout = checkpoint_layout(config, dtype, max_shard_bytes)
    logger.info("%s: %d layers, %d tensors in %d file(s)", job.shape, describe(config).dims.num_layers,
                len(layout.shapes), len(layout.files))
    for file, tensors, nbytes in layout.files:
        logger.debug("%s: %d tensors, %s", file, len(tensors), format_bytes(nbytes))
    if not job.dry_run:
        try:
            write_checkpoint(job.output, config, seed=job.seed, dtype=dtype, max_shard_bytes=max_shard_bytes)
        except FileExistsError as e:
            raise OvshardError(str(e)) from e
    verb = "would write" if job.dry_run else "wrote"
    print(f"{verb} {job.output}: {layout.parameters:,} parameters, {layout.nbytes:,} bytes "
          f"({format_bytes(layout.nbytes)}, {dtype}) in {len(layout.files)} safetensors file(s)")
    return 0


def _parse_size(text: str) -> int:
    try:
        (size,) = parse_budgets(text)
    except (PlanError, ValueError) as e:
        raise OvshardError(f"--max-shard-size {text!r}: expected one size such as 2GB, 500MB or 1.5GiB") from e
    return size
