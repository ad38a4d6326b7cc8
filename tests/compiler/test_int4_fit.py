"""ovshard's own INT4 scale fit: the vectorised fit against a direct one, and what the default compile gains with it.

The fit (``ovshard.frontend.int4_fit``) chooses, for every group of a weight at once, the scale with the least
output error on the calibration inputs' second moments; here a loop over rows and groups computes the same
choice one group at a time, in float64. On the real stories260K, the default (calibrated) compile's outputs
are closer to the float32 model's than the data-free compile's, and the compile reports its progress and a
JSON summary, with no library warnings on stderr. A weight whose inputs were not caught is a clear error, and a
calibrated build reads each layer's weights from the checkpoint once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ovshard.frontend import int4_fit, onednn
from ovshard.frontend.source import open_source


def _direct(weight: np.ndarray, inputs: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The fit one row and group at a time, in float64: codes, scales, and each group's error ``d^T H d``."""
    out_features, width = weight.shape
    groups = width // group
    codes = np.zeros((out_features, groups, group), np.int8)
    scales = np.zeros((out_features, groups, 1), np.float16)
    errors = np.zeros((out_features, groups))
    for g in range(groups):
        x = inputs[:, g * group:(g + 1) * group].astype(np.float64)
        h = x.T @ x / len(x)
        for r in range(out_features):
            w = weight[r, g * group:(g + 1) * group].astype(np.float64)
            best = None
            s = _as_stored(-w[np.argmax(np.abs(w))] / 8)  # signed min-max: the weight of largest magnitude -> -8
            q = np.clip(np.round(w / s), -8, 7)
            for step in range(int4_fit.ROUNDS + 1):
                qhq = q @ h @ q
                refit = _as_stored((q @ h @ w) / qhq) if qhq > 0 else s
                for cand in (s, refit):
                    d = w - cand * q
                    err = d @ h @ d
                    if best is None or err < best[0]:
                        best = (err, cand, q)
                if step < int4_fit.ROUNDS:
                    s, q = refit, np.clip(np.round(w / refit), -8, 7)
            assert best is not None
            errors[r, g], scales[r, g, 0], codes[r, g] = best[0], best[1], best[2]
    return codes, scales, errors


def _as_stored(scale: float) -> float:
    s = float(np.float16(scale))
    return s if abs(s) >= np.finfo(np.float16).tiny else float(np.finfo(np.float16).tiny)


def _errors(weight: np.ndarray, inputs: np.ndarray, codes: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    out_features, width = weight.shape
    d = (weight.astype(np.float64).reshape(out_features, -1, group) - codes * scales.astype(np.float64))
    x = inputs.astype(np.float64).reshape(len(inputs), -1, group)
    return np.einsum("rgi,tgi->rgt", d, x).__pow__(2).mean(-1)  # [rows, groups]: d^T H d


def test_the_vectorised_fit_matches_a_direct_one_group_at_a_time() -> None:
    """Every group gets the direct fit's choice (or one of equal error), and never more error than min-max."""
    rng = np.random.default_rng(0)
    group, out_features, width = 32, 40, 128
    weight = (rng.standard_normal((out_features, width)) * 0.05).astype(np.float32)
    weight[3, 5] = 0.9  # an outlier
    weight[7, 32:64] = 0.0  # a group of zeros: codes 0
    inputs = (rng.standard_normal((256, width)) * rng.uniform(0.1, 3.0, width)).astype(np.float32)  # uneven channels
    codes, scales = int4_fit.fit(torch.from_numpy(weight), int4_fit.second_moments(torch.from_numpy(inputs), group))
    codes, scales = codes.numpy(), scales.numpy()
    ref_codes, ref_scales, ref_errors = _direct(weight, inputs, group)
    assert codes.dtype == np.int8 and codes.min() >= -8 and codes.max() <= 7 and scales.dtype == np.float16
    errors = _errors(weight, inputs, codes, scales, group)
    same = (codes == ref_codes).all(-1) & (scales == ref_scales)[..., 0]
    assert same.mean() > 0.97, same.mean()
    assert np.all(errors <= ref_errors * (1 + 1e-4) + 1e-12), np.max(errors - ref_errors)
    assert (codes[7, 1] == 0).all()
    grouped = weight.reshape(out_features, -1, group)
    extreme = np.take_along_axis(grouped, np.abs(grouped).argmax(-1)[..., None], -1)
    minmax = np.vectorize(_as_stored)(-extreme / 8).astype(np.float16)  # NNCF's data-free symmetric INT4
    plain = np.clip(np.round(grouped / minmax.astype(np.float32)), -8, 7).astype(np.int8)
    assert np.all(errors <= _errors(weight, inputs, plain, minmax, group) * (1 + 1e-4) + 1e-12)


@pytest.mark.slow
def test_the_default_compile_errs_less_than_data_free_and_reports_its_progress(stories: Path, tmp_path: Path) -> None:
    """On the real stories260K with every decoder weight INT4: the default (calibrated) bundle's logits are closer to
    float32's than the data-free bundle's; each layer piece logs one progress line; --json prints the summary."""
    from ovshard.runtime.client.inprocess import LocalPipeline
    from ovshard.runtime.engine.stage import EXACT_HINTS

    story = Path(__file__).parents[2] / "bench" / "texts" / "story.txt"
    runs = {}
    for name, flags in (("fp32", ["--weights", "fp32"]), ("free", ["--budget", "1.0", "--calibration", "none"]),
                        ("default", ["--budget", "1.0"])):
        done = subprocess.run([sys.executable, "-m", "ovshard.cli", "compile", str(stories), "-o", str(tmp_path / name),
                               "--stages", "2", "--no-cache", "--json", *flags], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[name] = (json.loads(done.stdout), done.stderr)
    summary, stderr = runs["default"]
    assert summary["bundle"] == str((tmp_path / "default").resolve()) and summary["stages"] == 2
    assert summary["layers"] == 5 and summary["seconds_per_layer"] > 0 and summary["peak_rss_bytes"] > 0
    assert 4.0 < summary["bits_per_parameter"] < 8.0 and "methods=scale_fit, calibration=text" in summary["weights"]
    lines = [line for line in stderr.splitlines() if " done in " in line and " of 5 layers, " in line]
    assert [line.split("; ")[1].split(",")[0] for line in lines] == [f"{k} of 5 layers" for k in range(1, 6)], stderr
    assert all(" s a layer, about " in line and " s left, peak " in line for line in lines), lines
    assert "0 s left" in lines[-1]
    ids = [1] + [int(t) for t in np.random.default_rng(0).integers(3, 500, 95)]
    text_ids = _story_ids(stories, story)[:96]
    logits: dict[str, list[np.ndarray]] = {}
    for name in ("fp32", "free", "default"):
        pipe = LocalPipeline(tmp_path / name, config=EXACT_HINTS)
        logits[name] = []
        for chunk in (ids, text_ids):
            pipe.reset()
            logits[name].append(pipe.forward(chunk)[0])
    for k in range(2):
        free = np.mean((logits["free"][k] - logits["fp32"][k]) ** 2)
        fitted = np.mean((logits["default"][k] - logits["fp32"][k]) ** 2)
        assert fitted < free, (k, fitted, free)


@pytest.mark.slow
def test_a_calibrated_compile_prints_no_library_warnings(stories: Path, tmp_path: Path) -> None:
    """The calibration text is longer than stories260K's tokenizer's 512 tokens and the fit reads the graph's
    read-only weights: neither transformers' sequence-length warning nor torch's non-writable-array one reaches
    the user."""
    done = subprocess.run([sys.executable, "-m", "ovshard.cli", "compile", str(stories), "-o", str(tmp_path / "b"),
                           "--no-cache", "--budget", "1.0"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "calibration: " in done.stderr and "sequence length is longer" not in done.stderr, done.stderr[-2000:]
    assert "not writable" not in done.stderr and "Warning" not in done.stderr, done.stderr[-2000:]


def _story_ids(stories: Path, story: Path) -> list[int]:
    from transformers import AutoTokenizer

    return [1, *AutoTokenizer.from_pretrained(stories)(story.read_text(), add_special_tokens=False)["input_ids"]]


def test_a_weight_whose_inputs_were_not_caught_is_a_clear_error(stories: Path, tmp_path: Path) -> None:
    """The fit of a weight its layer's float32 run did not read through F.linear says which, what was caught, and
    what to do, instead of a bare KeyError."""
    from ovshard.errors import PassError
    from ovshard.frontend.calibration import Activations, calibration_text

    ckpt = open_source(stories)
    activations = Activations(ckpt, calibration_text(ckpt, "text", 2, 32, tmp_path))
    with pytest.raises(PassError) as caught:
        activations.fit_int4("1.experts_gate", np.zeros((8, 64), np.float32), 32)
    message = str(caught.value)
    assert "layer 1's experts_gate weight" in message and "--calibration none" in message, message
    assert "inputs of down, gate, k, o, q, up, v" in message, message


@pytest.mark.skipif(not onednn.AVAILABLE, reason="this torch runs no float32 linear through oneDNN")
def test_a_layers_float32_run_multiplies_through_onednn_and_keeps_every_input(stories: Path, tmp_path: Path) -> None:
    """The calibration's float32 run of a layer sends its projections through oneDNN (MKL's sgemm, torch's default,
    runs its AVX2 code on AMD CPUs), still keeps every projection's inputs, and the fit reads those."""
    from ovshard.frontend.calibration import Activations, calibration_text

    ckpt = open_source(stories)
    activations = Activations(ckpt, calibration_text(ckpt, "text", 2, 32, tmp_path))
    weight = ckpt.load(ckpt.spec.q_proj.format(i=0) + ".weight").numpy()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        codes, scales = activations.fit_int4("0.q", weight, 32)
    calls = [event.name for event in profile.events()]  # the main thread's: the fit's workers are not profiled
    assert calls.count("mkldnn::_linear_pointwise") == 7, sorted(set(calls))  # q, k, v, o, gate, up, down
    assert sorted(activations.caught) == ["down", "gate", "k", "o", "q", "up", "v"]
    direct = int4_fit.fit(torch.from_numpy(weight), int4_fit.second_moments(activations.caught["q"], 32))
    assert np.array_equal(codes, direct[0].numpy()) and np.array_equal(scales, direct[1].numpy())


def test_a_calibrated_streamed_build_reads_each_layer_weight_once(stories: Path, tmp_path: Path) -> None:
    """The float32 weights a layer piece loads for its trace are lent to the calibration's run of that layer, so a
    calibrated streamed build reads each decoder tensor from the checkpoint once, not once more for the fit."""
    from collections import Counter

    from ovshard.bundle.stage import StageSpec
    from ovshard.bundle.weights import OWN_FIT, WeightFormat
    from ovshard.compile_config import CompileConfig
    from ovshard.frontend.calibration import Activations, calibration_text
    from ovshard.layerwise import StageBuild, build_stage

    ckpt = open_source(stories)
    config = CompileConfig(stories, tmp_path / "b", weights=WeightFormat(budget=1.0, methods=(OWN_FIT,)))
    activations = Activations(ckpt, calibration_text(ckpt, "text", 2, 32, tmp_path))
    build = StageBuild(ckpt, StageSpec(0, 1, 0, ckpt.dims.num_layers), config.passes(), [], 256, tmp_path / "scratch",
                       piece_bytes=1, calibration=activations)  # one layer a piece
    build_stage(build)
    reads = Counter(name for name in ckpt.loaded if ".layers." in name)
    assert len({name.split(".layers.")[1].split(".")[0] for name in reads}) == ckpt.dims.num_layers, reads
    assert set(reads.values()) == {1}, reads
    assert activations.caught_layer == ckpt.dims.num_layers - 1 and not activations.lent
