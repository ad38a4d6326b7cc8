"""The scale fit of a mixture of experts: each expert fitted to the tokens routed to it.

The calibration's float32 run of an MoE layer runs each expert on its routed tokens alone
(``ovshard.frontend.mlp``) and catches each expert's inputs; here Hugging Face's own Qwen3-MoE layer gives the
reference: the tokens its router sends to each expert, and their inputs. An expert no token was routed to gets the
data-free min-max scale. The calibrated compile of a random Qwen3-MoE fits every expert INT4, keeps the experts
gathered, and peaks within 1.5x the data-free compile's memory (its own peak RSS report).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from families import moe_with_tokenizer
from transformers import AutoModelForCausalLM

from ovshard.bundle.stage import StageSpec
from ovshard.frontend import int4_fit
from ovshard.frontend.calibration import Activations, CalibrationText
from ovshard.frontend.source import open_source
from ovshard.frontend.trace import load_layer

IDS = (1, 37, 201, 5, 444)  # 5 tokens, top 2 of 8 experts: some expert gets none
GROUP = 32


def _reference(checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hugging Face's layer 0 on ``IDS``: its experts' inputs [tokens, hidden], each token's top-k experts, and the
    layer's output."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    seen = {}
    model.model.layers[0].mlp.experts.register_forward_pre_hook(lambda _, args: seen.setdefault("args", args))
    with torch.no_grad():
        out = model(torch.tensor([IDS]), output_hidden_states=True)
    inputs, chosen, _ = seen["args"]
    return inputs, chosen, out.hidden_states[1][0]


def test_each_expert_is_fitted_to_the_tokens_routed_to_it(stories: Path, tmp_path: Path) -> None:
    """Each expert's caught inputs are Hugging Face's inputs of the tokens its router chose for it, its INT4 is the
    fit to those alone, an expert no token chose gets the min-max scale, and the layer's output is HF's."""
    checkpoint = moe_with_tokenizer(stories, tmp_path / "ckpt")
    inputs, chosen, hidden = _reference(checkpoint)
    ckpt = open_source(checkpoint)
    activations = Activations(ckpt, CalibrationText((IDS,), "test"))
    weight = load_layer(ckpt, 0, StageSpec(0, 1, 0, ckpt.dims.num_layers)).experts_gate_weight.numpy()
    codes, scales = activations.fit_int4("0.experts_gate", weight, GROUP)
    torch.testing.assert_close(activations.hidden[0][0], hidden, atol=1e-4, rtol=1e-4)
    assert codes.shape == (8, 32, 64 // GROUP, GROUP) and scales.shape == (8, 32, 64 // GROUP, 1)
    unrouted = [e for e in range(8) if not (chosen == e).any()]
    assert unrouted, chosen  # the case this test is for
    for e in range(8):
        caught = activations.caught.get(f"experts_gate[{e}]")
        if e in unrouted:
            assert caught is None
            want = int4_fit.minmax(torch.from_numpy(weight[e]), GROUP)
        else:
            tokens = (chosen == e).any(-1)
            torch.testing.assert_close(caught, inputs[tokens], atol=1e-4, rtol=1e-4)
            want = int4_fit.fit(torch.from_numpy(weight[e]), int4_fit.second_moments(inputs[tokens], GROUP))
        assert (scales[e] == want[1].numpy()).mean() > 0.9, e  # HF's inputs differ in the last bits: a rare tie
        assert (codes[e] == want[0].numpy()).mean() > 0.9, e
    plain = [int4_fit.minmax(torch.from_numpy(weight[e]), GROUP)[1].numpy() for e in range(8)]
    assert any((scales[e] != plain[e]).any() for e in range(8) if e not in unrouted)  # a fit, not min-max


def test_the_calibrated_moe_compile_fits_its_experts_within_1_5x_data_free_memory(stories: Path, tmp_path: Path) -> None:
    """Every weight INT4 (--budget 1.0): the default (calibrated) compile writes other expert weights than the
    data-free one, each INT4 [experts, out, groups, group], still gathered by the CPU plugin, and its peak RSS is
    at most 1.5x the data-free compile's."""
    from ovshard.bundle.manifest import read_manifest
    from ovshard.verify.fusion import check_cpu_fusion

    checkpoint = moe_with_tokenizer(stories, tmp_path / "ckpt")
    found = {}
    for name, flags in (("free", ["--calibration", "none"]), ("fit", [])):
        done = subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "compile", str(checkpoint), "-o",
                               str(tmp_path / name), "--no-cache", "--budget", "1.0", "--json", *flags],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        found[name] = json.loads(done.stdout)
    assert "methods=scale_fit" in found["fit"]["weights"] and "methods=scale_fit" not in found["free"]["weights"]
    assert found["fit"]["peak_rss_bytes"] <= 1.5 * found["free"]["peak_rss_bytes"], found
    manifest = read_manifest(tmp_path / "fit")
    assert all(r.ok and r.gather_matmuls == 3 * r.layers for r in check_cpu_fusion(tmp_path / "fit", manifest))
    experts = {name: _experts(tmp_path / name / manifest.stages[0].model_xml) for name in ("free", "fit")}
    assert len(experts["fit"]) == len(experts["free"]) == 3 * 4  # gate, up, down of 4 layers
    for (shape, _), (free_shape, _) in zip(experts["fit"], experts["free"], strict=True):
        assert len(shape) == 4 and shape[0] == 8 and shape == free_shape, (shape, free_shape)
    assert any(not np.array_equal(fit, free) for (_, fit), (_, free) in zip(experts["fit"], experts["free"],
                                                                            strict=True))


def _experts(xml: Path) -> list[tuple[list[int], np.ndarray]]:
    """The INT4 expert weights of a stage IR in graph order: each one's codes' shape and its scales."""
    import openvino as ov

    found = []
    for op in ov.Core().read_model(str(xml)).get_ordered_ops():
        name = op.get_friendly_name()
        if op.get_type_name() == "Constant" and "experts_" in name and name.endswith("_weight"):
            scale = next(t for t in op.output(0).get_target_inputs()).get_node().output(0).get_target_inputs()
            multiply = next(iter(scale)).get_node()
            scales = next(multiply.input_value(k).get_node() for k in range(2)
                          if multiply.input_value(k).get_node().get_type_name() == "Constant")
            found.append((list(op.get_output_shape(0)), scales.get_data().copy()))
    return found


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "llama4_text",
                                    "llama4_text_top2", "mixtral"])
def test_the_routed_experts_compute_what_the_tiled_graph_computes(family: str, tmp_path: Path) -> None:
    """Eagerly (each expert on its routed tokens) and traced (every token through every expert, the graph's form),
    an MoE layer's experts give the same output, shared expert included."""
    from families import FAMILIES, write_random_checkpoint

    from ovshard.frontend.stage_module import experts_mlp

    ckpt = open_source(write_random_checkpoint(FAMILIES[family], tmp_path / "ckpt"))
    sparse = next(i for i in range(ckpt.dims.num_layers) if ckpt.dims.sparse(i))
    layer = load_layer(ckpt, sparse, StageSpec(0, 1, 0, ckpt.dims.num_layers))

    class Experts(torch.nn.Module):
        def forward(self, m: torch.Tensor) -> torch.Tensor:
            return experts_mlp(m, layer, ckpt.dims, ckpt.block)

    m = torch.randn(2, 7, ckpt.dims.hidden_size)
    with torch.no_grad():
        traced = torch.jit.trace(Experts(), (m,), check_trace=False)(m)
        torch.testing.assert_close(Experts()(m), traced, atol=1e-5, rtol=1e-4)
