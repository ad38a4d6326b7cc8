"""The KV bytes a token that the planner, placement and `ovshard inspect` count (bundle/kv_store.py) against the
caches of real compiled paged stages, under the bundle's hints and under other plugin properties."""

from __future__ import annotations

from pathlib import Path

import openvino as ov
import pytest
from conftest import compile_fp32

from ovshard.bundle.kv_store import DEFAULT_PRECISION, kv_store
from ovshard.bundle.manifest import read_manifest
from ovshard.errors import BundleError
from ovshard.plan.placement import _units
from ovshard.runtime.engine.paged import compile_paged
from ovshard.runtime.engine.plugin import plugin_config
from ovshard.verify.inspect import summary

PROPERTIES = ({}, {"KV_CACHE_PRECISION": "f16"}, {"KV_CACHE_PRECISION": "f32"}, {"KV_CACHE_PRECISION": "u4"},
              {"VALUE_CACHE_GROUP_SIZE": "4"}, {"KEY_CACHE_PRECISION": "u8", "VALUE_CACHE_PRECISION": "u4"})


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("kv") / "b2", stages=2)


@pytest.mark.parametrize("properties", PROPERTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "hints")
def test_the_count_equals_a_compiled_paged_stages_cache_bytes(bundle: Path, properties: dict[str, str]) -> None:
    """Each stage of a 2-stage stories260K bundle compiled in paged form with the bundle's hints (u8) and with
    other cache types and groups: the count from the properties it compiled with is the bytes its cache tensors
    take a position, scales and zero points included; with the bundle's hints it is the plan's recorded count."""
    manifest = read_manifest(bundle)
    core = ov.Core()
    for entry in manifest.stages:
        stage = compile_paged(core, bundle, manifest, entry.index, "CPU", properties or None, num_blocks=4)
        store = kv_store(plugin_config(manifest, "CPU", properties or None))
        layers = len(entry.stage.layers)
        assert store.bytes_per_token(manifest.architecture) * layers == stage.bytes_per_token, store
        reported = {name: kv_store({"KV_CACHE_PRECISION": stage.compiled.get_property(f"{name.upper()}_CACHE_PRECISION").get_type_name()}).key
                    for name in ("key", "value")}
        assert reported == {"key": store.key, "value": store.value}
        if not properties:
            assert manifest.plan.stages[entry.index].kv_bytes_per_token == stage.bytes_per_token


def test_the_plugins_default_is_the_default_counted() -> None:
    """Where no hint names a cache type, the count assumes the CPU plugin's own default: still what it reports."""
    found = kv_store({"KV_CACHE_PRECISION": ov.Core().get_property("CPU", "KV_CACHE_PRECISION").get_type_name()})
    assert found.key == found.value == DEFAULT_PRECISION
    assert kv_store({}).key == DEFAULT_PRECISION and kv_store({}).source == "the CPU plugin's default"


def test_placement_and_inspect_count_what_the_hints_store(bundle: Path) -> None:
    """Placement counts each stage's KV by the bundle's hints, `ovshard inspect` shows the same a layer beside
    f16's, and a hint the plugin cannot store a cache in is refused by name."""
    manifest = read_manifest(bundle)
    per_layer = manifest.kv_store.bytes_per_token(manifest.architecture)
    assert per_layer == 4 * (8 * 40 + 32 * (8 + 8)) // 32 == 104  # 4 heads: keys 8 x 40 rows, values 32 x (8 + 8)
    units = _units(manifest, 1024)
    assert list(units.kv_prefix) == [0, *(per_layer * s.end for s in (e.stage for e in manifest.stages))]
    shown = summary(bundle, manifest)
    assert "KV cache: 104 B a token a layer (4 heads x (keys 8 + values 8) as u8 (keys by channel, values by token" \
        in shown and "f16 would be 128 B" in shown, shown
    with pytest.raises(BundleError, match="KV_CACHE_PRECISION 'i8': expected one of f32, f16, bf16, u8, u4"):
        kv_store({"KV_CACHE_PRECISION": "i8"})
