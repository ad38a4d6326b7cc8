"""A node's CPU facts (ovshard.runtime.engine.cpu): the ISA class from sample /proc/cpuinfo files, the
OVSHARD_CPU_ISA override, the CPU's name. Never the machine's own CPU.

The samples in cpuinfo/ are the lines the module reads of /proc/cpuinfo as Linux writes it on those CPUs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ovshard.bundle.manifest import CPU_ISA_CLASSES
from ovshard.errors import ConfigError
from ovshard.runtime.engine import cpu

SAMPLES = Path(__file__).parent / "cpuinfo"


@pytest.fixture(autouse=True)
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without OVSHARD_CPU_ISA, whatever the environment that runs the tests sets."""
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)


@pytest.mark.parametrize(("sample", "expected"), [
    ("sapphire_rapids", "avx512_amx"),
    ("epyc_zen4", "avx512"),  # AVX512-BF16, no AMX
    ("skylake_sp", "avx512"),
    ("haswell", "avx2"),
    ("arm64_neoverse_n1", "other"),  # no flags line: "Features"
])
def test_a_cpu_is_classed_by_its_flags(monkeypatch: pytest.MonkeyPatch, sample: str, expected: str) -> None:
    """Each sample CPU gets the class its first flags line earns, read from the (patched) cpuinfo path."""
    monkeypatch.setattr(cpu, "CPUINFO", SAMPLES / f"{sample}.txt")
    assert cpu.isa_class() == expected


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx512f", "avx512cd", "avx512er", "avx512pf", "avx2", "fma"}, "avx2"),  # Knights Landing: no BW, VL, DQ
    ({"avx512f", "avx512bw", "avx512vl", "avx2", "fma"}, "avx2"),  # no DQ
    ({"amx_tile", "amx_int8", "amx_bf16", "avx2", "fma"}, "avx2"),  # AMX without AVX-512 is not avx512_amx
    ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_tile", "amx_bf16"}, "avx512"),  # no amx_int8
    ({"avx2"}, "other"),  # no FMA
    ({"avx", "sse4_2"}, "other"),  # Sandy Bridge
    (set(), "other"),
])
def test_each_class_needs_all_of_its_flags(flags: set[str], expected: str) -> None:
    """A CPU missing any one flag of a class falls to the next class down."""
    assert cpu.classify(flags) == expected


def test_the_classes_are_the_bundles() -> None:
    """The detected classes, and "other", are exactly the keys a bundle's per-class hints may use."""
    assert tuple(name for name, _ in cpu.ISA_FLAGS) + ("other",) == CPU_ISA_CLASSES


def test_unreadable_cpuinfo_is_other(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where /proc/cpuinfo is missing, the class is "other" and the name comes from elsewhere, never an error."""
    monkeypatch.setattr(cpu, "CPUINFO", tmp_path / "missing")
    monkeypatch.setattr(cpu.platform, "processor", lambda: "")
    assert (cpu.cpu_flags(), cpu.isa_class(), cpu.cpu_name()) == (frozenset(), "other", "unknown")


@pytest.mark.parametrize("forced", CPU_ISA_CLASSES)
def test_the_override_forces_a_class(monkeypatch: pytest.MonkeyPatch, forced: str) -> None:
    """OVSHARD_CPU_ISA wins over the flags: a Haswell forced to any class reports that class."""
    monkeypatch.setattr(cpu, "CPUINFO", SAMPLES / "haswell.txt")
    monkeypatch.setenv(cpu.ISA_ENV, forced)
    assert cpu.isa_class() == forced


def test_an_unknown_override_is_refused_with_the_valid_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that names no class is a ConfigError that quotes it and lists every class."""
    monkeypatch.setenv(cpu.ISA_ENV, "avx512-amx")
    with pytest.raises(ConfigError, match=r"OVSHARD_CPU_ISA='avx512-amx': expected an ISA class, one of "
                                          r"avx512_amx, avx512, avx2, other; unset OVSHARD_CPU_ISA"):
        cpu.isa_class()


@pytest.mark.parametrize(("sample", "name"), [
    ("sapphire_rapids", "Intel(R) Xeon(R) Platinum 8480+"),
    ("epyc_zen4", "AMD EPYC"),
    ("haswell", "Intel(R) Xeon(R) CPU E5-2676 v3 @ 2.40GHz"),
])
def test_the_cpu_name_is_its_model_name(monkeypatch: pytest.MonkeyPatch, sample: str, name: str) -> None:
    """cpu_name() is the first "model name", as lscpu shows it."""
    monkeypatch.setattr(cpu, "CPUINFO", SAMPLES / f"{sample}.txt")
    assert cpu.cpu_name() == name
