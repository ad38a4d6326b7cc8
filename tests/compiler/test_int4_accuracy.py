"""INT4 accuracy: the per-weight formats are the model's, not the stage's; the perplexity gate.

The weights a compile keeps in INT8 (the embedding and the lm_head) are chosen for the whole model, so one
checkpoint compiled into 1, 2 or 4 stages stores the same bytes for every weight and decodes the same
tokens. ``ovshard verify --perplexity`` is run as a user runs it, on the real stories260K.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import openvino as ov
import pytest
from conftest import REPO, STORIES

from ovshard.bundle.manifest import read_manifest, read_part_manifest
from ovshard.bundle.weights import DEFAULT_DATA_AWARE, WeightFormat
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.frontend.tensors import linear_shapes
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.tools.shapes import preset
from ovshard.tools.synth import write_checkpoint

pytestmark = pytest.mark.slow


STORY = REPO / "bench" / "texts" / "story.txt"
PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time" in stories260K's vocabulary


def stored_weights(bundle: Path) -> Counter:
    """Every MatMul and Gather weight of the bundle: op kind, stored type, shape, sha256 of the stored bytes."""
    found = []
    core = ov.Core()
    for entry in read_part_manifest(bundle).stages:  # a part bundle's stages too
        model = core.read_model(bundle / entry.model_xml)
        for op in model.get_ordered_ops():
            if op.get_type_name() not in ("MatMul", "Gather"):
                continue
            node = op.input_value(0 if op.get_type_name() == "Gather" else 1).get_node()
            while node.get_type_name() in ("Convert", "Multiply", "Subtract", "Reshape"):  # the decompression chain
                node = node.input_value(0).get_node()
            if node.get_type_name() != "Constant" or node.get_byte_size() < 1024 or (
                    op.get_type_name() == "Gather" and node.get_output_element_type(0) == ov.Type.f32):
                continue  # index inputs, positions, shapes, the rotary tables each stage holds
            digest = hashlib.sha256(node.get_data().tobytes()).hexdigest()[:16]
            found.append((op.get_type_name(), node.get_output_element_type(0).get_type_name(),
                          tuple(node.get_output_shape(0)), digest))
    return Counter(found)


@pytest.fixture(scope="module")
def int4_bundles(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("int4")
    out = {}
    for stages in (1, 2, 4):
        out[stages] = root / f"b{stages}"
        compile_bundle(CompileConfig(stories, out[stages], stages=stages, weights=WeightFormat()))
    return out


def test_the_default_calibrates_on_the_shipped_text_where_it_can(int4_bundles: dict[int, Path],
                                                                  tmp_path: Path) -> None:
    """A checkpoint with a tokenizer: the scale fit on the shipped text; without one (a random-weight shape), or
    in a compile that cannot calibrate (--jobs 2, --whole-stage): data-free, and the log says why."""
    for bundle in int4_bundles.values():
        weights = read_manifest(bundle).weights
        assert (weights.calibration, weights.methods) == ("text", DEFAULT_DATA_AWARE)
    ckpt = tmp_path / "tiny"
    write_checkpoint(ckpt, preset("tiny"))
    for name, flags, why in (("no-tokenizer", [], "has no tokenizer"), ("jobs", ["--jobs", "2"], "--jobs 2"),
                             ("whole", ["--whole-stage"], "streamed compile calibrates")):
        out = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "ovshard.cli", "compile", str(ckpt if name == "no-tokenizer"
                                                                                   else STORIES), "-o", str(out),
                               "--stages", "2", "--no-cache", *flags], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert why in done.stderr and "data-free" in done.stderr, (name, done.stderr[-2000:])
        weights = read_manifest(out).weights
        assert (weights.calibration, weights.methods) == ("none", ()), name


def test_per_weight_formats_do_not_depend_on_the_stage_count(int4_bundles: dict[int, Path]) -> None:
    """1, 2 and 4 stages store every weight in the same format with the same bytes; only the two ends are INT8."""
    one = stored_weights(int4_bundles[1])
    for stages in (2, 4):
        found = stored_weights(int4_bundles[stages])
        assert found == one, f"{stages} stages: {found - one} instead of {one - found}"
    vocab = 512
    ends = {(op, kind) for op, kind, shape, _ in one if shape[0] == vocab}
    assert ends == {("Gather", "u8"), ("MatMul", "u8")}, ends  # the tied embedding and the lm_head: INT8
    manifest = read_manifest(int4_bundles[1])
    chosen = manifest.weights.int8_weights
    assert chosen and all(read_manifest(b).weights.int8_weights == chosen for b in int4_bundles.values())
    # 35 decoder weights (stored alone or row-stacked by FuseProjectionsPass, so counted in elements): the 5 downs
    # (172 inputs, no INT4 group fits) and the chosen ones INT8, the rest INT4 (int4_sym: i4)
    sizes = {key: rows * cols for key, (rows, cols) in linear_shapes(manifest.architecture, 0).items()}
    elements: Counter = Counter()
    for (_, kind, shape, _), count in one.items():
        if shape[0] != vocab:
            elements[kind] += count * math.prod(shape)
    int8 = 5 * sizes["down"] + sum(sizes[key.split(".")[1]] for key in chosen)
    assert elements == Counter({"u8": int8, "i4": 5 * sum(sizes.values()) - int8}), (elements, chosen)


def test_the_same_checkpoint_decodes_the_same_tokens_at_every_stage_count(int4_bundles: dict[int, Path]) -> None:
    """f32 activations isolate the weights: 1, 2 and 4 stages give the same 32 greedy tokens."""
    runs = {s: LocalPipeline(b, config=EXACT_HINTS).generate_greedy(PROMPT, 32)[0] for s, b in int4_bundles.items()}
    assert runs[2] == runs[1] and runs[4] == runs[1], runs


def _verify(bundle: Path, stories: Path, *extra: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "ovshard.cli", "verify", str(bundle), "--reference", str(stories),
                           "--perplexity", str(STORY), "--device", "none", "--json", *extra],
                          capture_output=True, text=True, timeout=600)
    report = json.loads(done.stdout)
    return {r["check"].split(":")[0].split(" over ")[0]: r for r in report["rows"]} | {"_rc": done.returncode}


def test_verify_perplexity_passes_an_exact_bundle_and_measures_int4(stories: Path, int4_bundles: dict[int, Path],
                                                                     tmp_path: Path) -> None:
    """fp32: the reference's perplexity to the 4th decimal, exit 0; INT4: its increase over story.txt within 4%."""
    fp32 = tmp_path / "fp32"
    compile_bundle(CompileConfig(stories, fp32, stages=2, weights=WeightFormat("fp32")))
    rows = _verify(fp32, stories)
    assert rows["_rc"] == 0, rows
    found = rows["perplexity"]["found"]
    ours, ref = found.split(" (")[0].split(" vs ")
    assert ours == ref and rows["perplexity"]["verdict"] == "pass", found
    assert rows["top-1 agreement along the text (teacher-forced)"]["found"] == "100.0%"
    # fp32 is 32 bits a parameter when the last stage's copy of the tied embedding is counted once (36 if twice)
    assert 31.9 < float(rows["stored bits per parameter (each once)"]["found"].split()[0]) < 32.2, rows
    rows = _verify(int4_bundles[2], stories, "--perplexity-context", "256")
    increase = float(rows["perplexity"]["found"].split("(")[1].rstrip("%)")) / 100
    assert "5 chunks of 256" in rows["perplexity"]["check"], rows["perplexity"]
    assert -0.01 < increase <= 0.04 and rows["perplexity"]["verdict"] == "pass", rows["perplexity"]


def test_perplexity_text_errors_say_what_to_do(stories: Path, int4_bundles: dict[int, Path], tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time.")
    done = subprocess.run([sys.executable, "-m", "ovshard.cli", "verify", str(int4_bundles[1]), "--device", "none",
                           "--reference", str(stories), "--perplexity", str(short)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "fewer than one chunk of 512" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "ovshard.cli", "verify", str(int4_bundles[1]), "--device", "none",
                           "--perplexity", str(STORY)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "--perplexity needs --reference" in done.stderr, done.stderr[-2000:]
