"""The properties a stage compiles with (ovshard.runtime.engine.plugin): the bundle's hints for every CPU, under
its hints for the CPU's ISA class, under the caller's settings; and the line that says so."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from conftest import compile_fp32

from ovshard.bundle.manifest import CPU_ISA_CLASSES, Manifest, read_manifest
from ovshard.errors import ConfigError
from ovshard.runtime.engine import cpu
from ovshard.runtime.engine.plugin import describe_plugin_config, plugin_config

BASE = {"PERFORMANCE_HINT": "LATENCY", "KV_CACHE_PRECISION": "u8", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"}
BY_ISA = {"avx512_amx": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "64"},
          "avx512": {"KV_CACHE_PRECISION": "f16", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "128"},
          "avx2": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}}
CALLER = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "16", "INFERENCE_NUM_THREADS": "2"}


@pytest.fixture(scope="module")
def manifest(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    """stories260K's manifest, its hints replaced by BASE and BY_ISA."""
    m = read_manifest(compile_fp32(stories, tmp_path_factory.mktemp("plugin") / "b", stages=1))
    return replace(m, runtime_hints=replace(m.runtime_hints, cpu_plugin=BASE, cpu_plugin_by_isa=BY_ISA))


@pytest.fixture(autouse=True)
def haswell(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's CPU is the Haswell sample (class avx2), whatever runs the tests; no OVSHARD_CPU_ISA."""
    monkeypatch.setattr(cpu, "CPUINFO", Path(__file__).parent / "cpuinfo" / "haswell.txt")
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)


@pytest.mark.parametrize("isa", CPU_ISA_CLASSES)
def test_the_class_hints_win_over_the_base_and_the_caller_over_both(manifest: Manifest, isa: str) -> None:
    """For each class: the bundle's base hints, then its hints for that class, then the caller's, key by key."""
    assert plugin_config(manifest, "CPU", None, isa) == {**BASE, **BY_ISA.get(isa, {})}
    assert plugin_config(manifest, "CPU", CALLER, isa) == {**BASE, **BY_ISA.get(isa, {}), **CALLER}


def test_the_class_defaults_to_this_cpus(manifest: Manifest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``isa`` the CPU's own class applies (avx2 on the Haswell sample), or the one OVSHARD_CPU_ISA forces."""
    assert plugin_config(manifest, "cpu", None)["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "0"
    assert "(ISA class avx2):" in describe_plugin_config(manifest)
    monkeypatch.setenv(cpu.ISA_ENV, "avx512_amx")
    assert plugin_config(manifest, "CPU", None) == {**BASE, **BY_ISA["avx512_amx"]}
    assert "(ISA class avx512_amx from OVSHARD_CPU_ISA):" in describe_plugin_config(manifest)


def test_other_devices_get_the_callers_settings_alone(manifest: Manifest) -> None:
    """The bundle's hints are CPU plugin properties: a GPU stage compiles with the caller's settings only."""
    assert plugin_config(manifest, "GPU", CALLER, "avx512_amx") == CALLER
    assert plugin_config(manifest, "GPU", None) == {}


def test_an_unknown_class_is_refused(manifest: Manifest) -> None:
    """A class that is not one of the bundle's is an error, not a silent miss of every per-class hint."""
    with pytest.raises(ConfigError, match="ISA class 'avx-512': expected an ISA class, one of avx512_amx"):
        plugin_config(manifest, "CPU", None, "avx-512")


def test_the_description_names_the_cpu_its_class_and_where_each_property_comes_from(manifest: Manifest) -> None:
    """One line: the CPU's name and class, then each property that applies under the layer that set it."""
    assert describe_plugin_config(manifest, "CPU", CALLER, "avx512_amx") == (
        "CPU 'Intel(R) Xeon(R) CPU E5-2676 v3 @ 2.40GHz' (ISA class avx512_amx): PERFORMANCE_HINT=LATENCY, "
        "KV_CACHE_PRECISION=u8 from the bundle's hints; INFERENCE_PRECISION_HINT=f32 from the bundle's hints for "
        "avx512_amx; DYNAMIC_QUANTIZATION_GROUP_SIZE=16, INFERENCE_NUM_THREADS=2 from the node's settings "
        "(--exact, --threads)")


def test_the_description_says_when_the_bundle_has_nothing_for_the_class(manifest: Manifest) -> None:
    """A class without hints is named as such; a bundle without any hints leaves the plugin's own defaults."""
    assert describe_plugin_config(manifest, "CPU", None, "other").endswith(
        "(ISA class other, no hints for it in the bundle): PERFORMANCE_HINT=LATENCY, KV_CACHE_PRECISION=u8, "
        "DYNAMIC_QUANTIZATION_GROUP_SIZE=32 from the bundle's hints")
    bare = replace(manifest, runtime_hints=replace(manifest.runtime_hints, cpu_plugin={}, cpu_plugin_by_isa={}))
    assert describe_plugin_config(bare, "CPU").endswith(
        "(ISA class avx2, no hints for it in the bundle): the plugin's own defaults")
    assert describe_plugin_config(bare, "GPU") == "GPU: the plugin's own defaults"
