"""``--weights int4_affine``: min-max INT4 groups with an f16 zero point (llama.cpp's Q4_1 form at group 32).

A weight made of Q4_1 blocks (each group ``m + d k``, ``k`` in [0, 15], ``d`` and ``m`` f16, as llama.cpp's
quantizer writes them: the block's minimum at code 0, its maximum at 15) comes back from the written graph, run
by the CPU plugin, within a small part of one step (the f16 rounding of the zero point): the format holds such a
source's weights as they are, where NNCF's 4-bit zero point moves every group by up to half a step. Calibration
is refused with a clear error: the format is data-free. A GGUF source whose decoder matrices are all Q4_1 gets
the format by default (all Q4_0: int4_sym in groups of 32, data-free, which holds those blocks as they are), and so
does a float checkpoint whose decoder matrices lie on those grids (a GGUF file dequantized and saved as safetensors).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from ovshard.bundle.weights import WeightFormat
from ovshard.errors import ConfigError
from ovshard.frontend.grids import grids_of
from ovshard.plan.precision import int4_bytes, int4_error
from passes.compress_weights import int4_affine_weight


def _q4_1(rng: np.random.Generator, out_features: int, in_features: int) -> np.ndarray:
    blocks = out_features * in_features // 32
    d = rng.uniform(0.002, 0.02, (blocks, 1)).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(4, 11, (blocks, 1))).astype(np.float16).astype(np.float32)
    k = rng.integers(0, 16, (blocks, 32))
    k[:, 0], k[:, 1] = 0, 15  # the quantizer's min and max
    return (m + d * k).astype(np.float32).reshape(out_features, in_features), d.reshape(out_features, -1)


def test_a_q4_1_weight_comes_back_within_a_small_part_of_a_step_on_the_cpu_plugin() -> None:
    rng = np.random.default_rng(0)
    out_features, in_features = 96, 256
    weight, step = _q4_1(rng, out_features, in_features)
    x = ops.parameter([-1, in_features], ov.Type.f32)
    stored = int4_affine_weight("w", weight.reshape(out_features, -1, 32), (out_features, in_features))
    compiled = ov.Core().compile_model(ov.Model([ops.matmul(x, stored, False, True)], [x]), "CPU",
                                       {"INFERENCE_PRECISION_HINT": "f32"})
    restored = compiled([np.eye(in_features, dtype=np.float32)])[0].T  # row r of W, column by column
    error = np.abs(restored - weight).reshape(out_features, -1, 32).max(-1)
    assert np.all(error <= 0.05 * step + 1e-7), (error / step).max()
    kinds = {op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ordered_ops()}
    assert "FullyConnected" in kinds  # the decompression was fused, not folded into an f32 weight
    fmt = WeightFormat("int4_affine", 32)
    assert int4_bytes(fmt, out_features, in_features) == out_features * (in_features * 0.5 + in_features / 32 * 4.0)
    assert int4_error(weight, fmt) < 1e-6  # the planner's error of the same min-max groups: all but nothing
    assert int4_error(weight, WeightFormat("int4_asym", 32)) > 1e-3  # a 4-bit zero point moves the groups


def test_int4_affine_is_data_free() -> None:
    with pytest.raises(ConfigError, match=r"--weights int4_affine: its groups are data-free min-max"):
        WeightFormat("int4_affine", 32, methods=("scale_estimation",))


@pytest.mark.parametrize(("qtype", "mode", "other"), [("Q4_1", "int4_affine", "int4_sym"),
                                                      ("Q4_0", "int4_sym", "int4_affine")])
def test_a_q4_gguf_keeps_its_blocks_by_default(tmp_path: Path, qtype: str, mode: str, other: str) -> None:
    """A tiny llama GGUF whose matrices are Q4_1 (Q4_0): the default compile (no --weights, --group-size or
    --budget) stores every decoder weight int4_affine (int4_sym) in groups of 32, data-free, and its logits are
    closer to the fp32 bundle's than those of the other format in the same groups; an explicit --weights keeps
    its format, and only that compile warns that the two quantizations' errors compound."""
    from dense_gguf import hf_weights, write_gguf

    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.client.inprocess import LocalPipeline
    from ovshard.runtime.engine.stage import EXACT_HINTS

    source = write_gguf(tmp_path / "q4.gguf", "llama", hf_weights("llama"), qtype=qtype)
    flags = {"fp32": ["--weights", "fp32"], "default": [],
             "other": ["--weights", other, "--group-size", "32", "--budget", "1.0", "--calibration", "none"]}
    logits = {}
    for name, extra in flags.items():
        done = subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "compile", str(source), "-o",
                               str(tmp_path / name), "--no-cache", *extra], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        # only a compile that compresses the source's blocks again in another form warns that the errors compound
        assert ("compounds the two quantization errors" in done.stderr) == (name == "other"), (name, done.stderr)
        pipe = LocalPipeline(tmp_path / name, config=EXACT_HINTS)
        logits[name] = pipe.forward([1, *range(3, 40)])[0]
    fmt = read_manifest(tmp_path / "default").weights
    assert (fmt.mode, fmt.group_size, fmt.budget, fmt.int8_weights, fmt.methods) == (mode, 32, 1.0, (), ())
    assert fmt.calibration == "none" and read_manifest(tmp_path / "other").weights.mode == other
    errors = {name: float(np.mean((logits[name] - logits["fp32"]) ** 2)) for name in ("default", "other")}
    assert errors["default"] < 0.5 * errors["other"], errors
    # the runtime graph stores what the format promises: Q4_1's f16 zero points split (signed codes, a MatMul of
    # group sums: SplitZeroPointsPass), Q4_0's signed groups as they were
    checked = subprocess.run([sys.executable, "-m", "ovshard.cli", "verify", str(tmp_path / "default"), "--json"],
                             capture_output=True, text=True, timeout=600)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    storage = next(row for row in json.loads(checked.stdout)["rows"] if row["check"] == "weight storage")
    assert storage["verdict"] == "pass" and "i4: " in storage["found"], storage
    assert ("f32 zero points" in storage["found"]) == (qtype == "Q4_1"), storage


def test_the_grid_test_finds_q4_blocks_in_float32_and_bfloat16_and_no_grid_in_float_weights() -> None:
    import torch

    rng = np.random.default_rng(1)
    q4_1, step = (torch.from_numpy(a) for a in _q4_1(rng, 16, 256))
    steps = torch.from_numpy(rng.uniform(0.002, 0.02, (16 * 8, 1)).astype(np.float32))
    codes = torch.from_numpy(rng.integers(-8, 8, (16 * 8, 32)).astype(np.float32))
    codes[:, 0] = -8  # the block's largest magnitude, at one end as llama.cpp's Q4_0 puts it
    q4_0 = (codes * steps).reshape(16, 256)
    for dtype in (torch.float32, torch.bfloat16):
        assert "Q4_1" in grids_of(q4_1.to(dtype).float())
        assert "Q4_0" in grids_of(q4_0.to(dtype).float())
    assert grids_of(torch.from_numpy(rng.standard_normal((16, 256)).astype(np.float32))) == set()
    jitter = torch.from_numpy(rng.uniform(-0.4, 0.4, (16, 256)).astype(np.float32))
    assert grids_of(q4_1 + jitter * step.repeat_interleave(32, 1)) == set()  # each weight up to 0.4 steps off
    both_ends = q4_0.clone().reshape(-1, 32)
    both_ends[:, 1] = steps[:, 0] * 8  # +8 steps beside -8: no Q4_0 block holds both (its codes are -8..7)
    assert "Q4_0" not in grids_of(both_ends.reshape(16, 256))
    assert grids_of(torch.zeros(4, 64)) == {"Q4_0", "Q4_1"}  # a constant block lies on every grid
    assert grids_of(q4_1[:, :250]) == set()  # inputs not a multiple of 32 wide: no blocks


@pytest.mark.parametrize(("qtype", "mode", "other"), [("Q4_1", "int4_affine", "int4_sym"),
                                                      ("Q4_0", "int4_sym", "int4_affine")])
def test_a_float_checkpoint_on_a_q4_grid_keeps_its_blocks_by_default(tmp_path: Path, qtype: str, mode: str,
                                                                    other: str) -> None:
    """A tiny llama's Q4_1 (Q4_0) GGUF saved as a bfloat16 safetensors checkpoint: the default compile finds its grid
    and stores every decoder weight int4_affine (int4_sym) in groups of 32, data-free, closer to the fp32 bundle than
    the other format in the same groups (whose compile warns that it rounds the grid again); the same weights off the
    grid (the F32 GGUF saved the same way) keep the float default."""
    from dense_gguf import hf_weights, saved_as_floats, write_gguf

    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.client.inprocess import LocalPipeline
    from ovshard.runtime.engine.stage import EXACT_HINTS

    weights = hf_weights("llama")
    on_grid = saved_as_floats(write_gguf(tmp_path / "q4.gguf", "llama", weights, qtype=qtype), tmp_path / "grid_ckpt",
                               "bfloat16")
    off_grid = saved_as_floats(write_gguf(tmp_path / "f32.gguf", "llama", weights), tmp_path / "float_ckpt", "float32")
    runs = {"fp32": (on_grid, ["--weights", "fp32"]), "default": (on_grid, []),
            "other": (on_grid, ["--weights", other, "--group-size", "32", "--budget", "1.0", "--calibration", "none"]),
            "float": (off_grid, [])}
    logits = {}
    for name, (source, extra) in runs.items():
        done = subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "compile", str(source), "-o",
                               str(tmp_path / name), "--no-cache", *extra], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert ("rounds each weight again" in done.stderr) == (name == "other"), (name, done.stderr)
        logits[name] = LocalPipeline(tmp_path / name, config=EXACT_HINTS).forward([1, *range(3, 40)])[0]
    fmt = read_manifest(tmp_path / "default").weights
    assert (fmt.mode, fmt.group_size, fmt.budget, fmt.int8_weights, fmt.calibration) == (mode, 32, 1.0, (), "none")
    assert read_manifest(tmp_path / "float").weights.mode == "int4_sym"
    errors = {name: float(np.mean((logits[name] - logits["fp32"]) ** 2)) for name in ("default", "other")}
    assert errors["default"] < 0.5 * errors["other"], errors


def test_any_format_option_keeps_the_per_model_rules_off(tmp_path: Path) -> None:
    """The rules (``source_weights``) choose only where no format option was given on the command line."""
    from ovshard.cli import build_parser
    from ovshard.commands.compile import compile_config

    def chosen(*options: str) -> bool:
        args = build_parser().parse_args(["compile", str(tmp_path), "-o", str(tmp_path / "out"), *options])
        return compile_config(args).weights_from_source

    assert chosen() and chosen("--stages", "2", "--calibration", "none")
    for option in (["--weights", "int4_sym"], ["--group-size", "128"], ["--budget", "1.15"], ["--embedding", "int8"],
                   ["--embedding-group-size", "32"], ["--all-layers"]):
        assert not chosen(*option), option
