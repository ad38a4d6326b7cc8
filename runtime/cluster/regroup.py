"""Regroup a fine-grained bundle into fewer stages, at the IR level, on the node that runs them.

A bundle compiled with many small stages (``--stages N``, down to one a layer) lets the cluster decide
late which consecutive stages each machine runs. A machine runs its *group* of consecutive fine stages
as one OpenVINO model: :func:`merge_models` joins the fine IRs, :func:`write_group` saves the group
under the name a compile gives stage ``g`` of ``len(groups)``, and :func:`write_group_bundle` writes
the regrouped ``manifest.json`` (:func:`group_manifest`) beside it with the fine bundle's shared files,
so that the folder is a bundle ``StageWorker(out, g)`` serves.

The join, fine stage k into k+1: k+1's ``hidden_states`` Parameter is replaced by k's activation
(model output 0) and its ``attention_mask``, ``position_ids`` and ``beam_idx`` by the group's first
stage's; every Assign (the KV-cache state) of every stage stays; the results are the last stage's.
Joined tensors lose their names: a middle stage's output is named ``hidden_states`` like its input,
and OpenVINO would otherwise rename one of them on the next read (to ``hidden_states_1``). The group's
output is then named as a compile names it (``hidden_states``, or ``logits`` in the last group), so
the saved IR reads back with the tensor names a direct compile of the same split has. Each fine stage
computes its own attention mask and rotary angles from the shared inputs, so a group holds one copy
per fine stage: the serializer writes identical constants (the rotary tables) once in the .bin, and
the CPU plugin merges the duplicate subgraphs (stories260K's merged group compiles to the same runtime
ops as a direct compile of the same layers), so they are left as they are.

Every node must write the same manifest (its sha256 is the pipeline's fingerprint), so everything
here is a function of its inputs: the same fine files and the same OpenVINO version give the same
bytes. A restarted node finds its group's files by a stamp written beside them last (``.<stem>.regroup
.json``: what they were built from and their sha256) and does not build them again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openvino as ov

from ovshard.bundle import names, schema
from ovshard.bundle.manifest import (
    Manifest,
    StageEntry,
    TensorSpec,
    sha256_file,
    shared_files,
    verify_files,
)
from ovshard.bundle.plan import PartitionPlan, StagePlan
from ovshard.bundle.stage import StageSpec
from ovshard.bundle.staging import place, write_text
from ovshard.errors import BundleError

__all__ = ["STRATEGY", "check_groups", "group_manifest", "group_spec", "merge_models", "write_group",
           "write_group_bundle"]

log = logging.getLogger(__name__)

STRATEGY = "regrouped"  # the regrouped plan's strategy: its stages are groups of a finer plan's
_SHARED_INPUTS = (names.ATTENTION_MASK, names.POSITION_IDS, names.BEAM_IDX)  # every stage's, from the first
_STAMP_VERSION = 1  # what a stamp records; a stamp of another version is not trusted
_COUNTED = re.compile(r"_\d")  # OpenVINO's default "<Type>_<counter>" and names built on one


def check_groups(manifest: Manifest, groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """``groups`` as tuples; BundleError unless they are consecutive fine stages covering 0..N-1 in order."""
    n = manifest.num_stages
    flat = [i for group in groups for i in group]
    if not groups or any(len(group) == 0 for group in groups) or flat != list(range(n)):
        raise BundleError(f"groups {[list(g) for g in groups]} do not split the bundle's {n} stages: expected "
                          f"non-empty runs of consecutive stages that cover 0..{n - 1} in order, e.g. "
                          f"{[list(range(n // 2)), list(range(n // 2, n))] if n > 1 else [[0]]}")
    return tuple(tuple(group) for group in groups)


def group_spec(manifest: Manifest, groups: Sequence[Sequence[int]], g: int) -> StageSpec:
    """Group ``g`` as a stage of the regrouped bundle: its index, the group count, its layers."""
    checked = check_groups(manifest, groups)
    if not 0 <= g < len(checked):
        raise BundleError(f"group {g} does not exist: there are groups 0..{len(checked) - 1}")
    plan = manifest.plan.stages
    return StageSpec(g, len(checked), plan[checked[g][0]].stage.start, plan[checked[g][-1]].stage.end)


# ----- the model -----
def merge_models(core: ov.Core, bundle: Path, manifest: Manifest, parts: Sequence[int]) -> ov.Model:
    """The consecutive fine stages ``parts`` of ``bundle`` as one model (one part: that stage's model).

    Its inputs are the first part's, its output the last part's, named ``logits`` or ``hidden_states``
    as a compile names it; it keeps every part's state. The files are not checked here (write_group does).
    """
    entries = [_entry(manifest, i) for i in _consecutive(manifest, parts)]
    models = [core.read_model(Path(bundle) / e.model_xml) for e in entries]
    if len(models) == 1:
        return models[0]
    _check_state_ids(models, parts)
    first = models[0]
    inputs = {p.output(0).get_any_name(): p for p in first.get_parameters()}
    sinks = list(first.get_sinks())
    for k in range(1, len(models)):
        _join(models[k - 1], models[k], parts[k], inputs)
        sinks.extend(models[k].get_sinks())
    merged = ov.Model(list(models[-1].get_results()), sinks, list(first.get_parameters()),
                      first.get_friendly_name())
    last = parts[-1] == manifest.num_stages - 1
    merged.output(0).get_tensor().set_names({names.LOGITS if last else names.HIDDEN_STATES})
    _unique_names(merged)
    return merged


def _consecutive(manifest: Manifest, parts: Sequence[int]) -> list[int]:
    parts = list(parts)
    n = manifest.num_stages
    if not parts or any(not 0 <= i < n for i in parts):
        raise BundleError(f"parts {parts}: expected one or more stages of the bundle's 0..{n - 1}")
    for a, b in zip(parts, parts[1:], strict=False):
        if b != a + 1:
            raise BundleError(f"parts {parts} are not consecutive: stage {b} follows stage {a}; a group runs "
                              f"stages one after another, e.g. {list(range(parts[0], parts[0] + len(parts)))}")
    return parts


def _entry(manifest: Manifest, index: int) -> StageEntry:
    for entry in manifest.stages:
        if entry.index == index:
            return entry
    raise BundleError(f"the manifest holds no entry for stage {index} ({manifest.describe_held()}); "
                      "regroup a complete bundle")


def _check_state_ids(models: list[ov.Model], parts: Sequence[int]) -> None:
    """BundleError if two parts keep a state under one variable id (each layer's ids must be its own)."""
    owner: dict[str, int] = {}
    for part, model in zip(parts, models, strict=True):
        for variable in model.get_variables():
            vid = variable.get_info().variable_id
            if vid in owner:
                raise BundleError(f"stages {owner[vid]} and {part} both keep the state variable {vid!r}: one model "
                                  "cannot hold both; expected ids with global layer indices "
                                  f"({names.past_key(0)!r}, ...): recompile the bundle with this ovshard")
            owner[vid] = part


def _join(prev: ov.Model, model: ov.Model, part: int, inputs: dict[str, ov.Node]) -> None:
    """Feed ``model`` (stage ``part``) from ``prev``'s activation and the group's shared inputs."""
    if len(prev.outputs) != 1:
        raise BundleError(f"stage {part - 1} has {len(prev.outputs)} outputs; a stage before the last of a "
                          "group must have one, its activation")
    activation = prev.get_results()[0].input_value(0)
    for param in model.get_parameters():
        name = param.output(0).get_any_name()
        if name == names.HIDDEN_STATES:
            _check_fits(activation, param, part)
            param.output(0).replace(activation)
        elif name in _SHARED_INPUTS and name in inputs:
            param.output(0).replace(inputs[name].output(0))
        else:
            raise BundleError(f"stage {part} has an input {name!r} that the group's first stage cannot feed; "
                              f"expected {names.HIDDEN_STATES!r} and {', '.join(map(repr, _SHARED_INPUTS))}")
    # Now an inner tensor, it would clash with the group's input. Cleared after the replace, which adds the
    # replaced Parameter's names (hidden_states) to the activation's.
    activation.get_tensor().set_names(set())


def _check_fits(activation: ov.Output, param: ov.Node, part: int) -> None:
    given, taken = activation.get_partial_shape(), param.get_output_partial_shape(0)
    if activation.get_element_type() != param.get_output_element_type(0) or not given.compatible(taken):
        raise BundleError(f"stage {part - 1} gives {activation.get_element_type().get_type_name()}{given} but "
                          f"stage {part} takes {param.get_output_element_type(0).get_type_name()}{taken}: "
                          "the stages are from different compiles")


def _unique_names(model: ov.Model) -> None:
    """Rename a node whose counter-style name (``Assign_77``) an earlier node holds to ``<Type>_<position>``.

    Every fine stage numbered its nodes from 0, so the same names recur in each; the position in the
    merged graph's order makes them unique again, as a compile's are. Deliberate names stay.
    """
    ops = model.get_ordered_ops()
    taken = {op.get_friendly_name() for op in ops}
    seen: set[str] = set()
    for position, op in enumerate(ops):
        name = op.get_friendly_name()
        if name in seen and _COUNTED.search(name) and op.get_type_name() != "Parameter":
            name = f"{op.get_type_name()}_{position}"
            while name in taken:
                name += "_"
            op.set_friendly_name(name)
            taken.add(name)
        seen.add(name)


# ----- the manifest -----
def group_manifest(manifest: Manifest, groups: Sequence[Sequence[int]], entries: Sequence[StageEntry]) -> Manifest:
    """The manifest of the regrouped bundle: the fine one's contract, a plan of the groups, ``entries``."""
    checked = check_groups(manifest, groups)
    if len(entries) != len(checked):
        raise BundleError(f"{len(entries)} stage entries for {len(checked)} groups; expected one a group, in order")
    for g, entry in enumerate(entries):
        expected = group_spec(manifest, checked, g)
        if entry.stage != expected:
            raise BundleError(f"entry {g} is {entry.stage} of {entry.stage.num_stages}; expected {expected} of "
                              f"{expected.num_stages}: give write_group's entries for these groups, in order")
    group_of = {i: g for g, group in enumerate(checked) for i in group}
    try:
        pass_log = tuple(dataclasses.replace(r, stage=group_of[r.stage]) for r in manifest.pass_log)
    except KeyError as e:
        raise BundleError(f"the pass log names stage {e}, which the bundle does not have; recompile it") from e
    return dataclasses.replace(manifest, plan=_group_plan(manifest, checked), stages=tuple(entries),
                               pass_log=pass_log, dumps=None)  # the dumps are of the fine stages


def _group_plan(manifest: Manifest, groups: tuple[tuple[int, ...], ...]) -> PartitionPlan:
    rows = manifest.plan.stages
    planned = []
    for g, group in enumerate(groups):
        fine = [rows[i] for i in group]
        planned.append(StagePlan(
            stage=group_spec(manifest, groups, g),
            weight_bytes=sum(s.weight_bytes for s in fine),
            kv_bytes_per_token=sum(s.kv_bytes_per_token for s in fine),
            memory_bytes=sum(s.memory_bytes for s in fine),
            budget_bytes=None,
            activation_bytes_in=fine[0].activation_bytes_in,
        ))
    return PartitionPlan(STRATEGY, manifest.plan.context_tokens, tuple(planned))


# ----- the files -----
def write_group(bundle: Path, manifest: Manifest, groups: Sequence[Sequence[int]], g: int, out: Path,
                core: ov.Core | None = None) -> StageEntry:
    """Write group ``g`` into ``out`` as stage ``g`` of ``len(groups)``; return its entry.

    The fine stages' files are checked against their sha256 first. Nothing is built (or checked) when
    ``out`` already holds the group's files as a previous call left them, by its stamp.
    """
    bundle, out = Path(bundle), Path(out)
    _check_apart(bundle, out)
    spec = group_spec(manifest, groups, g)
    parts = check_groups(manifest, groups)[g]
    key = _stamp_key(manifest, parts, spec)
    xml = names.stage_xml(spec.index, spec.num_stages)
    reused = _reused(out, xml, key)
    if reused is not None:
        log.info("group %d: %s in %s is up to date", g, xml, out)
        return reused
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    verify_files(bundle, manifest, stages=list(parts))
    fine = [_entry(manifest, i) for i in parts]
    if len(parts) == 1:
        entry = _link_stage(bundle, fine[0], spec, out)
    else:
        entry = _save_group(merge_models(core or ov.Core(), bundle, manifest, parts), fine, spec, out)
    write_text(out / _stamp_name(xml), json.dumps({"key": key, "entry": schema.encode(entry)}, indent=2))
    log.info("group %d: stages %s as %s in %.1f s", g, list(parts), xml, time.perf_counter() - start)
    return entry


def _check_apart(bundle: Path, out: Path) -> None:
    if out.resolve() == bundle.resolve():
        raise BundleError(f"{out} is the fine bundle itself; write the regrouped bundle to another folder")


def _link_stage(bundle: Path, fine: StageEntry, spec: StageSpec, out: Path) -> StageEntry:
    """A one-stage group: the fine files under the group's names (hard-linked, or copied)."""
    xml = names.stage_xml(spec.index, spec.num_stages)
    binary = _bin_name(xml)
    place(bundle / fine.model_xml, out / xml)
    place(bundle / fine.model_bin, out / binary)
    sha = {xml: fine.sha256[fine.model_xml], binary: fine.sha256[fine.model_bin]}
    return dataclasses.replace(fine, stage=spec, model_xml=xml, model_bin=binary, sha256=sha)


def _save_group(model: ov.Model, fine: list[StageEntry], spec: StageSpec, out: Path) -> StageEntry:
    """Save ``model`` under temporary names, read its I/O back as every reader sees it, move it in place."""
    xml = names.stage_xml(spec.index, spec.num_stages)
    binary = _bin_name(xml)
    tmp_xml = out / f".{Path(xml).stem}.{os.getpid()}.partial.xml"
    tmp_bin = out / _bin_name(tmp_xml.name)  # save_model names the .bin after the .xml
    try:
        ov.save_model(model, tmp_xml, compress_to_fp16=False)
        del model
        saved = ov.Core().read_model(tmp_xml)  # the names after the reader's de-duplication, as in a compile
        inputs, outputs = TensorSpec.of_ports(saved.inputs), TensorSpec.of_ports(saved.outputs)
        del saved
        sha = {xml: sha256_file(tmp_xml), binary: sha256_file(tmp_bin)}
        os.replace(tmp_bin, out / binary)
        os.replace(tmp_xml, out / xml)
    finally:
        tmp_xml.unlink(missing_ok=True)
        tmp_bin.unlink(missing_ok=True)
    return StageEntry(stage=spec, model_xml=xml, model_bin=binary, sha256=sha, inputs=inputs, outputs=outputs,
                      state_variables=tuple(v for e in fine for v in e.state_variables))


def _bin_name(xml: str) -> str:
    return str(Path(xml).with_suffix(".bin"))


def _stamp_name(xml: str) -> str:
    return f".{Path(xml).stem}.regroup.json"


def _stamp_key(manifest: Manifest, parts: Sequence[int], spec: StageSpec) -> dict[str, Any]:
    """What a group's files are a function of: the fine stages' files, the group, the writer."""
    return {"version": _STAMP_VERSION, "openvino": ov.get_version(), "stage": schema.encode(spec),
            "parts": [_entry(manifest, i).sha256 for i in parts]}


def _reused(out: Path, xml: str, key: dict[str, Any]) -> StageEntry | None:
    """The entry a previous call recorded, if it was built from ``key`` and its files are still intact."""
    stamp = out / _stamp_name(xml)
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(recorded, dict) or recorded.get("key") != key:
        return None
    try:
        entry: StageEntry = schema.decode(StageEntry, recorded.get("entry"), str(stamp))
    except BundleError:
        return None
    for name, expected in entry.sha256.items():
        if not (out / name).is_file() or sha256_file(out / name) != expected:
            log.info("%s: %s changed since it was written; writing the group again", out, name)
            return None
    return entry


def write_group_bundle(bundle: Path, manifest: Manifest, groups: Sequence[Sequence[int]],
                       entries: Sequence[StageEntry], out: Path) -> Manifest:
    """Make ``out`` a regrouped bundle: the fine bundle's shared files and the manifest; return the manifest.

    The groups' own files come from :func:`write_group`; a node needs only its own there. A shared file
    the fine bundle lacks (a node given only its stages' files) is left out with a warning: serving a
    stage does not read it, and ``verify_files`` of a stage checks only that stage's files.
    """
    bundle, out = Path(bundle), Path(out)
    _check_apart(bundle, out)
    regrouped = group_manifest(manifest, groups, entries)
    out.mkdir(parents=True, exist_ok=True)
    for name in shared_files(regrouped):
        if (bundle / name).is_file():
            place(bundle / name, out / name)
        else:
            log.warning("%s is not in %s; the regrouped bundle %s goes without it", name, bundle, out)
    write_text(out / names.MANIFEST_FILE, regrouped.to_json())  # last: a manifest means a bundle
    return regrouped


