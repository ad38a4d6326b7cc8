"""The bytes a token of context takes in a stage's KV cache as the CPU plugin stores it: the one count that the
partition planner, placement and ``ovshard inspect`` use.

A worker runs its stage on the CPU plugin's paged caches (runtime/engine/paged.py), in blocks of 32 positions a
KV head, in the element types of the plugin properties ``KV_CACHE_PRECISION`` (or ``KEY_CACHE_PRECISION`` and
``VALUE_CACHE_PRECISION`` apart) and ``VALUE_CACHE_GROUP_SIZE``: the bundle's CPU hints (manifest.CPU_PLUGIN_HINTS:
u8), else the plugin's own default (u8 on x86 in OpenVINO 2026.4). As OpenVINO 2026.4.1 lays them out (read from
the compiled stage's cache inputs; ``tests/compiler/test_kv_store.py`` checks the count against them):

* f32, f16, bf16: the elements, 4 or 2 bytes each.
* u8 and u4, keys: quantized by channel, a block's 32 positions of a channel sharing an f32 scale and zero point
  (8 bytes: a key block is [kv_heads, 32 + 8, head_dim] at u8, [kv_heads, 32 + 16, head_dim] at u4).
* u8 and u4, values: quantized by token, each group of ``VALUE_CACHE_GROUP_SIZE`` dims (0: the whole head) with
  its f32 scale and zero point beside it (a value block is [kv_heads, 32, v_dim + 8] at u8, group 0).

So at u8 a token of a 64-wide head takes 80 bytes of keys and 72 of values where f16 takes 128 and 128: 0.59x.
``--exact`` runs stages with f32 caches (runtime/engine/stage.py EXACT_HINTS), twice f16; a plan counts the
bundle's hints, what a stage stores by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ovshard.bundle.dims import ModelDims
from ovshard.errors import BundleError

__all__ = ["BLOCK_POSITIONS", "DEFAULT_PRECISION", "KVStore", "kv_store"]

BLOCK_POSITIONS = 32  # positions a block of the CPU plugin's paged caches holds
DEFAULT_PRECISION = "u8"  # the CPU plugin's KV_CACHE_PRECISION where no hint names one (OpenVINO 2026.4, x86)
_BITS = {"f32": 32, "f16": 16, "bf16": 16, "u8": 8, "u4": 4}
_ALIASES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "uint8_t": "u8", "uint4_t": "u4", "u8": "u8",
            "u4": "u4", "f32": "f32", "f16": "f16", "bf16": "bf16"}
_QUANT_PARAMS_BYTES = 8  # an f32 scale and an f32 zero point, per key channel a block or per value group a token


def _precision(value: str, where: str) -> str:
    found = _ALIASES.get(str(value).strip().lower())
    if found is None:
        raise BundleError(f"{where} {value!r}: expected one of {', '.join(_BITS)} (the CPU plugin's KV cache types)")
    return found


@dataclass(frozen=True)
class KVStore:
    """How a stage's caches hold keys and values: element types (``key``, ``value``: f32, f16, bf16, u8, u4),
    the value's quantization group (0: a whole head), and where that came from."""

    key: str = DEFAULT_PRECISION
    value: str = DEFAULT_PRECISION
    value_group: int = 0
    source: str = "the CPU plugin's default"

    def key_bytes_per_block(self, width: int) -> int:
        """A key head's bytes for one block of positions, ``width`` dims wide."""
        data = BLOCK_POSITIONS * width * _BITS[self.key] // 8
        return data + (width * _QUANT_PARAMS_BYTES if self.quantized(self.key) else 0)

    def value_bytes_per_block(self, width: int) -> int:
        """A value head's bytes for one block of positions, ``width`` dims wide."""
        groups = width // self.value_group if self.value_group and width % self.value_group == 0 else 1
        row = width * _BITS[self.value] // 8 + (groups * _QUANT_PARAMS_BYTES if self.quantized(self.value) else 0)
        return BLOCK_POSITIONS * row

    def bytes_per_token(self, dims: ModelDims) -> int:
        """KV bytes one position takes in one layer (every KV head's key and value, scales and zero points
        included), rounded up: a block's bytes over its positions."""
        keys, values = dims.cache_dims
        block = dims.cache_heads * (self.key_bytes_per_block(keys) + self.value_bytes_per_block(values))
        return -(-block // BLOCK_POSITIONS)

    @staticmethod
    def quantized(precision: str) -> bool:
        return precision in ("u8", "u4")

    def describe(self) -> str:
        """E.g. "u8 (keys by channel, values by token, each with an f32 scale and zero point; from the bundle's CPU
        hints)"."""
        kinds = self.key if self.key == self.value else f"keys {self.key}, values {self.value}"
        how = ""
        if self.quantized(self.key) or self.quantized(self.value):
            group = f"groups of {self.value_group}" if self.value_group else "token"
            how = f"keys by channel, values by {group}, each with an f32 scale and zero point; "
        return f"{kinds} ({how}from {self.source})"


def kv_store(hints: Mapping[str, str], source: str = "the bundle's CPU hints") -> KVStore:
    """The caches a CPU stage with plugin properties ``hints`` keeps (the plugin's default where they name none):
    ``KEY_CACHE_PRECISION``/``VALUE_CACHE_PRECISION`` over ``KV_CACHE_PRECISION``, and ``VALUE_CACHE_GROUP_SIZE``.
    BundleError on a type the plugin does not store a cache in."""
    both = hints.get("KV_CACHE_PRECISION")
    if both is None and "KEY_CACHE_PRECISION" not in hints and "VALUE_CACHE_PRECISION" not in hints:
        source = "the CPU plugin's default"
    base = _precision(both, "KV_CACHE_PRECISION") if both is not None else DEFAULT_PRECISION
    key = _precision(hints["KEY_CACHE_PRECISION"], "KEY_CACHE_PRECISION") if "KEY_CACHE_PRECISION" in hints else base
    value = (_precision(hints["VALUE_CACHE_PRECISION"], "VALUE_CACHE_PRECISION") if "VALUE_CACHE_PRECISION" in hints
             else base)
    try:
        group = int(hints.get("VALUE_CACHE_GROUP_SIZE", 0))
    except ValueError:
        raise BundleError(f"VALUE_CACHE_GROUP_SIZE {hints['VALUE_CACHE_GROUP_SIZE']!r}: expected a whole number of "
                          "dims (0: one group a head)") from None
    return KVStore(key, value, max(group, 0), source)
