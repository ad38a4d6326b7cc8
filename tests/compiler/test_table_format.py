"""The embedding and lm_head's own INT4 format (``--embedding``): checked, counted, fitted, the same at any stage count.

``WeightFormat.embedding`` stores the table (a tied one's single constant, or the embedding and the lm_head) in
INT4 groups beside INT4 decoder weights, instead of INT8 per channel. Bad values are clear errors; the bytes the
planner and the INT8 budget count are the table format's. On the real stories260K: the symmetric table fitted to
the lm_head's inputs (the final hidden states of the calibration text) errs less on those inputs' logits than the
data-free min-max table, and a calibrated compile writes the same table bytes into a one-stage bundle and into both
stages of a two-stage one. A tied table over half the model (Gemma 3 270M's) gets INT4 groups of 16 by default.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch
from real_gemma import gemma_gguf  # noqa: F401  (fixture)

from ovshard.bundle.weights import WeightFormat
from ovshard.errors import ConfigError
from ovshard.frontend import int4_fit
from ovshard.frontend.source import open_source
from ovshard.frontend.stage_module import rms_norm
from ovshard.plan.precision import embedding_bytes


def test_table_formats_are_checked_and_counted(stories: Path) -> None:
    with pytest.raises(ConfigError, match=r"--embedding 'int5': expected one of int8, int4_sym, int4_asym"):
        WeightFormat(embedding="int5")
    with pytest.raises(ConfigError, match=r"--embedding-group-size 48: expected a power of two of at least 8"):
        WeightFormat(embedding="int4_asym", embedding_group=48)
    assert WeightFormat().table is None and WeightFormat(embedding="int4_sym", all_layers=True).table is None
    assert WeightFormat("int8", embedding="int4_sym").table is None  # only beside INT4 decoder weights
    fmt = WeightFormat(embedding="int4_asym", embedding_group=64)
    assert fmt.table is not None and (fmt.table.mode, fmt.table.group_size) == ("int4_asym", 64)
    assert "embedding=int4_asym g64" in fmt.describe()
    dims = open_source(stories).dims
    rows, width = dims.vocab_size, dims.hidden_size
    assert embedding_bytes(dims, fmt) == rows * (width * 0.5 + width / 64 * 2.5)
    assert embedding_bytes(dims, WeightFormat()) == rows * (width + 3.0)  # INT8 per channel, as before


@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
def test_the_fitted_table_errs_less_than_min_max_on_the_lm_heads_inputs(stories: Path, tmp_path: Path,
                                                                        asym: bool) -> None:
    """The table fitted to the final hidden states (``Activations.fit_table``) against NNCF's data-free min-max
    groups of 32 (symmetric, or asymmetric with a zero point): the lm_head's output error on those hidden states,
    summed over tokens and rows."""
    from ovshard.frontend.calibration import Activations, calibration_text

    ckpt = open_source(stories)
    activations = Activations(ckpt, calibration_text(ckpt, "text", 4, 64, tmp_path))
    table = ckpt.load(ckpt.spec.embed).float().numpy()
    fitted = activations.fit_table(table, 32, asym=asym)
    assert activations.at == ckpt.dims.num_layers  # every sample run through every layer
    d = ckpt.dims
    norm = ckpt.load(ckpt.spec.final_norm)
    inputs = torch.cat([rms_norm(h, norm, d.rms_norm_eps, ckpt.block.norm_offset).reshape(-1, d.hidden_size)
                        for h in activations.hidden]).double()
    reference = torch.from_numpy(table).double() @ inputs.T

    def error(q: np.ndarray, z: np.ndarray | float, s: np.ndarray) -> float:
        restored = torch.from_numpy(((q.astype(np.float64) - z) * s.astype(np.float64)).reshape(table.shape))
        return float(((restored @ inputs.T - reference) ** 2).sum())

    grouped = table.reshape(d.vocab_size, -1, 32)
    if asym:
        codes, zeros, scales = fitted
        assert codes.dtype == zeros.dtype == np.uint8 and codes.max() <= 15 and zeros.max() <= 15
        low, high = grouped.min(-1, keepdims=True), grouped.max(-1, keepdims=True)
        s = ((high - low) / 15).astype(np.float16).astype(np.float32)
        z = np.clip(np.round(-low / s), 0, 15)
        plain = error(np.clip(np.round(grouped / s) + z, 0, 15), z, s)
        mine = error(codes, zeros.astype(np.float64), scales)
    else:
        codes, scales = fitted
        plain = error(*(lambda q, s: (q.numpy(), 0.0, s.numpy()))(*int4_fit.minmax(torch.from_numpy(table), 32)))
        mine = error(codes, 0.0, scales)
    assert codes.shape == (d.vocab_size, d.hidden_size // 32, 32) and scales.dtype == np.float16
    assert mine < 0.9 * plain, (mine, plain)
    again = activations.fit_table(table[:100], 32, asym=asym)  # the moments are kept: a row chunk gets the same codes
    assert all(np.array_equal(a, b[:100]) for a, b in zip(again, fitted, strict=True))


def _table_constants(bundle: Path) -> list[bytes]:
    """The bytes of every i4 constant of the table's shape in the bundle's stage IRs, stage by stage."""
    found = []
    for xml in sorted(p for p in bundle.glob("*.xml") if "tokenizer" not in p.name):  # the stage IRs
        for op in ov.Core().read_model(xml).get_ordered_ops():
            if (op.get_type_name() == "Constant" and op.get_output_element_type(0) == ov.Type.i4
                    and op.get_output_shape(0)[0] == 512):  # stories260K's vocabulary: the table's rows
                found.append(op.get_data().tobytes())
    return found


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--embedding", "int4_sym"], ["--all-layers"]], ids=["embedding", "all-layers"])
def test_a_calibrated_table_is_the_same_at_one_and_two_stages(stories: Path, tmp_path: Path, flags: list[str]) -> None:
    """``--embedding int4_sym`` or ``--all-layers`` (the table in the decoder's own format) in the default
    (calibrated) compile: the tied table is INT4, fitted to the lm_head's inputs, one constant in a one-stage bundle,
    the same bytes in the first stage (embedding) and the last (lm_head) of a two-stage one."""
    tables = {}
    for stages in (1, 2):
        out = tmp_path / f"s{stages}"
        done = subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "compile", str(stories), "-o", str(out),
                               "--stages", str(stages), "--no-cache", "--max-positions", "256", *flags],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        tables[stages] = _table_constants(out)
    assert len(tables[1]) == 1 and len(tables[2]) == 2, {k: len(v) for k, v in tables.items()}
    assert tables[2][0] == tables[2][1] == tables[1][0]


def test_a_tied_table_over_half_the_model_gets_int4_groups_of_16_by_default(gemma_gguf: Path, stories: Path,  # noqa: F811
                                                                            tmp_path: Path) -> None:
    """The real Gemma 3 270M (its tied table 63% of the parameters): left to the default, the table is INT4
    asymmetric in groups of 16 and every decoder weight INT8; an explicit format keeps its own; stories260K (its
    table 13%) keeps the default."""
    from ovshard.compile_config import CompileConfig, source_weights

    gemma = open_source(gemma_gguf)
    chosen = source_weights(CompileConfig(gemma_gguf, tmp_path / "g", weights_from_source=True), gemma).weights
    assert (chosen.mode, chosen.embedding, chosen.embedding_group, chosen.budget) == ("int4_sym", "int4_asym", 16, 4.0)
    assert source_weights(CompileConfig(gemma_gguf, tmp_path / "g"), gemma).weights == WeightFormat()
    small = source_weights(CompileConfig(stories, tmp_path / "s", weights_from_source=True), open_source(stories))
    assert small.weights == WeightFormat()


def test_activations_are_quantized_in_groups_no_larger_than_the_smallest_weight_group(stories: Path,
                                                                                     tmp_path: Path) -> None:
    """A compressed FullyConnected whose weight groups are smaller than its activations' runs the plugin's slow path
    (Gemma 3 270M's lm_head in groups of 16: 2x the time under groups of 128), so a bundle's hints quantize
    activations in groups no larger than its smallest INT4 group, on every ISA class that quantizes them, and the
    stage compiles with that group; off stays off, and a bundle of larger groups keeps the measured hints."""
    from ovshard.bundle.manifest import (
        CPU_PLUGIN_HINTS,
        CPU_PLUGIN_HINTS_BY_ISA,
        read_manifest,
        within_weight_groups,
    )
    from ovshard.bundle.manifest import DQ_GROUP as dq
    from ovshard.plan.precision import int4_groups
    from ovshard.runtime.engine.plugin import plugin_config
    from ovshard.runtime.engine.stage import Stage

    assert within_weight_groups({dq: "128", "A": "b"}, 16) == {dq: "16", "A": "b"}
    assert within_weight_groups({dq: "128"}, 8) == {dq: "16"}  # the plugin's least group
    assert within_weight_groups({dq: "32"}, 64) == {dq: "32"} and within_weight_groups({dq: "0"}, 16) == {dq: "0"}
    assert within_weight_groups({dq: "128"}, None) == {dq: "128"} and within_weight_groups({}, 16) == {}
    dims = open_source(stories).dims  # hidden 64, intermediate 172: groups of 128 fall back to 64, or to INT8
    assert int4_groups(dims, WeightFormat()) == {64}
    assert int4_groups(dims, WeightFormat(embedding="int4_asym", embedding_group=16)) == {16, 64}
    assert int4_groups(dims, WeightFormat("int8")) == set() and int4_groups(dims, WeightFormat(group_size=-1)) == set()

    out = tmp_path / "b"
    done = subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "compile", str(stories), "-o", str(out),
                           "--stages", "1", "--no-cache", "--max-positions", "256", "--calibration", "none",
                           "--embedding", "int4_asym", "--embedding-group-size", "16"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = read_manifest(out)
    hints = manifest.runtime_hints
    assert hints.cpu_plugin[dq] == "16"
    for isa, measured in CPU_PLUGIN_HINTS_BY_ISA.items():
        wanted = within_weight_groups({**CPU_PLUGIN_HINTS, **measured}, 16)[dq]
        assert int(wanted) <= 16 and plugin_config(manifest, "CPU", None, isa)[dq] == wanted
        assert ("smallest INT4 weight group" in hints.cpu_plugin_by_isa_measured[isa]) == (dq in measured)
    stage = Stage(out, manifest, 0)  # this machine's class, as a node loads it
    assert int(stage.compiled.get_property(dq)) <= 16
