"""What a node's CPU is, as far as its stage's plugin settings care: its instruction-set class and its name.

The class picks the bundle's CPU plugin hints for that class (``runtime_hints.cpu_plugin_by_isa``, keyed by
the bundle's ``CPU_ISA_CLASSES``). It is read from the first ``flags`` line of /proc/cpuinfo (Linux on x86);
a CPU whose flags cannot be read is "other". The environment variable OVSHARD_CPU_ISA forces a class.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Collection, Iterator
from pathlib import Path

from ovshard.bundle.manifest import CPU_ISA_CLASSES
from ovshard.errors import ConfigError

__all__ = ["CPUINFO", "ISA_ENV", "ISA_FLAGS", "check_isa", "classify", "cpu_flags", "cpu_name", "forced_isa",
           "isa_class"]

CPUINFO = Path("/proc/cpuinfo")
ISA_ENV = "OVSHARD_CPU_ISA"

# The flags each class needs, most capable first: a CPU's class is the first whose flags it has all of.
# avx512 is oneDNN's avx512_core (F, BW, VL, DQ: Skylake-SP, Zen 4 and later; not Knights Landing, which
# lacks BW and VL); avx512_amx adds AMX tiles with int8 and bf16 (Sapphire Rapids and later); avx2 needs FMA too.
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
ISA_FLAGS: tuple[tuple[str, frozenset[str]], ...] = (
    ("avx512_amx", _AVX512 | {"amx_tile", "amx_int8", "amx_bf16"}),
    ("avx512", _AVX512),
    ("avx2", frozenset({"avx2", "fma"})),
)


def _fields(path: Path, key: str) -> Iterator[str]:
    """The values of ``key : value`` lines of a cpuinfo file, in order; none if it cannot be read."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == key:
                    yield value.strip()
    except OSError:
        return


def cpu_flags(path: Path | None = None) -> frozenset[str]:
    """The flags of the first CPU in ``path`` (default /proc/cpuinfo); empty where there is no such line."""
    return frozenset(next(_fields(path or CPUINFO, "flags"), "").split())


def classify(flags: Collection[str]) -> str:
    """The ISA class of a CPU with these flags: the first of ISA_FLAGS whose flags it has, else "other"."""
    return next((isa for isa, needed in ISA_FLAGS if needed <= set(flags)), "other")


def isa_class(path: Path | None = None) -> str:
    """This node's ISA class: OVSHARD_CPU_ISA if set (ConfigError if it names no class), else the class of
    the first CPU's flags in ``path`` (default /proc/cpuinfo), "other" where they cannot be read."""
    return forced_isa() or classify(cpu_flags(path))


def forced_isa() -> str | None:
    """The class OVSHARD_CPU_ISA forces (ConfigError if it names none); None where it is unset or empty."""
    forced = os.environ.get(ISA_ENV, "").strip()
    if not forced:
        return None
    return check_isa(forced, f"{ISA_ENV}={forced!r}", f"; unset {ISA_ENV} to read the class from this CPU's flags")


def check_isa(isa: str, where: str, advice: str = "") -> str:
    """``isa`` if it is one of the bundle's ISA classes; else ConfigError naming ``where`` and the classes."""
    if isa not in CPU_ISA_CLASSES:
        raise ConfigError(f"{where}: expected an ISA class, one of {', '.join(CPU_ISA_CLASSES)}{advice}")
    return isa


def cpu_name(path: Path | None = None) -> str:
    """The first CPU's "model name" in ``path`` (default /proc/cpuinfo), as lscpu shows it; else what Python's
    platform module knows (often the architecture alone), else "unknown"."""
    return next(_fields(path or CPUINFO, "model name"), "") or platform.processor() or "unknown"
