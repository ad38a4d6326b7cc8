"""A llama.cpp GGUF file (llama.cpp, Ollama, LM Studio) read as a Hugging Face checkpoint.

Opening a file parses its metadata and tensor table (memory-mapped, with the ``gguf`` package, through
:mod:`ovshard.frontend.gguf_reader`) and rebuilds the ``config.json`` transformers would
(``AutoConfig.from_pretrained(dir, gguf_file=name)``). Tensors keep their Hugging Face names and values:
:meth:`GGUFCheckpoint.load` dequantizes one tensor (``load_rows`` only the rows asked for; quantization
blocks run along rows) and undoes what llama.cpp's ``convert_hf_to_gguf.py`` did to it, exactly as
transformers' GGUF loader does; :mod:`ovshard.frontend.gguf_layout` says, tensor by tensor, where its
bytes lie and what the undo is.

The config comes from :mod:`ovshard.frontend.gguf_config`, which also holds the table of GGUF
architectures read (llama, qwen2, qwen3, qwen2moe, qwen3moe, gpt-oss, glm4moe, deepseek2, llama4, gemma2, gemma3;
llama with experts as mixtral).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ovshard.bundle import staging
from ovshard.errors import CheckpointError
from ovshard.frontend.checkpoint import Checkpoint
from ovshard.frontend.description import describe
from ovshard.frontend.gguf_config import family_of, generation_config, rebuild_config
from ovshard.frontend.gguf_layout import (
    LAYOUT_VERSION,
    ROPE_FREQS,
    GGUFTensor,
    map_tensors,
    permutation,
    refuse_unread_expert_layouts,
)
from ovshard.frontend.gguf_reader import open_reader
from ovshard.frontend.tensors import model_tensors

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FLOAT_TYPES = ("F32", "F16", "BF16")  # stored as values, not quantization blocks
# the vocabulary arrays: long, and only the tokenizer (read by transformers) needs their contents
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.merges")


@dataclass(frozen=True)
class SourceQuantization:
    """How the GGUF file stores its weights, for the manifest."""

    file_type: str  # llama.cpp's name for the file as a whole: "Q4_K_M", "Q8_0", "F16", "F32", or "unknown"
    tensor_types: tuple[tuple[str, int], ...]  # (ggml type, tensor count), most tensors first

    @property
    def quantized(self) -> bool:
        return any(t not in FLOAT_TYPES for t, _ in self.tensor_types)


@dataclass
class GGUFCheckpoint(Checkpoint):
    """An opened .gguf file; ``path`` is the file. Tensor names, shapes and values are Hugging Face's."""

    metadata: dict[str, Any] = field(default_factory=dict, repr=False)  # every key but the vocabulary arrays
    _reader: Any = field(default=None, repr=False)  # a gguf.GGUFReader (memory map)
    _tensors: dict[str, GGUFTensor] = field(default_factory=dict, repr=False)  # by Hugging Face name
    _unmapped: tuple[str, ...] = field(default=(), repr=False)  # GGUF tensors no Hugging Face name maps to

    def tensor_names(self) -> list[str]:
        """Every tensor's Hugging Face name, in file order."""
        return list(self._tensors)

    def _tensor(self, name: str) -> GGUFTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path} holds no tensor {name!r} ({len(self._tensors)} tensors; e.g. "
                                  f"{', '.join(list(self._tensors)[:3])})") from None

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """The ggml type (``"Q4_K"``, ``"F32"`` ...) and Hugging Face shape of ``name``."""
        t = self._tensor(name)
        return t.ggml_type, t.shape

    def nbytes(self, name: str) -> int:
        t = self._tensor(name)
        return sum(part.end - part.begin for part in t.parts)

    def load(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantized to float32, as transformers' GGUF loader returns it."""
        t = self._tensor(name)
        rows = None if t.permute_heads is None else permutation(t.shape[0], t.permute_heads)
        tensor = self._joined(t) if t.joined else self._decode(t, rows)
        self.loaded.append(name)
        return tensor

    def _joined(self, t: GGUFTensor) -> torch.Tensor:
        """A tensor Hugging Face holds rearranged: gpt-oss's and Llama 4's experts, [E, in, out] with gate and up
        interleaved or in halves; MLA's kv_b from its key and value parts."""
        import torch

        if t.appended is not None:  # MLA's kv_b: [heads, rank, nope] -> [heads, nope, rank], then [heads, v, rank]
            keys = self._decode(t, None).transpose(-1, -2)
            return torch.cat([keys, self._decode(t.appended, None)], dim=1).reshape(t.shape)
        values = self._decode(t, None)  # [E, out, in] (a bias: [E, out])
        axis = -2 if t.transposed else -1  # along out
        if t.interleaved is not None:  # [E, out, 2, in] -> [E, 2 * out, in]
            values = torch.stack([values, self._decode(t.interleaved, None)], dim=axis).flatten(axis - 1, axis)
        if t.halves is not None:  # [E, out + out, in]
            values = torch.cat([values, self._decode(t.halves, None)], dim=axis)
        return values.transpose(-1, -2).contiguous() if t.transposed else values

    def load_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of the 2-D tensor ``name`` as float32, dequantizing only those rows."""
        t = self._tensor(name)
        if len(t.shape) != 2 or not 0 <= start <= end <= t.shape[0]:
            raise CheckpointError(f"rows [{start}, {end}) of {name!r}: expected a 2-D tensor and rows within "
                                  f"[0, {t.shape[0] if t.shape else 0}); it has shape {list(t.shape)}")
        if t.joined:
            return self._joined(t)[start:end]
        if t.permute_heads is None:
            return self._decode(t, np.arange(start, end))
        return self._decode(t, permutation(t.shape[0], t.permute_heads)[start:end])

    def _decode(self, t: GGUFTensor, rows: np.ndarray | None) -> torch.Tensor:
        import torch
        from gguf.quants import dequantize

        stored = self._reader.tensors[t.index]
        # an expert: its [out, row] slab (a half of it for a fused gate_up expert)
        whole = stored.data if t.expert is None else stored.data[t.expert][t.first_row:t.first_row + t.shape[0]]
        data = whole if rows is None else whole[rows]  # [rows, bytes or values of a row]
        try:
            values = dequantize(data, stored.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise CheckpointError(f"{self.path}: cannot dequantize {t.gguf_name} ({t.ggml_type}): {e}; convert "
                                  "the file to a supported type with llama.cpp's llama-quantize") from e
        if t.norm_offset:
            values = values - 1  # float32 arithmetic, as transformers does it
        if not values.flags.writeable:  # an F32 tensor is a view of the read-only map
            values = values.copy()
        shape = tuple(int(d) for d in reversed(stored.shape.tolist())) if t.joined else t.shape  # joined: as stored
        return torch.from_numpy(values.reshape(-1 if rows is None else len(rows), *shape[1:]))

    def tensor_digest(self, name: str, chunk: int = 1 << 24) -> str:
        """sha256 of the tensor's stored bytes, its type, shape and undo: its content, for cache keys."""
        t = self._tensor(name)
        digest = hashlib.sha256(f"{LAYOUT_VERSION}{t.ggml_type}{list(t.shape)}{t.undo}".encode())
        view = memoryview(self._reader.data)
        for part in t.parts:
            for offset in range(part.begin, part.end, chunk):
                digest.update(view[offset:min(offset + chunk, part.end)])
        return digest.hexdigest()

    def fingerprint(self) -> str:
        """``"sha256:<hex>"`` over the file's size and header (metadata, tensor names, types, shapes, offsets).

        Rewriting tensor values in place with an identical header does not change it.
        """
        digest = hashlib.sha256()
        for part in (LAYOUT_VERSION.encode(), str(self.path.stat().st_size).encode(),
                     bytes(self._reader.data[:self._reader.data_offset])):
            digest.update(struct.pack("<Q", len(part)))
            digest.update(part)
        return "sha256:" + digest.hexdigest()

    @property
    def source_quantization(self) -> SourceQuantization:
        from gguf import LlamaFileType

        counts = Counter(t.tensor_type.name for t in self._reader.tensors)
        code: Any = self.metadata.get("general.file_type")
        try:
            name = LlamaFileType(int(code)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except (TypeError, ValueError):  # absent, or newer than this gguf package
            name = "unknown"
        return SourceQuantization(file_type=name, tensor_types=tuple(counts.most_common()))

    def validate_tensors(self) -> None:
        """Check the file holds exactly the tensors the model reads, well shaped and of a type we dequantize."""
        spec, dims = self.spec, self.dims
        expected = model_tensors(spec, dims)
        missing = [name for name in expected if name not in self._tensors]
        if missing:
            raise CheckpointError(
                f"{self.path} lacks {len(missing)} of the {len(expected)} tensors a {dims.model_type} model with "
                f"{dims.num_layers} layers needs, e.g. {', '.join(missing[:5])}; the file is incomplete or "
                "its metadata describes another model: convert it again with llama.cpp's convert_hf_to_gguf.py")
        for name, shape in expected.items():
            if self._tensors[name].shape != shape:
                raise CheckpointError(f"{self.path}: {self._tensors[name].gguf_name} ({name}) has shape "
                                      f"{list(self._tensors[name].shape)}, but the metadata implies {list(shape)}")
        extra = self._unmapped + tuple(n for n in self._tensors if n not in expected and n != spec.lm_head)
        if extra:
            raise CheckpointError(
                f"{self.path} holds {len(extra)} tensors a {dims.model_type} model does not use, e.g. "
                f"{', '.join(extra[:5])}; ovshard reads the dense text model only (no vision tower, experts or "
                "adapters)")
        for ggml_type in sorted({t.ggml_type for t in self._tensors.values()}):
            sample = next(t for t in self._tensors.values() if t.ggml_type == ggml_type)
            self._decode(sample, np.arange(1))  # one row: a type gguf cannot dequantize raises here, not mid-compile

    @property
    def quantization(self) -> str | None:
        q = self.source_quantization
        return q.file_type if q.quantized else None

    def tokenizer_digest(self) -> str:
        return self.fingerprint()  # the vocabulary and chat template live in the header

    def tokenizer_folder(self, scratch: Path) -> Path:
        folder = scratch / "hf-tokenizer"
        self.export_tokenizer(folder)
        return folder

    def export_tokenizer(self, out_dir: Path) -> list[str]:
        """Write a Hugging Face folder without weights: the tokenizer (with the file's chat template,
        ``tokenizer.chat_template``, as chat_template.jinja), config.json and generation_config.json;
        return the names written.

        The tokenizer is transformers' own reading of the file
        (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``, or the class the family table names, which
        AutoTokenizer falls back to), so ``convert_tokenizer(out_dir, ...)`` and openvino-genai see what
        transformers does.
        """
        import transformers
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

        if not self.has_tokenizer:
            raise CheckpointError(f"{self.path} has no tokenizer metadata (tokenizer.ggml.model); "
                                  "the bundle takes and returns token ids only")
        out_dir.mkdir(parents=True, exist_ok=True)
        model_type = self.dims.model_type
        family = family_of(self.path, str(self.metadata.get("general.architecture")), self.metadata)
        # naming the class skips transformers re-reading the whole file for a config it only needs for that
        hint = {"tokenizer_type": model_type} if TOKENIZER_MAPPING_NAMES.get(model_type) else {}
        loader = transformers.AutoTokenizer
        if family.tokenizer_class is not None:
            loader, hint = getattr(transformers, family.tokenizer_class), {}
        try:
            tokenizer = loader.from_pretrained(self.path.parent, gguf_file=self.path.name, **hint)
        except Exception as e:  # transformers raises many types for vocabularies it cannot convert
            raise CheckpointError(f"transformers cannot read the tokenizer of {self.path} "
                                  f"({type(e).__name__}: {e})") from e
        written = [Path(p).name for p in tokenizer.save_pretrained(out_dir)]
        for name, data in (("config.json", self.config), ("generation_config.json", self.generation_config)):
            staging.write_text(out_dir / name, json.dumps(data, indent=2, sort_keys=True) + "\n")
            written.append(name)
        return sorted(set(written))


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open the .gguf file ``path``: parse its metadata and tensor table, rebuild its config.json."""
    path = Path(path)
    reader = open_reader(path)
    metadata = {name: f.contents() for name, f in reader.fields.items() if name not in TOKENIZER_ARRAYS}
    arch = str(metadata.get("general.architecture"))
    family = family_of(path, arch, metadata)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    rope_freqs = next((t.data for t in reader.tensors if t.name == ROPE_FREQS), None)
    config = rebuild_config(path, arch, family, metadata, shapes, rope_freqs)
    description = describe(config)
    if family.experts is not None:
        refuse_unread_expert_layouts(path, reader, description.arch)
    tensors, unmapped = map_tensors(reader, arch, family, description.arch, description.dims)
    ckpt = GGUFCheckpoint(
        path=path, config=config, generation_config=generation_config(metadata),
        has_tokenizer="tokenizer.ggml.model" in metadata, description=description,
        weight_files=(path.name,), metadata=metadata, _reader=reader, _tensors=tensors, _unmapped=unmapped,
    )
    quant = ckpt.source_quantization
    if quant.quantized:
        logger.info("%s is quantized (%s: %s); ovshard reads it dequantized to float32", path.name, quant.file_type,
                    ", ".join(f"{n} {t}" for t, n in quant.tensor_types))
    logger.debug("opened %s: %s %s, %d tensors", path, arch, quant.file_type, len(tensors))
    return ckpt

