"""A llama.cpp GGUF file (llama.cpp, Ollama, LM Studio) read as a Hugging Face checkpoint.

Opening a file parses its metadata and tensor table (memory-mapped, with the ``gguf`` package) and
rebuilds the ``config.json`` transformers would (``AutoConfig.from_pretrained(dir, gguf_file=name)``).
Tensors keep their Hugging Face names and values: :meth:`GGUFCheckpoint.load` dequantizes one tensor
(``load_rows`` only the rows asked for; quantization blocks run along rows) and undoes what
llama.cpp's ``convert_hf_to_gguf.py`` did to it, exactly as transformers' GGUF loader does:

- llama: q and k rows permuted into llama.cpp's rotary layout (``permute``); undone per head;
- Gemma 2/3: RMSNorm scales stored as ``1 + w``; Hugging Face keeps ``w`` (and adds the 1 at run time);
- mixture of experts (qwen2moe, qwen3moe, Mixtral as llama): each projection's experts stacked in one
  [E, out, in] tensor; each expert is read as its own slab of it;
- gpt-oss: its experts' x @ W tensors split into gate and up and transposed; joined back into Hugging
  Face's ``gate_up_proj`` (gate and up interleaved) and ``down_proj`` when read.

The config comes from :mod:`ovshard.frontend.gguf_config`, which also holds the table of GGUF
architectures read (llama, qwen2, qwen3, qwen2moe, qwen3moe, gpt-oss, gemma2, gemma3; llama with experts as
mixtral).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ovshard.bundle import staging
from ovshard.errors import CheckpointError
from ovshard.frontend.arch import ArchSpec, model_tensors
from ovshard.frontend.checkpoint import Checkpoint
from ovshard.frontend.description import describe
from ovshard.frontend.gguf_config import GGUFFamily, family_of, generation_config, rebuild_config

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader

    from ovshard.bundle.dims import ModelDims

logger = logging.getLogger(__name__)

FLOAT_TYPES = ("F32", "F16", "BF16")  # stored as values, not quantization blocks
# the vocabulary arrays: long, and only the tokenizer (read by transformers) needs their contents
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.merges")
LAYOUT_VERSION = "ovshard-gguf-1"  # bump when a tensor's undo changes: it is part of every tensor digest
PER_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")  # experts unstacked (old llama.cpp)
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rope factors: read into the config, not a model tensor


def _reader_class() -> type[GGUFReader]:
    from gguf import GGUFReader, GGUFValueType

    array, string = int(GGUFValueType.ARRAY), int(GGUFValueType.STRING)

    class Reader(GGUFReader):
        """``gguf.GGUFReader`` with its inner helpers made cheap: the same fields, tensors and bytes.

        Upstream makes every value a ``numpy.memmap`` slice, whose bookkeeping dominates opening a file
        with a 262k-token vocabulary (about 20 s); here each value is a plain view of the same map, a
        numeric array one view rather than one per element (``field.contents()`` reads it whole), and a
        string array is walked with ``struct`` rather than one recursive call per string.
        """

        def _plain(self) -> np.ndarray:
            plain = self.__dict__.get("_plain_map")
            if plain is None:
                plain = self.__dict__["_plain_map"] = self.data.view(np.ndarray)
            return plain

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            count = int(count)
            values = self._plain()[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return values.view(values.dtype.newbyteorder(override_order or self.byte_order))

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if int(raw_type) != array or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            n, item = int(count[0]), int(item_type[0])
            types = [GGUFValueType.ARRAY, GGUFValueType(item)]
            numpy_type = self.gguf_scalar_to_np.get(GGUFValueType(item))
            if numpy_type is not None:
                values = self._get(orig_offs + 12, numpy_type, n)
                if len(values) != n:
                    raise ValueError("the file ends inside a metadata array")
                return 12 + int(values.nbytes), [item_type, count, values], [2], types
            if item != string:
                return super()._get_field_parts(orig_offs, raw_type)
            plain, offset = self._plain(), orig_offs + 12
            parts: list[Any] = [item_type, count]
            for _ in range(n):  # each string: [u64 length][bytes], as upstream's parts
                (length,) = struct.unpack_from("<Q", plain.data, offset)
                if offset + 8 + length > len(plain):
                    raise ValueError("the file ends inside a metadata string")
                parts += [plain[offset:offset + 8].view(np.uint64), plain[offset + 8:offset + 8 + length]]
                offset += 8 + length
            return offset - orig_offs, parts, list(range(3, len(parts), 2)), types

    return Reader


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file under its Hugging Face name, and what undoes llama.cpp's conversion."""

    gguf_name: str
    index: int  # in the reader's tensor list
    ggml_type: str  # "Q4_K", "Q8_0", "F32" ...
    shape: tuple[int, ...]  # Hugging Face (torch) order: [out_features, in_features]
    begin: int  # absolute byte range in the file
    end: int
    norm_offset: bool = False  # stored 1 + w
    permute_heads: int | None = None  # rows permuted per head into llama.cpp's rotary layout
    expert: int | None = None  # one expert's [out, in] slab of a stacked [E, out, in] tensor (ffn_*_exps)
    first_row: int = 0  # where its rows start in that slab (up's half of a fused ffn_gate_up_exps expert)
    transposed: bool = False  # held by Hugging Face as x @ W: the stored tensor's last two axes swapped
    interleaved: GGUFTensor | None = None  # its rows alternate with this tensor's (gate, up, gate, up ...)

    @property
    def undo(self) -> str:
        """The transform, as a string for digests."""
        undo = f"norm_offset={self.norm_offset};permute_heads={self.permute_heads};expert={self.expert}"
        if self.first_row:
            undo += f";first_row={self.first_row}"
        if self.transposed:
            undo += ";transposed"
        if self.interleaved is not None:
            undo += f";interleaved={self.interleaved.gguf_name}"
        return undo

    @property
    def joined(self) -> bool:
        """Rearranged from the stored tensor (transposed, interleaved with another), not one of its slabs."""
        return self.transposed or self.interleaved is not None


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
        return t.end - t.begin + (0 if t.interleaved is None else t.interleaved.end - t.interleaved.begin)

    def load(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantized to float32, as transformers' GGUF loader returns it."""
        t = self._tensor(name)
        rows = None if t.permute_heads is None else _permutation(t.shape[0], t.permute_heads)
        tensor = self._joined(t) if t.joined else self._decode(t, rows)
        self.loaded.append(name)
        return tensor

    def _joined(self, t: GGUFTensor) -> torch.Tensor:
        """A tensor Hugging Face holds rearranged: gpt-oss's experts, [E, in, out] with gate and up interleaved."""
        import torch

        values = self._decode(t, None)  # [E, out, in] (a bias: [E, out])
        if t.interleaved is not None:  # along out: [E, out, 2, in] -> [E, 2 * out, in]
            axis = -2 if t.transposed else -1
            values = torch.stack([values, self._decode(t.interleaved, None)], dim=axis).flatten(axis - 1, axis)
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
        return self._decode(t, _permutation(t.shape[0], t.permute_heads)[start:end])

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
        for part in (t,) if t.interleaved is None else (t, t.interleaved):
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
    reader = _open_reader(path)
    metadata = {name: f.contents() for name, f in reader.fields.items() if name not in TOKENIZER_ARRAYS}
    arch = str(metadata.get("general.architecture"))
    family = family_of(path, arch, metadata)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    rope_freqs = next((t.data for t in reader.tensors if t.name == ROPE_FREQS), None)
    config = rebuild_config(path, arch, family, metadata, shapes, rope_freqs)
    description = describe(config)
    if family.experts is not None:
        _refuse_unread_expert_layouts(path, reader, description.arch)
    tensors, unmapped = _map_tensors(reader, arch, family, description.arch, description.dims)
    ckpt = GGUFCheckpoint(
        path=path, config=config, generation_config=generation_config(metadata),
        has_tokenizer="tokenizer.ggml.model" in metadata, description=description,
        weight_files=(path.name,), metadata=metadata, _reader=reader, _tensors=tensors, _unmapped=unmapped,
    )
    quant = ckpt.source_quantization
    if quant.quantized:
        logger.warning(
            "%s is quantized (%s: %s). ovshard dequantizes it to float32; compressing it again to INT4 (the "
            "default --weights) compounds the two quantization errors. Compile with --weights fp16 or fp32, "
            "or start from the original safetensors checkpoint.", path.name, quant.file_type,
            ", ".join(f"{n} {t}" for t, n in quant.tensor_types))
    logger.debug("opened %s: %s %s, %d tensors", path, arch, quant.file_type, len(tensors))
    return ckpt


def _refuse_unread_expert_layouts(path: Path, reader: GGUFReader, spec: ArchSpec) -> None:
    """Refuse the expert layouts not read: one tensor an expert (``blk.N.ffn_gate.E.weight``, llama.cpp's layout
    before it stacked experts), and gate and up fused (``ffn_gate_up_exps``) for a family that holds its experts
    stacked itself (gpt-oss: ``_join_experts`` interleaves separate gate and up tensors)."""
    old = [t.name for t in reader.tensors if PER_EXPERT.fullmatch(t.name)]
    if old:
        raise CheckpointError(
            f"{path} stores its experts one tensor each ({len(old)} tensors such as {old[0]}), the layout of "
            "llama.cpp conversions from before April 2024; ovshard reads experts stacked (blk.N.ffn_gate_exps). "
            "Convert the model again with a current llama.cpp's convert_hf_to_gguf.py, or start from the "
            "safetensors checkpoint.")
    fused = next((t.name for t in reader.tensors if t.name.endswith(".ffn_gate_up_exps.weight")), None)
    if fused and spec.stacked_experts:
        raise CheckpointError(
            f"{path} holds its experts' gate and up projections fused ({fused}, convert_hf_to_gguf.py "
            f"--fuse-gate-up-exps), which ovshard splits for families of one matrix an expert only, not "
            f"{spec.family}'s. Convert the model again without --fuse-gate-up-exps, or start from the safetensors "
            "checkpoint.")


def _open_reader(path: Path) -> GGUFReader:
    if not path.is_file():
        what = "a folder" if path.is_dir() else "missing"
        raise CheckpointError(f"GGUF file {path} is {what}; expected a .gguf file written by llama.cpp "
                              "(e.g. a download from Ollama or LM Studio)")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file: it starts with {magic!r}, where a GGUF file starts with "
                              "b'GGUF'; pass a .gguf file, or the folder of a safetensors checkpoint")
    try:
        reader = _reader_class()(path, "r")
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=reader.data_offset)
        if any(t.data.nbytes != t.n_bytes for t in reader.tensors) or end > path.stat().st_size:
            raise ValueError(f"its tensors end at byte {end}")
    except (ValueError, IndexError, KeyError, OverflowError, struct.error, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is truncated or corrupt ({path.stat().st_size} bytes; {e}); "
                              "download or convert it again") from e
    if reader.byte_order != "I":
        raise CheckpointError(f"{path} is a big-endian GGUF file; convert it on (or for) a little-endian machine")
    return reader


def _map_tensors(reader: GGUFReader, arch: str, family: GGUFFamily, spec: ArchSpec, dims: ModelDims,
                 ) -> tuple[dict[str, GGUFTensor], tuple[str, ...]]:
    """GGUF tensors under their Hugging Face names (gguf-py's name table, as transformers uses it)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch)
    names = get_tensor_name_map(arch_id, dims.num_layers)
    hf_names = [*model_tensors(spec, dims), spec.lm_head]
    to_hf = {names.get_name(n, try_suffixes=(".weight", ".bias")): n for n in hf_names}
    to_hf.pop(None, None)  # a name the table lacks: validate_tensors reports it missing
    # a parameter Hugging Face names without a suffix (gpt-oss's sinks) llama.cpp stores as <name>.weight
    to_hf |= {f"{g}.weight": n for g, n in to_hf.items() if not n.endswith((".weight", ".bias"))}
    if spec.moe:  # stacked experts keep their GGUF name here; _split_experts and _join_experts name them
        to_hf |= {f"blk.{i}.{kind}.{suffix}": f"blk.{i}.{kind}.{suffix}" for i in range(dims.num_layers)
                  for kind in _STACKED for suffix in ("weight", "bias")}
    norms = {t.format(i=i) for t in spec.norm_templates() for i in range(dims.num_layers)} | {spec.final_norm}
    heads = {spec.q_proj.format(i=i): dims.num_heads for i in range(dims.num_layers)}
    heads |= {spec.k_proj.format(i=i): dims.num_kv_heads for i in range(dims.num_layers)}
    tensors, unmapped = {}, []
    for index, t in enumerate(reader.tensors):
        hf = to_hf.get(t.name)
        if hf is None:
            if t.name != ROPE_FREQS:  # read into rope_parameters
                unmapped.append(t.name)
            continue
        module = hf.rsplit(".", 1)[0]
        tensors[hf] = GGUFTensor(
            gguf_name=t.name, index=index, ggml_type=t.tensor_type.name,
            shape=tuple(int(d) for d in reversed(t.shape.tolist())), begin=int(t.data_offset),
            end=int(t.data_offset) + int(t.n_bytes), norm_offset=family.norm_offset and hf in norms,
            permute_heads=heads.get(module) if family.permute_qk else None,
        )
    return _join_experts(_split_experts(tensors, spec, dims), spec, dims), tuple(unmapped)


# each stacked GGUF tensor and the expert projections it holds, in the order of its rows: convert_hf_to_gguf.py
# --fuse-gate-up-exps writes one ffn_gate_up_exps [E, 2 * size, hidden] a layer, each expert's gate rows first
_STACKED = {"ffn_gate_exps": ("expert_gate",), "ffn_up_exps": ("expert_up",), "ffn_down_exps": ("expert_down",),
            "ffn_gate_up_exps": ("expert_gate", "expert_up")}


def _split_experts(tensors: dict[str, GGUFTensor], spec: ArchSpec, dims: ModelDims) -> dict[str, GGUFTensor]:
    """Each stacked expert tensor (``blk.N.ffn_gate_exps`` [E, out, in], mapped under its own GGUF name) as one
    entry an expert under the checkpoint's names, each its byte slab of the file (rows stay whole blocks)."""
    out = {}
    shared_gates = {spec.shared_expert_gate.format(i=i) + ".weight" for i in range(dims.num_layers)} \
        if spec.shared_expert_gate else set()
    for name, t in tensors.items():
        if name in shared_gates and len(t.shape) == 1:  # llama.cpp stores the [1, hidden] gate as [hidden]
            t = replace(t, shape=(1, *t.shape))
        kind = t.gguf_name.split(".")[-2] if t.gguf_name.startswith("blk.") else ""
        found = [getattr(spec, p) for p in _STACKED[kind]] if kind in _STACKED and spec.moe else [None]
        templates = [str(f) for f in found if f is not None]
        if len(templates) < len(found):  # not stacked experts, or stacked as the family holds them (gpt-oss)
            out[name] = t
            continue
        layer, experts, parts = int(t.gguf_name.split(".")[1]), t.shape[0], len(templates)
        slab, rows = (t.end - t.begin) // experts // parts, t.shape[1] // parts  # one projection of one expert
        for e in range(experts):
            for p, template in enumerate(templates):
                hf = template.replace("{i}", str(layer)).replace("{e}", str(e)) + ".weight"
                begin = t.begin + (e * parts + p) * slab
                out[hf] = replace(t, shape=(rows, *t.shape[2:]), begin=begin, end=begin + slab, expert=e,
                                  first_row=p * rows)
    return out


def _join_experts(tensors: dict[str, GGUFTensor], spec: ArchSpec, dims: ModelDims) -> dict[str, GGUFTensor]:
    """gpt-oss's experts under Hugging Face's names: it holds each layer's as x @ W tensors, gate and up in one
    (``gate_up_proj`` [E, hidden, 2 * size], gate and up alternating along the last axis, and its bias
    [E, 2 * size]; ``down_proj`` [E, size, hidden]); llama.cpp's converter splits and transposes them into
    ``ffn_{gate,up,down}_exps`` [E, out, in] with biases [E, out]. A stacked tensor missing from the file leaves
    its Hugging Face name missing, for validate_tensors to report."""
    if not spec.stacked_experts:
        return tensors
    out = dict(tensors)
    for i in range(dims.num_layers):
        prefix = spec.stacked_experts.format(i=i)
        stored = {f"{kind}.{suffix}": out.pop(f"blk.{i}.ffn_{kind}_exps.{suffix}", None)
                  for kind in ("gate", "up", "down") for suffix in ("weight", "bias")}
        gate, up, down, gate_bias, up_bias, down_bias = (stored[k] for k in (
            "gate.weight", "up.weight", "down.weight", "gate.bias", "up.bias", "down.bias"))
        if gate is not None and up is not None:
            experts, size, hidden = gate.shape
            out[prefix + ".gate_up_proj"] = replace(gate, shape=(experts, hidden, 2 * size), transposed=True,
                                                    interleaved=up)
        if gate_bias is not None and up_bias is not None:
            out[prefix + ".gate_up_proj_bias"] = replace(gate_bias, shape=(gate_bias.shape[0], 2 * gate_bias.shape[1]),
                                                         interleaved=up_bias)
        if down is not None:
            out[prefix + ".down_proj"] = replace(down, shape=(down.shape[0], down.shape[2], down.shape[1]),
                                                 transposed=True)
        if down_bias is not None:
            out[prefix + ".down_proj_bias"] = down_bias
    return out


def _permutation(rows: int, heads: int) -> np.ndarray:
    """Row r of a Hugging Face q/k projection is row ``perm[r]`` of llama.cpp's.

    convert_hf_to_gguf.py's ``permute`` interleaves each head's two rotary halves:
    [heads, 2, half] -> [heads, half, 2]; reading the rows back through ``perm`` undoes it.
    """
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
