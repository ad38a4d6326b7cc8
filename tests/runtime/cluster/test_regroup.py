"""A per-layer bundle regrouped on the nodes (ovshard.runtime.cluster.regroup) runs as the fine bundle does.

stories260K has 5 layers: the fine bundle has one stage a layer, regrouped into [[0, 1, 2], [3, 4]].
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from conftest import compile_fp32, run_greedy

from ovshard.bundle import names
from ovshard.bundle.manifest import Manifest, StageEntry, bundle_fingerprint, read_manifest, verify_files
from ovshard.errors import BundleError
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.cluster import regroup
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.runtime.node.worker import StageWorker
from ovshard.verify.fusion import runtime_fusion

pytestmark = pytest.mark.slow


GROUPS = [[0, 1, 2], [3, 4]]
PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time"
NEW_TOKENS = 32
CONTRACT = {names.INPUT_IDS, names.HIDDEN_STATES, names.ATTENTION_MASK, names.POSITION_IDS, names.BEAM_IDX,
            names.LOGITS}


@dataclasses.dataclass(frozen=True)
class Regrouped:
    fine: Path
    manifest: Manifest  # the fine bundle's
    out: Path
    entries: list[StageEntry]


@pytest.fixture(scope="module")
def regrouped(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Regrouped:
    """stories260K in 5 fp32 stages, and the same bundle regrouped into GROUPS."""
    root = tmp_path_factory.mktemp("regroup")
    fine = compile_fp32(stories, root / "fine", stages=5, max_positions=64)
    manifest = read_manifest(fine)
    out = root / "grouped"
    entries = [regroup.write_group(fine, manifest, GROUPS, g, out) for g in range(len(GROUPS))]
    regroup.write_group_bundle(fine, manifest, GROUPS, entries, out)
    return Regrouped(fine, manifest, out, entries)


def test_regrouped_greedy_matches_fine(regrouped: Regrouped) -> None:
    """32 greedy tokens and the logits that chose them equal the fine bundle's."""
    tokens, logits = run_greedy(regrouped.out, PROMPT, NEW_TOKENS)
    fine_tokens, fine_logits = run_greedy(regrouped.fine, PROMPT, NEW_TOKENS)
    assert tokens == fine_tokens
    np.testing.assert_allclose(logits, fine_logits, atol=1e-5, rtol=0)


def test_regrouped_prompt_logits_match_fine(regrouped: Regrouped) -> None:
    """The last group's logits at every prompt position are within 1e-5 of the fine last stage's."""
    grouped, _ = LocalPipeline(regrouped.out, config=EXACT_HINTS).forward(PROMPT)
    fine, _ = LocalPipeline(regrouped.fine, config=EXACT_HINTS).forward(PROMPT)
    assert grouped.shape == (len(PROMPT), regrouped.manifest.architecture.vocab_size)
    np.testing.assert_allclose(grouped, fine, atol=1e-5, rtol=0)


def test_group_keeps_fused_kv_attention(regrouped: Regrouped) -> None:
    """The CPU plugin fuses the KV cache into attention in every layer of a merged group."""
    core = ov.Core()
    for entry in regrouped.entries:
        layers = entry.layers[1] - entry.layers[0]
        compiled = core.compile_model(str(regrouped.out / entry.model_xml), "CPU", EXACT_HINTS)
        report = runtime_fusion(compiled, entry.index, layers)
        assert (report.fused_sdpa, report.unfused_attention) == (layers, 0), report.runtime_ops


def test_merged_model_has_the_stage_contract(regrouped: Regrouped) -> None:
    """A merged middle group has one input and one output of each contract name, and every part's state."""
    model = regroup.merge_models(ov.Core(), regrouped.fine, regrouped.manifest, [1, 2, 3])
    assert [p.get_names() for p in model.inputs] == [{n} for n in (*names.stage_inputs(False, []), names.BEAM_IDX)]
    assert [p.get_names() for p in model.outputs] == [{names.HIDDEN_STATES}]
    inner = [n for op in model.get_ordered_ops() if op.get_type_name() not in ("Parameter", "Result")
             for port in op.outputs() for n in port.get_names() & CONTRACT]
    assert inner == [names.HIDDEN_STATES]  # only the tensor the Result reads, which is the output
    assert sorted(v.get_info().variable_id for v in model.get_variables()) == sorted(
        n for i in (1, 2, 3) for n in (names.past_key(i), names.past_value(i)))
    assert len(model.get_sinks()) == 6
    friendly = [op.get_friendly_name() for op in model.get_ordered_ops() if op.get_type_name() == "Assign"]
    assert len(set(friendly)) == len(friendly)


def test_group_entries_describe_io_as_a_compile_does(regrouped: Regrouped) -> None:
    """Entries read their I/O back from the saved IR: the first and last fine stages' names and state."""
    fine = regrouped.manifest.stages
    for entry, group in zip(regrouped.entries, GROUPS, strict=True):
        assert entry.inputs == fine[group[0]].inputs
        assert entry.state_variables == tuple(v for i in group for v in fine[i].state_variables)
    # group 0 takes ids, so its output reads back as hidden_states (fine stage 2's, beside its input, as hidden_states_1)
    assert [e.outputs for e in regrouped.entries] == [fine[0].outputs, fine[4].outputs]
    assert [(e.model_xml, e.model_bin) for e in regrouped.entries] == [("stage_0.xml", "stage_0.bin"),
                                                                       ("stage_1.xml", "stage_1.bin")]
    verify_files(regrouped.out, read_manifest(regrouped.out))


def test_group_manifest_is_deterministic_and_tiles_the_layers(regrouped: Regrouped) -> None:
    """Two group_manifest calls give one JSON, read back unchanged, with a plan of the groups' sums."""
    fine, entries = regrouped.manifest, regrouped.entries
    first = regroup.group_manifest(fine, GROUPS, entries)
    assert first.to_json() == regroup.group_manifest(fine, GROUPS, entries).to_json()
    assert (regrouped.out / names.MANIFEST_FILE).read_text() == first.to_json()
    assert read_manifest(regrouped.out) == first
    assert first.plan.strategy == regroup.STRATEGY
    assert [s.layers for s in first.plan.stages] == [(0, 3), (3, 5)]
    for field in ("weight_bytes", "kv_bytes_per_token", "memory_bytes"):
        assert sum(getattr(s, field) for s in first.plan.stages) == sum(getattr(s, field) for s in fine.plan.stages)
    assert [s.activation_bytes_in for s in first.plan.stages] == [0, fine.plan.stages[3].activation_bytes_in]
    assert [r.stage for r in first.pass_log] == [0 if r.stage < 3 else 1 for r in fine.pass_log]
    assert (first.source, first.weights, first.tokenizer, first.chat, first.extra_files) == (
        fine.source, fine.weights, fine.tokenizer, fine.chat, fine.extra_files)


def test_group_files_are_deterministic(regrouped: Regrouped, tmp_path: Path) -> None:
    """Building a group again elsewhere gives byte-identical files (no counter-based names)."""
    again = regroup.write_group(regrouped.fine, regrouped.manifest, GROUPS, 0, tmp_path / "again")
    assert again == regrouped.entries[0]


def test_non_consecutive_parts_are_refused(regrouped: Regrouped) -> None:
    """merge_models refuses parts that skip a stage, naming them."""
    with pytest.raises(BundleError, match=r"parts \[1, 3\] are not consecutive: stage 3 follows stage 1"):
        regroup.merge_models(ov.Core(), regrouped.fine, regrouped.manifest, [1, 3])


def test_groups_that_do_not_tile_are_refused(regrouped: Regrouped, tmp_path: Path) -> None:
    """Groups that leave out a stage are refused before anything is written."""
    with pytest.raises(BundleError, match="do not split the bundle's 5 stages"):
        regroup.write_group(regrouped.fine, regrouped.manifest, [[0, 1], [3, 4]], 0, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_clashing_state_ids_are_refused(regrouped: Regrouped) -> None:
    """Two parts that keep state under one variable id (stage 1's IR twice) cannot be merged."""
    fine = regrouped.manifest
    twin = dataclasses.replace(fine.stages[2], model_xml=fine.stages[1].model_xml)
    manifest = dataclasses.replace(fine, stages=(*fine.stages[:2], twin, *fine.stages[3:]))
    with pytest.raises(BundleError, match="stages 1 and 2 both keep the state variable 'past_key_values.1"):
        regroup.merge_models(ov.Core(), regrouped.fine, manifest, [1, 2])


def test_restarted_write_group_does_no_work(regrouped: Regrouped, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second write_group over intact files builds nothing, touches nothing, returns the same entry."""
    entry = regrouped.entries[0]
    before = {name: (regrouped.out / name).stat().st_mtime_ns for name in entry.sha256}

    def no_build(*args: object) -> None:
        raise AssertionError("write_group built the group again")

    monkeypatch.setattr(regroup, "merge_models", no_build)
    assert regroup.write_group(regrouped.fine, regrouped.manifest, GROUPS, 0, regrouped.out) == entry
    assert {name: (regrouped.out / name).stat().st_mtime_ns for name in entry.sha256} == before


def test_damaged_group_is_written_again(regrouped: Regrouped, tmp_path: Path) -> None:
    """A group file that no longer matches its stamp is rebuilt, to the same bytes."""
    out = tmp_path / "damaged"
    shutil.copytree(regrouped.out, out)
    entry = regrouped.entries[1]
    (out / entry.model_bin).write_bytes(b"truncated")
    assert regroup.write_group(regrouped.fine, regrouped.manifest, GROUPS, 1, out) == entry
    verify_files(out, read_manifest(out), stages=[1])


def test_one_stage_group_links_the_fine_files(regrouped: Regrouped, tmp_path: Path) -> None:
    """A group of one fine stage is that stage's files under the group's names, linked, not saved again."""
    fine = regrouped.manifest.stages[4]
    entry = regroup.write_group(regrouped.fine, regrouped.manifest, [[0, 1, 2, 3], [4]], 1, tmp_path)
    assert entry.stage == dataclasses.replace(fine.stage, index=1, num_stages=2)
    assert entry.sha256 == {"stage_1.xml": fine.sha256[fine.model_xml], "stage_1.bin": fine.sha256[fine.model_bin]}
    assert os.path.samefile(tmp_path / "stage_1.bin", regrouped.fine / fine.model_bin)
    assert (entry.inputs, entry.outputs, entry.state_variables) == (fine.inputs, fine.outputs, fine.state_variables)


def test_node_with_its_group_only_serves_it(regrouped: Regrouped, tmp_path: Path) -> None:
    """A node that wrote only its own group holds a bundle of the same fingerprint that StageWorker serves."""
    node = tmp_path / "node1"
    regroup.write_group(regrouped.fine, regrouped.manifest, GROUPS, 1, node)
    regroup.write_group_bundle(regrouped.fine, regrouped.manifest, GROUPS, regrouped.entries, node)
    assert not (node / "stage_0.xml").exists()
    assert bundle_fingerprint(node) == bundle_fingerprint(regrouped.out)
    worker = StageWorker(node, 1, cache_dir=tmp_path / "ov_cache")
    assert worker.backend.last and worker.backend.entry == regrouped.entries[1]
    with pytest.raises(BundleError, match="stage_0.xml is missing"):
        StageWorker(node, 0, cache_dir=tmp_path / "ov_cache")
