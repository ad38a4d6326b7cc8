"""Lazy reader of a Hugging Face checkpoint directory (config.json + safetensors).

Opening a checkpoint reads config.json and the safetensors *headers* only, so listing names,
dtypes and shapes of a 100+ GB checkpoint costs a few kilobytes of I/O and needs no torch.
:meth:`Checkpoint.load` reads one tensor's bytes and nothing else.

Layouts understood (the same ones ``transformers`` writes):

- ``model.safetensors``: one file;
- ``model.safetensors.index.json`` + shards: ``{"weight_map": {tensor name: shard file}}``.

A safetensors file is ``u64 little-endian header length N``, ``N bytes of JSON``, then the data
block; each JSON entry is ``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets relative
to the data block. An optional ``__metadata__`` entry maps strings to strings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ovshard.bundle.dims import ModelDims
from ovshard.errors import CheckpointError
from ovshard.frontend.arch import ArchSpec
from ovshard.frontend.block import Block
from ovshard.frontend.description import ModelDescription, describe
from ovshard.frontend.tensors import model_tensors

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# files that hold weights, not tokenizer or config: left out of the tokenizer digest
WEIGHT_FILE_PREFIXES = ("model.safetensors", "model-", "pytorch_model")
# weight formats we recognise only to say how to convert them
UNSUPPORTED_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack")

# bytes per element of each safetensors dtype string
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# safetensors' own limit on the JSON header; a larger length means a corrupt file
MAX_HEADER_BYTES = 100_000_000
# tensors some Llama checkpoints carry that no model reads (old transformers saved rotary buffers)
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, dtype, shape and absolute byte range in that file."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header of one safetensors file and the raw bytes it was parsed from."""

    raw: bytes
    size: int  # size of the whole file
    tensors: dict[str, TensorEntry]  # in data-offset order


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """Parse the header of the safetensors file ``path`` without reading any tensor data."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"{path} is {size} bytes, too short to be safetensors (expected an 8-byte header "
                    "length first); the file is truncated: download or write it again"
                )
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise CheckpointError(
                    f"{path} declares a {length}-byte header but the file is {size} bytes; expected a "
                    f"header under {min(MAX_HEADER_BYTES, max(size - 8, 0))} bytes. The file is truncated "
                    "or corrupt: download or write it again"
                )
            raw = f.read(length)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"the header of {path} is not valid JSON ({e}); the file is corrupt: download or write it again"
        ) from e
    if not isinstance(header, dict):
        raise CheckpointError(f"the header of {path} is JSON {type(header).__name__}, expected an object")
    data_start = 8 + length
    tensors = [
        _parse_entry(path, name, value, data_start, size)
        for name, value in header.items()
        if name != "__metadata__"
    ]
    tensors.sort(key=lambda item: item[1].begin)
    return SafetensorsHeader(raw=raw, size=size, tensors=dict(tensors))


def _parse_entry(path: Path, name: str, value: Any, data_start: int, size: int) -> tuple[str, TensorEntry]:
    """Check one header entry against the file's size and return it as a :class:`TensorEntry`."""
    try:
        dtype = str(value["dtype"])
        shape = tuple(int(d) for d in value["shape"])
        begin, end = (int(o) for o in value["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{path}: header entry {name!r} is {value!r}; expected {{'dtype', 'shape', 'data_offsets'}}. "
            "The file is corrupt: download or write it again"
        ) from e
    if not 0 <= begin <= end or data_start + end > size:
        raise CheckpointError(
            f"{path}: tensor {name!r} occupies data bytes [{begin}, {end}) but the data block holds "
            f"{size - data_start} bytes; the file is truncated or corrupt: download or write it again"
        )
    itemsize = DTYPE_SIZES.get(dtype)
    if itemsize is not None and (end - begin) != math.prod(shape) * itemsize:
        raise CheckpointError(
            f"{path}: tensor {name!r} is {dtype} {list(shape)}, which needs {math.prod(shape) * itemsize} "
            f"bytes, but its data offsets span {end - begin}; the file is corrupt"
        )
    return name, TensorEntry(
        file=path.name, dtype=dtype, shape=shape, begin=data_start + begin, end=data_start + end
    )


@dataclass
class Checkpoint:
    """An opened checkpoint directory. Only headers are in memory; tensor data is read on demand."""

    path: Path
    config: dict[str, Any]  # config.json as read: copied into bundles; the compiler reads ``description``
    generation_config: dict[str, Any] | None
    has_tokenizer: bool
    description: ModelDescription  # everything read off config.json, once (:func:`~ovshard.frontend.description.describe`)
    weight_files: tuple[str, ...]  # safetensors files, sorted by name
    loaded: list[str] = field(default_factory=list)  # tensors whose data was read, in order
    _entries: dict[str, TensorEntry] = field(default_factory=dict, repr=False)
    _headers: dict[str, SafetensorsHeader] = field(default_factory=dict, repr=False)
    _config_bytes: bytes = field(default=b"", repr=False)  # config.json as read at open

    @property
    def spec(self) -> ArchSpec:
        """The family's table entry (``description.arch``)."""
        return self.description.arch

    @property
    def dims(self) -> ModelDims:
        """The dimensions (``description.dims``)."""
        return self.description.dims

    @property
    def block(self) -> Block:
        """What the decoder block computes (``description.block``)."""
        return self.description.block

    @property
    def quantization(self) -> str | None:
        """The source's own quantization (a GGUF file type such as ``"Q4_K_M"``); None: floating-point weights."""
        return None

    def tokenizer_folder(self, scratch: Path) -> Path:
        """A folder transformers loads this checkpoint's tokenizer from (a GGUF file writes one to ``scratch``)."""
        return self.path

    def tokenizer_digest(self) -> str:
        """sha256 over the folder's small non-weight files (tokenizer, chat template, configs): a cache key."""
        digest = hashlib.sha256()
        for file in sorted(self.path.iterdir()):
            if file.is_file() and not file.name.startswith(WEIGHT_FILE_PREFIXES) and file.stat().st_size < 1 << 26:
                digest.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
        return digest.hexdigest()

    def tensor_names(self) -> list[str]:
        """Every tensor name, in file order (files sorted by name, then by data offset)."""
        return list(self._entries)

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(
                f"{self.path} holds no tensor {name!r} ({len(self._entries)} tensors; "
                f"e.g. {', '.join(list(self._entries)[:3])})"
            ) from None

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """The safetensors dtype string (``"F32"``, ``"BF16"`` ...) and shape of ``name``, from the header."""
        entry = self._entry(name)
        return entry.dtype, entry.shape

    def nbytes(self, name: str) -> int:
        """Bytes ``name`` occupies on disk."""
        entry = self._entry(name)
        return entry.end - entry.begin

    def load(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` (and only it) and return it as float32."""
        import torch
        from safetensors import safe_open

        entry = self._entry(name)
        try:
            with safe_open(str(self.path / entry.file), framework="pt") as f:
                tensor: torch.Tensor = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise CheckpointError(
                f"cannot read tensor {name!r} from {self.path / entry.file}: {e}; the file is damaged or "
                "truncated: copy or save the checkpoint again"
            ) from e
        self.loaded.append(name)
        return tensor.to(torch.float32)

    def load_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of the 2-D tensor ``name`` as float32, reading only those rows' bytes."""
        import torch
        from safetensors import safe_open

        entry = self._entry(name)
        try:
            with safe_open(str(self.path / entry.file), framework="pt") as f:
                rows: torch.Tensor = f.get_slice(name)[start:end]
        except Exception as e:
            raise CheckpointError(f"cannot read rows [{start}, {end}) of {name!r} from {self.path / entry.file}: "
                                  f"{e}; the file is damaged or truncated: copy or save the checkpoint again") from e
        return rows.to(torch.float32)

    def tensor_digest(self, name: str, chunk: int = 1 << 24) -> str:
        """sha256 of the tensor's stored bytes (dtype and shape included): its content, for cache keys."""
        entry = self._entry(name)
        digest = hashlib.sha256(f"{entry.dtype}{list(entry.shape)}".encode())
        with open(self.path / entry.file, "rb") as f:
            f.seek(entry.begin)
            left = entry.end - entry.begin
            while left > 0:
                block = f.read(min(chunk, left))
                if not block:
                    raise CheckpointError(f"{self.path / entry.file} ends inside tensor {name!r}; the file is truncated")
                digest.update(block)
                left -= len(block)
        return digest.hexdigest()

    def fingerprint(self) -> str:
        """Identify this checkpoint without hashing its (possibly 100+ GB) data.

        ``"sha256:<hex>"`` over config.json's bytes (as read at open), then, for each weight file in sorted order, its
        name, its size in bytes and its safetensors header bytes (names, dtypes, shapes, offsets), each
        field length-prefixed. Editing config.json, renaming/resizing/retyping any tensor, or
        resharding changes it; rewriting tensor values in place with identical headers does not.
        """
        digest = hashlib.sha256()

        def put(data: bytes) -> None:
            digest.update(struct.pack("<Q", len(data)))
            digest.update(data)

        put(self._config_bytes)
        for file in self.weight_files:
            header = self._headers[file]
            put(file.encode())
            put(str(header.size).encode())
            put(header.raw)
        return "sha256:" + digest.hexdigest()

    def validate_tensors(self) -> None:
        """Check every tensor ``model_tensors(spec, dims)`` expects is present, floating, and well shaped.

        A tied checkpoint may (but need not) hold ``lm_head.weight``; an untied one must. Tensors the
        model would not read are an error too: they usually mean the config describes another model.
        """
        spec, dims = self.spec, self.dims
        expected = model_tensors(spec, dims)
        missing = [name for name in expected if name not in self._entries]
        if missing:
            hint = ""
            if spec.lm_head in missing:
                hint = (
                    f" config.json says tie_word_embeddings=false, so {spec.lm_head} must be stored; "
                    "if the model shares it with the embedding, set tie_word_embeddings to true."
                )
            raise CheckpointError(
                f"{self.path} lacks {len(missing)} of the {len(expected)} tensors a {dims.model_type} model "
                f"with {dims.num_layers} layers needs, e.g. {', '.join(missing[:5])}.{hint} Check that "
                "config.json belongs to these weights."
            )
        for name, shape in expected.items():
            entry = self._entries[name]
            if entry.shape != shape:
                raise CheckpointError(
                    f"{self.path}: tensor {name} has shape {list(entry.shape)} in {entry.file}, but "
                    f"config.json implies {list(shape)}; check that config.json belongs to these weights"
                )
            if entry.dtype not in FLOAT_DTYPES:
                raise CheckpointError(
                    f"{self.path}: tensor {name} is {entry.dtype}; expected one of {', '.join(FLOAT_DTYPES)}. "
                    "Quantized checkpoints are not supported: start from the floating-point weights"
                )
        allowed = set(expected) | ({spec.lm_head} if dims.tie_word_embeddings else set())
        extra = [n for n in self._entries if n not in allowed and not n.endswith(IGNORED_SUFFIXES)
                 and not n.startswith(self.description.unread_prefixes)]
        if extra:
            raise CheckpointError(
                f"{self.path} holds {len(extra)} tensors a {dims.model_type} model does not use, e.g. "
                f"{', '.join(extra[:5])}; the checkpoint is probably another architecture than config.json says"
            )


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open the checkpoint directory ``path``: parse config.json and the safetensors headers."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(
            f"checkpoint path {root} does not exist; expected a Hugging Face model directory"
        )
    if not root.is_dir():
        raise CheckpointError(
            f"checkpoint path {root} is a file; expected the directory holding config.json and *.safetensors"
        )
    config, config_bytes = _read_json(root / CONFIG_FILE, what="config.json")
    description = describe(config)
    generation_path = root / GENERATION_CONFIG_FILE
    generation = (
        _read_json(generation_path, what="generation_config.json")[0] if generation_path.exists() else None
    )
    files, weight_map = _weight_layout(root)
    headers = {file: read_safetensors_header(root / file) for file in files}
    entries = _select_entries(root, headers, weight_map)
    logger.debug("opened %s: %d tensors in %d files", root, len(entries), len(headers))
    return Checkpoint(
        path=root,
        config=config,
        generation_config=generation,
        has_tokenizer=any((root / name).is_file() for name in TOKENIZER_FILES),
        description=description,
        weight_files=tuple(headers),
        _entries=entries,
        _headers=headers,
        _config_bytes=config_bytes,
    )


def _read_json(path: Path, *, what: str) -> tuple[dict[str, Any], bytes]:
    """The JSON object in ``path`` and the bytes it was parsed from."""
    if not path.is_file():
        raise CheckpointError(
            f"{path.parent} has no {what}; expected a Hugging Face model directory "
            "(save one with model.save_pretrained(dir))"
        )
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); fix or re-download it") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}; expected an object")
    return data, raw


def _weight_layout(root: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files (sorted) and, for a sharded checkpoint, its tensor name -> shard map.

    ``model.safetensors`` wins over an index, as in transformers. Every shard the index names must exist.
    """
    if (root / SINGLE_FILE).is_file():
        return [SINGLE_FILE], None
    index_path = root / INDEX_FILE
    if not index_path.is_file():
        raise CheckpointError(_no_weights_message(root))
    index, _ = _read_json(index_path, what=INDEX_FILE)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index_path} has no 'weight_map' (found keys {sorted(index)}); expected "
            '{"weight_map": {"<tensor name>": "<shard file>"}}; re-download or re-save the checkpoint'
        )
    weight_map = {str(name): str(file) for name, file in weight_map.items()}
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise CheckpointError(
            f"{index_path} references {len(missing)} shard files that are not in {root}: "
            f"{', '.join(missing[:5])}; the download is incomplete: fetch the missing shards"
        )
    return files, weight_map


def _select_entries(
    root: Path, headers: dict[str, SafetensorsHeader], weight_map: dict[str, str] | None
) -> dict[str, TensorEntry]:
    """Every tensor in file order; with an index, only the ones it maps, each from its own shard."""
    entries = {
        name: entry
        for file, header in headers.items()
        for name, entry in header.tensors.items()
        if weight_map is None or weight_map.get(name) == file
    }
    if weight_map is not None:
        stray = [name for name in weight_map if name not in entries]
        if stray:
            raise CheckpointError(
                f"{root / INDEX_FILE} maps {len(stray)} tensors to shards that do not hold them, e.g. "
                f"{stray[0]!r} -> {weight_map[stray[0]]}; the index and shards disagree: download them again"
            )
    return entries


def _no_weights_message(root: Path) -> str:
    found = sorted(
        {p.name for pattern in (*UNSUPPORTED_WEIGHT_PATTERNS, "*.safetensors") for p in root.glob(pattern)}
    )
    found_text = f"found {', '.join(found[:5])}" if found else "found no weight files"
    gguf = sorted(p.name for p in root.glob("*.gguf"))
    if gguf:
        return (f"{root} holds {', '.join(gguf[:3])} but no safetensors; to compile a GGUF file, pass the file "
                f"itself: ovshard compile {root / gguf[0]} ...")
    return (
        f"{root} has neither {SINGLE_FILE} nor {INDEX_FILE} ({found_text}). ovshard reads safetensors "
        "folders and GGUF files; PyTorch .bin/.pt checkpoints are not supported. Convert with transformers: "
        "model = AutoModelForCausalLM.from_pretrained(dir); model.save_pretrained(new_dir, "
        "safe_serialization=True)"
    )
