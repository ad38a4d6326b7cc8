"""``ovshard verify``: runtime-graph fusion checks, reference comparison, report and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from conftest import compile_fp32

from ovshard.bundle.manifest import read_manifest, sha256_file
from ovshard.cli import main
from ovshard.tools.synth import llama_config, write_checkpoint


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("verify") / "b", stages=2)


def verify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["-q", "verify", *argv])
    return code, capsys.readouterr().out


def test_cpu_runtime_graph_passes(capsys: pytest.CaptureFixture[str], bundle: Path) -> None:
    """A compiled bundle shows one fused SDPA per layer and no MatMul/Softmax on CPU: exit 0."""
    code, out = verify(capsys, str(bundle), "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"]
    fused = {r["stage"]: r["found"] for r in report["rows"] if r["check"].startswith("KV-fused SDPA")}
    assert fused == {0: "3", 1: "2"}


def test_reference_comparison_is_exact_for_fp32(capsys: pytest.CaptureFixture[str], stories: Path,
                                                bundle: Path) -> None:
    """--reference compares every stage boundary and the logits with HF (relative to their scale, <= 1e-5), and
    all greedy tokens, teacher-forced and free-running."""
    code, out = verify(capsys, str(bundle), "--device", "none", "--reference", str(stories), "--tokens", "16",
                       "--json")
    rows = json.loads(out)["rows"]
    assert code == 0
    checks = {r["check"]: r for r in rows}
    hidden = checks["max |diff| / max(1, max |ref|) hidden states after layer 3 (f32 hints)"]
    assert hidden["expected"] == "<= 1e-05" and float(hidden["found"]) <= 1e-5
    assert checks["free-running greedy tokens equal to the reference's"]["verdict"] == "pass"
    logits = next(r for r in rows if r["check"].startswith("max |diff| / max(1, max |ref|) logits (f32 hints"))
    assert logits["expected"] == "<= 1e-05" and float(logits["found"]) <= 1e-5
    assert checks["greedy top-1 agreement over 16 tokens"]["found"] == "100.0%"


def test_a_parting_counts_only_where_the_references_margin_beats_the_measured_error() -> None:
    """A top-2 margin within twice a step's logit error is a near-tie (the floats may order it either way);
    a wider one is a real parting."""
    from ovshard.verify.reference import _near_tie

    ref = np.array([5.0, 4.9999, 1.0])
    assert _near_tie(ref, ref + np.array([-1e-4, 1e-4, 0.0]))  # margin 1e-4 <= 2 x 1e-4: swapped by the error
    assert not _near_tie(ref, ref + np.array([-1e-5, 1e-5, 0.0]))  # the error cannot explain it
    assert not _near_tie(np.array([5.0, 3.0, 1.0]), np.array([5.5, 3.5, 1.5]))  # wide margin


def test_reference_mismatch_fails(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A bundle checked against a different checkpoint of the same shape fails with exit 1."""
    ours = write_checkpoint(tmp_path / "a", llama_config(), seed=1)
    other = write_checkpoint(tmp_path / "b", llama_config(), seed=2)
    compiled = compile_fp32(ours, tmp_path / "bundle", stages=2)
    code, out = verify(capsys, str(compiled), "--device", "none", "--reference", str(other), "--tokens", "8")
    assert code == 1
    failed = [line for line in out.splitlines() if line.rstrip().endswith("FAIL")]
    assert any("logits" in line for line in failed) and any("agreement" in line for line in failed)


def _remove_beam_gathers(bundle: Path) -> None:
    """Rewire every KV ReadValue straight to its readers (undoing InjectBeamIdxGatherPass) in stage 1."""
    m = read_manifest(bundle)
    entry = m.stages[1]
    model = ov.Core().read_model(str(bundle / entry.model_xml))
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Gather" and op.input_value(0).get_node().get_type_name() == "ReadValue":
            op.output(0).replace(op.input_value(0))
    model.remove_parameter([p for p in model.get_parameters() if "beam_idx" in p.output(0).get_names()][0])
    ov.save_model(model, bundle / "tmp.xml", compress_to_fp16=False)
    (bundle / "tmp.xml").replace(bundle / entry.model_xml)
    (bundle / "tmp.bin").replace(bundle / entry.model_bin)
    raw = json.loads((bundle / "manifest.json").read_text())
    raw["stages"][1]["sha256"] = {f: sha256_file(bundle / f) for f in (entry.model_xml, entry.model_bin)}
    (bundle / "manifest.json").write_text(json.dumps(raw))


def test_missing_beam_gather_fails_the_runtime_check(capsys: pytest.CaptureFixture[str], stories: Path,
                                                     tmp_path: Path) -> None:
    """Without the beam_idx Gather the CPU plugin does not fuse the KV cache: verify names the stage, exit 1."""
    broken = compile_fp32(stories, tmp_path / "b", stages=2)
    _remove_beam_gathers(broken)
    code, out = verify(capsys, str(broken), "--json")
    rows = json.loads(out)["rows"]
    assert code == 1
    failed = {(r["stage"], r["check"]) for r in rows if r["verdict"] == "FAIL"}
    assert (1, "KV-fused SDPA (beam_idx + 2 MemoryInput)") in failed
    assert not any(stage == 0 for stage, _ in failed)


def test_absent_device_is_skipped_with_a_reason(capsys: pytest.CaptureFixture[str], bundle: Path) -> None:
    """On a machine without an Intel GPU, --device GPU says so and skips instead of failing."""
    if "GPU" in ov.Core().available_devices:
        pytest.skip("this machine has a GPU; the skip path does not apply")
    code, out = verify(capsys, str(bundle), "--device", "GPU")
    assert code == 0
    assert "runtime graph on GPU" in out and "none here" in out and "skip" in out


def test_weight_storage_matches_the_manifest(capsys: pytest.CaptureFixture[str], stories: Path,
                                             tmp_path: Path) -> None:
    """An INT4 bundle's runtime graph stores i4 weights (u8 where INT8 is kept), as the manifest says."""
    from ovshard.compile import CompileConfig, compile_bundle

    compile_bundle(CompileConfig(stories, tmp_path / "b", stages=1))
    capsys.readouterr()  # NNCF's progress bar
    code, out = verify(capsys, str(tmp_path / "b"), "--json")
    row = [r for r in json.loads(out)["rows"] if r["check"] == "weight storage"][0]
    assert code == 0 and row["expected"] == "int4_sym: i4/i8/u8" and "i4" in row["found"]


def test_predict_needs_no_device_and_explains_a_failure(capsys: pytest.CaptureFixture[str], stories: Path,
                                                        tmp_path: Path) -> None:
    """--predict GPU,CPU checks the IR statically: a good bundle passes; a stage without the Gather fails
    with the condition named for each of its layers, on both devices."""
    good = compile_fp32(stories, tmp_path / "good", stages=2)
    code, out = verify(capsys, str(good), "--predict", "GPU,CPU", "--json")
    assert code == 0 and {r["check"] for r in json.loads(out)["rows"]} >= {
        "GPU fusion predicted (static)", "CPU fusion predicted (static)"}
    broken = compile_fp32(stories, tmp_path / "broken", stages=2)
    _remove_beam_gathers(broken)
    code, out = verify(capsys, str(broken), "--predict", "GPU,CPU", "--json")
    failed = [r for r in json.loads(out)["rows"] if r["verdict"] == "FAIL"]
    assert code == 1
    assert {r["stage"] for r in failed} == {1}
    assert any("layer 3" in r["check"] for r in failed) and any("layer 4" in r["check"] for r in failed)


def test_a_reference_held_past_its_end_of_text_is_no_parting(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    """transformers' generate() with min_new_tokens holds back an end-of-text token: an fp32 bundle whose greedy
    text ends there still passes, and the free-running row says why."""
    from ovshard.runtime.client.inprocess import LocalPipeline
    from ovshard.runtime.engine.stage import EXACT_HINTS

    checkpoint = write_checkpoint(tmp_path / "ckpt", llama_config(), seed=3)
    bundle = compile_fp32(checkpoint, tmp_path / "bundle", stages=2)
    start = read_manifest(bundle).generation.start_ids
    first = LocalPipeline(bundle, config=EXACT_HINTS).generate_greedy(start, 1)[0][0]
    for name in ("config.json", "generation_config.json"):  # the model's first greedy token ends its text
        raw = json.loads((checkpoint / name).read_text())
        raw["eos_token_id"] = first
        (checkpoint / name).write_text(json.dumps(raw))
    code, out = verify(capsys, str(bundle), "--device", "none", "--reference", str(checkpoint), "--tokens", "8",
                       "--json")
    rows = {r["check"]: r for r in json.loads(out)["rows"]}
    free = rows["free-running greedy tokens equal to the reference's"]
    assert code == 0 and free["verdict"] == "pass", free
    assert free["found"].startswith("0/8 identical") and "held past its own top-1" in free["found"], free
