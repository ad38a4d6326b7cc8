"""The typed manifest: a strict round trip, refusals that name the field, version checks, tiling checks."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from conftest import compile_fp32

from ovshard.bundle import names
from ovshard.bundle.manifest import (
    CPU_PLUGIN_BY_ISA_MEASURED,
    CPU_PLUGIN_HINTS,
    CPU_PLUGIN_HINTS_BY_ISA,
    FORMAT_VERSION,
    Manifest,
    read_manifest,
)
from ovshard.errors import BundleError


@pytest.fixture(scope="module")
def manifest_dict(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    bundle = compile_fp32(stories, tmp_path_factory.mktemp("manifest") / "b", stages=2)
    return json.loads((bundle / names.MANIFEST_FILE).read_text())


def refused(d: dict) -> str:
    with pytest.raises(BundleError) as info:
        Manifest.from_dict(d)
    return str(info.value)


def test_manifest_round_trips_exactly(manifest_dict: dict) -> None:
    """Decoding then encoding the written manifest gives back the same JSON, key for key."""
    assert json.loads(Manifest.from_dict(manifest_dict).to_json()) == manifest_dict


def test_an_unknown_key_is_refused_with_its_place(manifest_dict: dict) -> None:
    """A key the format does not define, however deep, is an error naming where it is."""
    d = copy.deepcopy(manifest_dict)
    d["stages"][1]["activation_type"] = "f32"
    assert "manifest.json.stages[1]: unknown key 'activation_type'" in refused(d)


def test_a_missing_or_mistyped_field_is_refused(manifest_dict: dict) -> None:
    """A missing field and a value of the wrong type each name the field and what was expected."""
    d = copy.deepcopy(manifest_dict)
    del d["runtime_hints"]["max_positions"]
    assert "manifest.json.runtime_hints: the key 'max_positions' is missing" in refused(d)
    d = copy.deepcopy(manifest_dict)
    d["architecture"]["num_layers"] = "5"
    assert "manifest.json.architecture.num_layers: expected an integer, found '5'" in refused(d)


def test_layer_ranges_must_tile_the_model(manifest_dict: dict) -> None:
    """Stage ranges that leave a gap, overlap or stop short of the last layer are refused."""
    d = copy.deepcopy(manifest_dict)
    d["stages"][1]["stage"]["start"] += 1
    d["plan"]["stages"][1]["stage"]["start"] += 1
    assert "contiguous" in refused(d)
    d = copy.deepcopy(manifest_dict)
    d["architecture"]["num_layers"] = 7
    assert "the model has 7 layers" in refused(d)


def test_stage_entries_must_agree_with_the_plan(manifest_dict: dict) -> None:
    """The plan's stages and the stage entries describe the same split."""
    d = copy.deepcopy(manifest_dict)
    d["plan"]["stages"][0]["stage"]["end"] = d["plan"]["stages"][1]["stage"]["start"] = 1
    assert "differ from the stage entries" in refused(d)


@pytest.mark.parametrize(("version", "says"), [(1, "older ovshard"), (FORMAT_VERSION + 1, "upgrade ovshard")])
def test_other_format_versions_say_what_to_do(manifest_dict: dict, tmp_path: Path, version: int, says: str) -> None:
    """An older bundle asks for a recompile, a newer one for an upgrade; read_manifest names the file."""
    d = copy.deepcopy(manifest_dict)
    d["version"] = version
    (tmp_path / names.MANIFEST_FILE).write_text(json.dumps(d))
    with pytest.raises(BundleError, match=f"format version {version}.*{says}"):
        read_manifest(tmp_path)


def test_a_new_bundle_carries_the_cpu_hints_per_isa_class(manifest_dict: dict) -> None:
    """A compile writes the per-class CPU plugin hints and the measurement behind each into runtime_hints."""
    hints = manifest_dict["runtime_hints"]
    assert hints["cpu_plugin_by_isa"] == CPU_PLUGIN_HINTS_BY_ISA
    assert hints["cpu_plugin_by_isa_measured"] == CPU_PLUGIN_BY_ISA_MEASURED


def test_a_manifest_from_before_the_per_class_hints_still_reads(manifest_dict: dict) -> None:
    """Without cpu_plugin_by_isa and its measurements (an older compile) a manifest reads with none of them."""
    d = copy.deepcopy(manifest_dict)
    del d["runtime_hints"]["cpu_plugin_by_isa"], d["runtime_hints"]["cpu_plugin_by_isa_measured"]
    hints = Manifest.from_dict(d).runtime_hints
    assert (hints.cpu_plugin, hints.cpu_plugin_by_isa, hints.cpu_plugin_by_isa_measured) == (CPU_PLUGIN_HINTS, {}, {})


def test_hints_for_an_unknown_isa_class_are_refused(manifest_dict: dict) -> None:
    """A per-class hint keyed by no known class (a typo would never apply) names the key and the classes."""
    d = copy.deepcopy(manifest_dict)
    d["runtime_hints"]["cpu_plugin_by_isa"]["avx512-amx"] = {"INFERENCE_PRECISION_HINT": "f32"}
    assert ("manifest.json.runtime_hints: cpu_plugin_by_isa names the ISA class 'avx512-amx'; expected one of "
            "avx512_amx, avx512, avx2, other") in refused(d)


def test_a_context_past_the_default_cap_compiles_for_the_cap_and_says_so(
        stories: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint declaring 10,485,760 positions (Llama 4 Scout's) compiles for DEFAULT_POSITIONS_CAP, with a
    warning that names both and --max-positions, instead of rotary tables of gigabytes; --max-positions wins."""
    import shutil

    from ovshard.compile import DEFAULT_POSITIONS_CAP

    checkpoint = tmp_path / "long"
    shutil.copytree(stories, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10_485_760}))
    with caplog.at_level("WARNING", logger="ovshard.compile"):
        capped = read_manifest(compile_fp32(checkpoint, tmp_path / "capped", stages=1))
    assert capped.runtime_hints.max_positions == DEFAULT_POSITIONS_CAP == 131_072
    assert "10,485,760 positions" in caplog.text and "--max-positions" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ovshard.compile"):
        asked = read_manifest(compile_fp32(checkpoint, tmp_path / "asked", stages=1, max_positions=4096))
    assert asked.runtime_hints.max_positions == 4096 and "positions" not in caplog.text
