"""Streamed compile memory: peak anonymous memory does not follow the number of layers in a stage."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from ovshard.frontend.description import describe
from ovshard.frontend.tensors import layer_tensors
from ovshard.tools.synth import llama_config, write_checkpoint

sys.path.insert(0, str(REPO / "bench"))
from memprobe import Peak  # noqa: E402  (bench/ is not a package; the benchmark uses the same probe)

pytestmark = pytest.mark.slow

# layers of ~7.1M parameters (28 MB as float32), a vocabulary too small to matter
SHAPE = dict(hidden_size=512, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             vocab_size=256, max_position_embeddings=512)
FEW, MANY = 2, 6  # layers per stage (one stage each)
# A streamed compile groups layers this small into one piece (CompileConfig.piece_bytes, 16 MiB of f32 by
# default); piece_bytes=1 gives each layer a piece of its own, as real layers of 1B-70B models get.
COMPILE = """
import sys
from pathlib import Path
from ovshard.compile import CompileConfig, compile_bundle
checkpoint, output, mode = sys.argv[1:]
calibration = "auto" if mode == "calibrated" else "none"  # the default method (the scale fit) on the model's own text
compile_bundle(CompileConfig(Path(checkpoint), Path(output), stages=1, streaming=mode != "whole", piece_bytes=1,
                             calibration=calibration, calibration_samples=4, calibration_tokens=32))
"""


def _f32_layer_bytes(config: dict) -> int:
    model = describe(config)
    spec, dims = model.arch, model.dims
    return 4 * sum(math.prod(shape) for shape in layer_tensors(spec, dims, 0).values())


@pytest.fixture(scope="module")
def peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], int]:
    """Peak RssAnon of the compiler's process tree, by (layers, mode). The streamed and whole-stage compiles
    run four at once; the calibrated ones after them, two at once."""
    root = tmp_path_factory.mktemp("compile-memory")
    checkpoints = {layers: write_checkpoint(root / f"ckpt{layers}", llama_config(num_hidden_layers=layers, **SHAPE),
                                            dtype="bfloat16")  # as real releases: every weight loaded is a copy
                   for layers in (FEW, MANY)}
    found = _compile_all(root, checkpoints, ("streamed", "whole"))
    # A calibrated layer's NNCF work peaks ~150 MiB over the base. With glibc's moving mmap threshold that top
    # scattered by +-40 MiB from layer to layer and run to run (the 6-layer compile, with three times the
    # draws, then crossed the bound now and then); the compiler now fixes the threshold
    # (ovshard.memory.return_freed_blocks) and the peaks repeat within a few MiB.
    found.update(_compile_all(root, checkpoints, ("calibrated",)))
    print("\npeak RssAnon MiB by (layers, mode):", {k: round(v / 2**20) for k, v in found.items()})  # -s shows it
    return found


def _compile_all(root: Path, checkpoints: dict[int, Path], modes: tuple[str, ...]) -> dict[tuple[int, str], int]:
    running = {}
    for layers, ckpt in checkpoints.items():
        for mode in modes:
            out = root / f"bundle{layers}{mode}"
            log = (root / f"{out.name}.log").open("w")
            cmd = [sys.executable, "-c", COMPILE, str(ckpt), str(out), mode]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, CI="true"))
            running[layers, mode] = (proc, Peak(proc.pid, interval=0.05).start(), log)
    found = {}
    try:
        for key, (proc, peak, log) in running.items():
            proc.wait(timeout=300)
            peak.stop()
            log.close()
            assert proc.returncode == 0, f"compile {key} failed:\n{Path(log.name).read_text()[-3000:]}"
            assert peak.samples > 10 and peak.peak_anon > 100 << 20, (
                f"the probe saw nothing of compile {key}: {peak.samples} samples, peak {peak.peak_anon} bytes")
            found[key] = peak.peak_anon
    finally:
        for proc, peak, _ in running.values():  # after a failure, the compiles still running
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            peak.stop()
    return found


def _bound() -> int:
    """Half of what the extra layers' float32 weights alone would add: a copy of them held at once exceeds it."""
    return (MANY - FEW) * _f32_layer_bytes(llama_config(**SHAPE)) // 2


def _assert_flat(peaks: dict[tuple[int, str], int], mode: str, why: str) -> None:
    few, many = peaks[FEW, mode], peaks[MANY, mode]
    assert many - few < _bound(), (
        f"{mode}: {MANY} layers peak at {many / 2**20:.0f} MiB anon, {FEW} layers at {few / 2**20:.0f} MiB: "
        f"+{(many - few) / 2**20:.0f} MiB, expected < {_bound() / 2**20:.0f} MiB (half of {MANY - FEW} layers' "
        f"f32 weights); {why}")


def test_streamed_peak_anon_is_flat_in_layers_per_stage(peaks: dict[tuple[int, str], int]) -> None:
    """A streamed stage of 6 layers peaks within half of 4 layers' f32 weights of a stage of 2 layers."""
    _assert_flat(peaks, "streamed", "memory follows the layers of a stage again")


def test_calibrated_peak_anon_is_flat_in_layers_per_stage(peaks: dict[tuple[int, str], int]) -> None:
    """--calibration auto (the model writes its text one layer in memory at a time, then the scale fit runs on
    each layer with the activations of the layers before it): the same bound."""
    _assert_flat(peaks, "calibrated", "calibration holds more than a layer at a time")


def test_whole_stage_peak_anon_follows_layers(peaks: dict[tuple[int, str], int]) -> None:
    """Control: --whole-stage exceeds that bound, so the bound sees a stage's weights held at once."""
    few, many = peaks[FEW, "whole"], peaks[MANY, "whole"]
    assert many - few >= _bound(), (
        f"--whole-stage: {MANY} layers peak at {many / 2**20:.0f} MiB anon, {FEW} at {few / 2**20:.0f} MiB: "
        f"+{(many - few) / 2**20:.0f} MiB, expected >= {_bound() / 2**20:.0f} MiB; if the whole-stage compile "
        f"stopped holding a stage's weights, make the layers bigger so the streamed test still means something")
