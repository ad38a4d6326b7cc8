"""Per-node compiles (`--only-stage K`) merged with `ovshard bundle merge` equal a one-shot compile.

The stage IR is byte-identical between the two routes, XML and BIN, for the default int4_sym (here,
the parts compiled in this process after the one-shot bundle) and for fp32 (the CLI test, each part in
its own process): ``ovshard.ir.naming`` renames OpenVINO's counter-based default names before every
save, so the XML no longer depends on what the process built before; the tokenizer files match too.
The manifests differ only in what differs by nature between runs: the pass log's seconds (and, when
the nodes keep their checkpoint copies elsewhere, ``source.path``; here every part reads one path).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from conftest import compile_fp32, run_greedy

from ovshard.bundle.manifest import Manifest, read_manifest, read_part_manifest
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.errors import BundleError, PlanError
from ovshard.ir.naming import stable_names
from ovshard.merge import merge_bundles
from ovshard.passes import WeightFormat

pytestmark = pytest.mark.slow


STAGES = 2
OVSHARD = [sys.executable, "-m", "ovshard.cli"]


@dataclasses.dataclass(frozen=True)
class Routes:
    one_shot: Path
    parts: list[Path]
    merged: Path


@pytest.fixture(scope="module")
def routes(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Routes:
    """stories260K in two default INT4 stages: compiled at once, and as two parts merged."""
    root = tmp_path_factory.mktemp("merge")
    one_shot = compile_int4(stories, root / "one", stages=STAGES)
    parts = [compile_int4(stories, root / f"part{k}", stages=STAGES, only_stage=k) for k in range(STAGES)]
    merge_bundles(parts, root / "merged")
    return Routes(one_shot, parts, root / "merged")


def compile_int4(checkpoint: Path, output: Path, **kwargs) -> Path:
    """Compile with the default weight format (INT4); kwargs go to CompileConfig."""
    compile_bundle(CompileConfig(checkpoint, output, **kwargs))
    return output


def bundle_files(m: Manifest) -> list[str]:
    """Every file the manifest names: the stages' IR, the tokenizer, the copied configs."""
    found = [f for e in m.stages for f in e.sha256]
    return found + sorted(m.extra_files) + (sorted(m.tokenizer.sha256) if m.tokenizer else [])


def without_seconds(m: Manifest) -> Manifest:
    return dataclasses.replace(m, pass_log=tuple(dataclasses.replace(r, seconds=0.0) for r in m.pass_log))


def assert_same_files(a: Path, b: Path) -> None:
    files = bundle_files(read_manifest(a))
    assert files == bundle_files(read_manifest(b))
    differ = [f for f in files if (a / f).read_bytes() != (b / f).read_bytes()]
    assert differ == [], f"{differ} differ between {a} and {b}"


def refusal(parts: list[Path], output: Path) -> str:
    with pytest.raises(BundleError) as info:
        merge_bundles(parts, output)
    assert not output.exists()
    assert list(output.parent.glob(f".{output.name}.*")) == []  # no partial folder left behind
    return str(info.value)


def test_merged_files_equal_a_one_shot_compile_byte_for_byte(routes: Routes) -> None:
    """Every stage XML and BIN, the tokenizer and the configs of the merged bundle equal the one-shot ones."""
    assert_same_files(routes.one_shot, routes.merged)


def test_merged_manifest_equals_the_one_shot_one_but_for_pass_seconds(routes: Routes) -> None:
    """The merged manifest is the one-shot manifest, pass timings aside, and lists the passes in stage order."""
    merged, one_shot = read_manifest(routes.merged), read_manifest(routes.one_shot)
    assert without_seconds(merged) == without_seconds(one_shot)


def test_merged_bundle_generates_the_one_shot_tokens(routes: Routes) -> None:
    """LocalPipeline's greedy tokens from the merged bundle equal those from the one-shot bundle."""
    prompt = [1, 403, 407, 261, 378]
    assert run_greedy(routes.merged, prompt, 16)[0] == run_greedy(routes.one_shot, prompt, 16)[0]


def test_a_part_holds_its_stage_and_the_whole_plan(routes: Routes) -> None:
    """A part's manifest has the full plan and fingerprint but only its own stage's entry and pass log."""
    part, one_shot = read_part_manifest(routes.parts[1]), read_manifest(routes.one_shot)
    assert (part.plan, part.source, part.complete) == (one_shot.plan, one_shot.source, False)
    assert [e.index for e in part.stages] == [1] and {r.stage for r in part.pass_log} == {1}


def test_read_manifest_refuses_a_part(routes: Routes) -> None:
    """Whatever runs a bundle refuses a part, saying which stage it holds and to merge the parts."""
    with pytest.raises(BundleError, match=r"holds only stage 1 of 2.*`ovshard bundle merge"):
        read_manifest(routes.parts[1])


def test_a_missing_stage_is_refused(routes: Routes, tmp_path: Path) -> None:
    """Stage 0's part alone is refused, naming the missing stage and how to compile it."""
    said = refusal([routes.parts[0]], tmp_path / "out")
    assert "stage 1 is missing: compile it with" in said and "--only-stage 1" in said


def test_a_stage_given_twice_is_refused(routes: Routes, tmp_path: Path) -> None:
    """Stage 1 in two parts (here a part and the complete bundle) is refused, naming both."""
    said = refusal([routes.parts[1], routes.one_shot], tmp_path / "out")
    assert f"stage 1 is in 2 parts ({routes.parts[1]}, {routes.one_shot})" in said


def test_a_complete_bundle_is_a_valid_part(routes: Routes, tmp_path: Path) -> None:
    """A complete bundle given alone merges into a copy of itself."""
    merge_bundles([routes.one_shot], tmp_path / "copy")
    assert_same_files(routes.one_shot, tmp_path / "copy")


def test_parts_of_different_plans_are_refused(routes: Routes, stories: Path, tmp_path: Path) -> None:
    """Stage 2 of a 3-stage plan does not merge with the stages of a 2-stage plan."""
    other = compile_int4(stories, tmp_path / "three", stages=3, only_stage=2)
    said = refusal([*routes.parts, other], tmp_path / "out")
    assert "disagree on the plan" in said and "[0, 2) [2, 4) [4, 5)" in said and "--stages" in said


def test_parts_of_different_checkpoints_are_refused(routes: Routes, stories: Path, tmp_path: Path) -> None:
    """A part compiled from another checkpoint (another config.json, same weights) is refused."""
    other = tmp_path / "other-ckpt"
    other.mkdir()
    for f in stories.iterdir():
        if f.name != "config.json":
            (other / f.name).symlink_to(f)  # the same files, not copies: only config.json differs
    config = json.loads((stories / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "initializer_range": 0.03}, indent=2))
    part = compile_int4(other, tmp_path / "part1", stages=STAGES, only_stage=1)
    said = refusal([routes.parts[0], part], tmp_path / "out")
    assert "disagree on the source fingerprint" in said and "same checkpoint" in said


def test_a_corrupted_file_is_refused(routes: Routes, tmp_path: Path) -> None:
    """A part whose stage BIN no longer matches its sha256 is refused, naming the file; nothing is written."""
    broken = Path(shutil.copytree(routes.parts[1], tmp_path / "part1"))
    data = bytearray((broken / "stage_1.bin").read_bytes())
    data[100] ^= 0xFF
    (broken / "stage_1.bin").write_bytes(bytes(data))
    said = refusal([routes.parts[0], broken], tmp_path / "out")
    assert f"cannot merge part {broken}" in said and "stage_1.bin has sha256" in said


def test_only_stage_out_of_range_is_refused(stories: Path, tmp_path: Path) -> None:
    """--only-stage beyond the plan is refused naming the stages it has, before anything is written."""
    config = CompileConfig(stories, tmp_path / "out", stages=STAGES, only_stage=2, weights=WeightFormat("fp32"))
    with pytest.raises(PlanError, match=r"--only-stage 2 .* stages 0\.\.1"):
        compile_bundle(config)
    assert list(tmp_path.iterdir()) == []


def test_stable_names_make_the_xml_independent_of_what_was_built_before(tmp_path: Path) -> None:
    """The same graph built before and after other nodes saves to identical XML; Parameters keep their names."""
    def build() -> ov.Model:
        x = ov.opset13.parameter([2, 3], ov.Type.f32, name="hidden_states")
        y = ov.opset13.multiply(ov.opset13.relu(x), ov.opset13.constant(np.float32(2.0)))
        return ov.Model([ov.opset13.result(y)], [x], "stage_0")

    first = build()
    ov.opset13.relu(ov.opset13.parameter([1], ov.Type.f32))  # advances OpenVINO's node counter
    second = build()
    for k, model in enumerate((first, second)):
        assert stable_names(model) > 0 and stable_names(model) == 0  # a second run changes nothing
        ov.save_model(model, tmp_path / f"{k}.xml")
    assert (tmp_path / "0.xml").read_bytes() == (tmp_path / "1.xml").read_bytes()
    assert first.get_parameters()[0].get_friendly_name() == "hidden_states"


def test_cli_parts_in_their_own_processes_merge_into_the_one_shot_fp32_bundle(stories: Path, tmp_path: Path) -> None:
    """`compile --only-stage` in separate processes (fp32), then `bundle merge`, exit 0 with no traceback
    and give the files of a one-shot compile, byte for byte."""
    def ovshard(*args: str | Path) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*OVSHARD, *map(str, args)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, check=False, env=dict(os.environ))
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        return done

    parts = [tmp_path / "part0", tmp_path / "part1"]
    for k, part in enumerate(parts):
        compiled = ovshard("compile", stories, "--stages", "2", "--weights", "fp32", "--only-stage", k, "-o", part)
        assert f"a part holding stage {k} of 2" in compiled.stdout
    merged = ovshard("bundle", "merge", *parts, "-o", tmp_path / "merged")
    assert "2 stages" in merged.stdout and "part holding" not in merged.stdout
    compile_fp32(stories, tmp_path / "one", stages=2)  # in this process
    assert_same_files(tmp_path / "one", tmp_path / "merged")
