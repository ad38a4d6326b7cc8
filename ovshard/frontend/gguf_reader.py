"""Opening a GGUF file's bytes: checks that it is a whole little-endian GGUF file, and a faster ``gguf.GGUFReader``.

The reader yields the fields, tensors and bytes upstream's does; :mod:`ovshard.frontend.gguf` builds a
checkpoint on it.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ovshard.errors import CheckpointError

if TYPE_CHECKING:
    from gguf import GGUFReader


def reader_class() -> type[GGUFReader]:
    """``gguf.GGUFReader`` made fast to open (a class built on first use: gguf is a compile-only dependency)."""
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


def open_reader(path: Path) -> GGUFReader:
    """The memory-mapped reader of the GGUF file ``path``; refuses a missing, foreign, truncated or big-endian file."""
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
        reader = reader_class()(path, "r")
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=reader.data_offset)
        if any(t.data.nbytes != t.n_bytes for t in reader.tensors) or end > path.stat().st_size:
            raise ValueError(f"its tensors end at byte {end}")
    except (ValueError, IndexError, KeyError, OverflowError, struct.error, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is truncated or corrupt ({path.stat().st_size} bytes; {e}); "
                              "download or convert it again") from e
    if reader.byte_order != "I":
        raise CheckpointError(f"{path} is a big-endian GGUF file; convert it on (or for) a little-endian machine")
    return reader

