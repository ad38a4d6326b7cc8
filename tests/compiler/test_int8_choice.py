"""Which decoder weights an INT4 bundle keeps in INT8: in a calibrated compile, those whose INT4 copy errs most in
its output on the calibration text.

``ovshard.plan.precision`` scores a weight by ``||(W - Q(W)) X^T||^2 / ||W X^T||^2`` on its matmul's
calibration inputs ``X``; here that score against the formula computed directly, an error where no input
reaches counting for nothing, and the real stories260K's default compile keeping the weights this score
chooses (not the ones the weights alone rank first), the same at every stage count.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ovshard.bundle.manifest import read_manifest
from ovshard.bundle.weights import WeightFormat
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.frontend.calibration import Activations, calibration_text
from ovshard.frontend.source import open_source
from ovshard.plan.precision import SCORE_TOKENS, choose_int8, int4_error


def _restored(weight: np.ndarray, group: int) -> np.ndarray:
    """Symmetric min-max INT4 of ``weight`` in groups of ``group``, and back."""
    w = weight.reshape(weight.shape[0], -1, group)
    scale = np.abs(w).max(-1, keepdims=True) / 8.0
    return (np.clip(np.round(w / scale), -8, 7) * scale).reshape(weight.shape)


def test_the_output_error_is_the_matmuls_and_counts_only_inputs_that_reach_it() -> None:
    rng = np.random.default_rng(0)
    fmt = WeightFormat("int4_sym", group_size=32)
    weight = rng.standard_normal((16, 64)).astype(np.float32)
    inputs = rng.standard_normal((SCORE_TOKENS, 64)).astype(np.float32)
    lost = weight - _restored(weight, 32)
    direct = ((lost @ inputs.T) ** 2).sum() / ((weight @ inputs.T) ** 2).sum()
    assert int4_error(weight, fmt, torch.from_numpy(inputs)) == pytest.approx(direct, rel=1e-4)
    # the second group of inputs is always zero: however badly its weights quantize, the output loses nothing there
    inputs[:, 32:] = 0.0
    rough = weight.copy()
    rough[:, 32:] = rng.standard_normal((16, 32)).astype(np.float32) ** 3 * 50
    alone = int4_error(weight[:, :32].copy(), fmt, torch.from_numpy(inputs[:, :32].copy()))
    assert int4_error(rough, fmt, torch.from_numpy(inputs)) == pytest.approx(alone, rel=1e-4)
    assert int4_error(rough, fmt) > 1.5 * int4_error(weight, fmt)  # by the weights alone it looked worse


@pytest.mark.slow
def test_a_calibrated_compile_keeps_int8_the_weights_that_err_most_on_its_text(stories: Path, tmp_path: Path) -> None:
    """The default compile (calibrated on the shipped text) keeps the choice of the output error, which is not the
    weights-alone choice, and 1 and 2 stages keep the same one."""
    ckpt = open_source(stories)
    text = calibration_text(ckpt, "text", 8, 128, tmp_path / "scratch")
    fmt = WeightFormat()
    by_output = choose_int8(ckpt, fmt, Activations(ckpt, text).inputs_of)
    assert by_output and by_output != choose_int8(ckpt, fmt)
    for stages in (1, 2):
        compile_bundle(CompileConfig(stories, tmp_path / f"b{stages}", stages=stages, weights=fmt))
        weights = read_manifest(tmp_path / f"b{stages}").weights
        assert weights.calibration == "text" and weights.int8_weights == by_output, stages
