"""Data-aware INT4: calibration text, layer-by-layer activations, the same weights at every split.

``--calibration auto|FILE`` runs the calibrated INT4 (ovshard's scale fit by default) on each layer piece of the streamed
compile, fed the activations the float32 layers before it produce. Those are checked against Hugging
Face's hidden states; a calibrated checkpoint compiled into 1 or 2 stages, or one stage alone with
``--only-stage``, stores the same bytes for every weight. The memory bound is in test_compile_memory.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from test_int4_accuracy import STORY, stored_weights

from ovshard.bundle.manifest import read_manifest
from ovshard.bundle.weights import DEFAULT_DATA_AWARE, WeightFormat
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.errors import ConfigError
from ovshard.frontend.calibration import SHIPPED_TEXT, Activations, calibration_text
from ovshard.frontend.source import open_source
from ovshard.ir.pass_manager import Piece

pytestmark = pytest.mark.slow


CLI = [sys.executable, "-m", "ovshard.cli"]


def test_a_text_file_becomes_samples_that_start_with_bos(stories: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    text = calibration_text(open_source(stories), str(STORY), 3, 64, tmp_path)
    assert len(text.samples) == 3 and all(len(s) == 64 and s[0] == 1 for s in text.samples)
    decoded = AutoTokenizer.from_pretrained(stories).decode(list(text.samples[0][1:]))
    assert decoded.strip()[:40] in STORY.read_text(), decoded  # the text's own opening, as tokens
    assert text.source == f"file {STORY.name}" and len(text.digest) == 16


def test_the_shipped_text_is_sampled_over_its_whole_length(stories: Path, tmp_path: Path) -> None:
    """--calibration text: ovshard's own text, its samples taken evenly from the prose at its start to the code
    at its end, not its opening alone."""
    from transformers import AutoTokenizer

    text = calibration_text(open_source(stories), "text", 4, 128, tmp_path)
    assert text.source == "text" and len(text.samples) == 4
    decoded = [AutoTokenizer.from_pretrained(stories).decode(list(s[1:])) for s in text.samples]
    shipped = SHIPPED_TEXT.read_text()
    assert decoded[0].strip()[:30] in shipped and shipped.startswith(decoded[0].strip()[:30]), decoded[0]
    assert any("def " in d or "return" in d for d in decoded[2:]), decoded  # the code near the end is sampled


def test_auto_writes_the_same_samples_every_time(stories: Path, tmp_path: Path) -> None:
    """The model's own sampled text, seeded: the same ids twice, each sample a neutral prompt and its continuation."""
    from transformers import AutoTokenizer

    ckpt = open_source(stories)
    one = calibration_text(ckpt, "auto", 2, 24, tmp_path)
    assert one == calibration_text(ckpt, "auto", 2, 24, tmp_path)
    assert [len(s) for s in one.samples] == [24, 24] and all(s[0] == 1 for s in one.samples)
    the = AutoTokenizer.from_pretrained(stories)("The", add_special_tokens=False)["input_ids"]
    assert one.samples[0][:1 + len(the)] == (1, *the)  # BOS, "The" (the first prompt); then the model's words


def test_the_layers_get_the_reference_models_hidden_states(stories: Path, tmp_path: Path) -> None:
    """Each layer piece's calibration input is Hugging Face's hidden state entering that layer (float32)."""
    from transformers import AutoModelForCausalLM

    ckpt = open_source(stories)
    text = calibration_text(ckpt, str(STORY), 2, 48, tmp_path)
    activations = Activations(ckpt, text)
    model = AutoModelForCausalLM.from_pretrained(stories, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        reference = [model(torch.tensor([s]), output_hidden_states=True).hidden_states for s in text.samples]
    assert activations(Piece("embedding")) is None
    for start, end in ((0, 2), (2, 3), (3, 5)):  # pieces in compile order, one of two layers
        items = activations(Piece("layers", start, end))
        assert items is not None and len(items) == 2
        for item, hidden in zip(items, reference, strict=True):
            assert np.abs(item[f"hidden.{start}"] - hidden[start].numpy()).max() < 1e-4
            assert item[f"past_key_values.{start}.key"].shape[2] == 0
    again = activations(Piece("layers", 1, 2))  # back to an earlier layer: from the embedding again
    assert again is not None and np.abs(again[0]["hidden.1"] - reference[0][1].numpy()).max() < 1e-4


@pytest.fixture(scope="module")
def calibrated(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("calibrated")
    weights = WeightFormat("int4_sym", budget=1.0)  # every decoder weight INT4: all of them calibrated
    out = {}
    for name, stages, only, calibration in (("1", 1, None, str(STORY)), ("2", 2, None, str(STORY)),
                                            ("2.part1", 2, 1, str(STORY)), ("free", 1, None, "none")):
        out[name] = root / name
        compile_bundle(CompileConfig(stories, out[name], stages=stages, weights=weights, only_stage=only,
                                     calibration=calibration, calibration_samples=4, calibration_tokens=64))
    return out


def test_calibration_changes_the_int4_weights_and_is_recorded(calibrated: dict[str, Path]) -> None:
    weights = read_manifest(calibrated["1"]).weights
    assert weights.methods == DEFAULT_DATA_AWARE and weights.calibration == f"file {STORY.name}"
    assert len(weights.calibration_digest) == 16
    free = read_manifest(calibrated["free"]).weights
    assert free.methods == () and free.calibration == "none"
    int4 = {w for w in stored_weights(calibrated["1"]) if w[1] == "i4"}
    assert int4 and not int4 & {w for w in stored_weights(calibrated["free"]) if w[1] == "i4"}
    # the same ops, types and shapes as data-free: only the codes and scales differ, so decoding costs the same
    layout = [Counter(w[:3] for w in stored_weights(calibrated[k]).elements()) for k in ("1", "free")]
    assert layout[0] == layout[1]


def test_calibrated_weights_do_not_depend_on_the_split(calibrated: dict[str, Path]) -> None:
    """1 stage, 2 stages and stage 1 compiled alone (which first runs layers 0..k in float32) store the same bytes."""
    one, two = stored_weights(calibrated["1"]), stored_weights(calibrated["2"])
    assert two == one, f"{two - one} instead of {one - two}"
    part = stored_weights(calibrated["2.part1"])
    assert part and not part - two, part - two


def test_calibration_errors_say_what_to_do(stories: Path, tmp_path: Path) -> None:
    cases = [
        (["--weights", "fp32", "--calibration", "auto"], "calibrates INT4 weights"),
        (["--calibration", "none", "--calibration-methods", "gptq"], "need calibration text"),
        (["--calibration", "auto", "--calibration-methods", "magic"], "expected some of awq"),
        (["--calibration", str(tmp_path / "missing.txt")], "no such file"),
        (["--calibration", "auto", "--whole-stage"], "inside the streamed compile"),
        (["--calibration", "auto", "--calibration-tokens", "4"], "at least 16 tokens"),
    ]
    for flags, message in cases:
        done = subprocess.run([*CLI, "compile", str(stories), "-o", str(tmp_path / "b"), "--no-cache", *flags],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and message in done.stderr, (flags, done.stderr[-800:])
        assert "Traceback" not in done.stderr and not (tmp_path / "b").exists()
    small = tmp_path / "small"  # a 256-row vocabulary beside stories260K's tokenizer, whose ids reach 511
    subprocess.run([*CLI, "-q", "synth", "tiny", "--layers", "1", "-o", str(small)], check=True, capture_output=True)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (stories / name).is_file():
            (small / name).write_bytes((stories / name).read_bytes())
    done = subprocess.run([*CLI, "compile", str(small), "-o", str(tmp_path / "b"), "--no-cache"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and "is not this model's tokenizer" in done.stderr, done.stderr[-800:]
    assert "Traceback" not in done.stderr and not (tmp_path / "b").exists()
    with pytest.raises(ConfigError, match="fewer than one sample"):
        short = tmp_path / "short.txt"
        short.write_text("Once upon a time.")
        calibration_text(open_source(stories), str(short), 2, 64, tmp_path)
