"""GGUF files of GLM-4.5 (``glm4moe``), DeepSeek-V3 (``deepseek2``, multi-head latent attention) and Llama 4
(``llama4``), written from a random checkpoint the way llama.cpp's convert_hf_to_gguf.py writes them
(:mod:`moe_gguf`), read tensor by tensor against that checkpoint and compiled against transformers run on it.
transformers cannot read these files, so the source checkpoint is the reference.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_greedy_like_hf, compile_fp32
from families import FAMILIES, Family, write_random_checkpoint
from moe_gguf import (
    deepseek_plain_q_config,
    glm4_moe_config,
    llama4_config,
    write_deepseek_gguf,
    write_glm4_moe_gguf,
    write_llama4_gguf,
)

from ovshard.errors import UnsupportedArchitectureError
from ovshard.frontend.description import describe
from ovshard.frontend.gguf import GGUFCheckpoint, open_gguf

pytestmark = pytest.mark.slow

MAX_LOGIT_DIFF = 1e-4


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(Family(glm4_moe_config, seed=1), tmp_path_factory.mktemp("glm4moe"))


def assert_describes_source(config: dict, source: Path) -> None:
    """``config`` (read from a GGUF) describes the model of the checkpoint ``source``, whose eps the file holds as f32."""
    theirs = json.loads((source / "config.json").read_text())
    theirs["rms_norm_eps"] = float(np.float32(theirs["rms_norm_eps"]))
    ours, hf = describe(config), describe(theirs)
    assert (ours.arch, ours.dims, ours.block, dict(ours.rope)) == (hf.arch, hf.dims, hf.block, dict(hf.rope))


def assert_equals_source(ckpt: GGUFCheckpoint, source: Path) -> dict[str, torch.Tensor]:
    """An F32 file ``ckpt`` holds the tensors of the checkpoint ``source`` bit for bit and describes its model;
    returns the source's tensors."""
    from safetensors.torch import load_file

    ckpt.validate_tensors()
    assert_describes_source(ckpt.config, source)
    saved = load_file(source / "model.safetensors")
    assert set(ckpt.tensor_names()) == set(saved)
    for name, w in saved.items():
        assert torch.equal(ckpt.load(name), w), name
    return saved


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_glm4_moe_gguf_equals_its_checkpoint(tmp_path: Path, glm_checkpoint: Path, qtype: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """GLM-4.5 as llama.cpp writes it: every tensor equals the source checkpoint's (F32 bit for bit, Q8_0 its
    quantize-dequantize round trip; the router and vectors f32), the routing bias read from exp_probs_b.bias; the
    config describes the source's model (partial rotary, q/k norms, grouped sigmoid routing, the dense layer 0);
    the appended next-token-prediction layer is skipped, and says so."""
    import gguf
    from safetensors.torch import load_file

    with caplog.at_level(logging.INFO, logger="ovshard.frontend.gguf_layout"):
        ckpt = open_gguf(write_glm4_moe_gguf(glm_checkpoint, tmp_path / "glm.gguf", qtype))
    assert "tensors of the next-token-prediction layers blk.3 not read" in caplog.text
    ckpt.validate_tensors()
    assert_describes_source(ckpt.config, glm_checkpoint)
    block = ckpt.block
    assert (block.rotary_dim, block.qk_norm, block.expert_groups, block.groups_per_token) == (8, True, 4, 2)
    assert (block.routed_scaling, block.norm_topk, ckpt.dims.num_layers) == (2.5, True, 3)
    saved = load_file(glm_checkpoint / "model.safetensors")
    assert set(ckpt.tensor_names()) == set(saved)
    kind = gguf.GGMLQuantizationType[qtype]
    for name, w in saved.items():
        if w.ndim == 2 and qtype != "F32" and not name.endswith("mlp.gate.weight"):  # the router kept f32
            w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), kind), kind))
        assert torch.equal(ckpt.load(name), w), name


@pytest.mark.parametrize("variant", ["glm4_moe", "glm4_moe_air"])
def test_glm4_moe_gguf_two_stages_match_its_checkpoint(tmp_path: Path, glm_checkpoint: Path, variant: str) -> None:
    """An F32 GLM-4.5 GGUF compiled to 2 fp32 stages greedy-decodes the tokens transformers decodes from the
    safetensors checkpoint it was converted from, logits within 1e-4; and GLM-4.5-Air's choices (no q/k norms, one
    group, top-4 not renormalized, two dense layers, tied embeddings)."""
    checkpoint = glm_checkpoint if variant == "glm4_moe" else write_random_checkpoint(FAMILIES[variant], tmp_path / "hf")
    bundle = compile_fp32(write_glm4_moe_gguf(checkpoint, tmp_path / "glm.gguf"), tmp_path / "bundle", stages=2)
    prompt = [1, 17, 42, 99, 5, 123, 77]
    assert_greedy_like_hf(bundle, checkpoint, prompt, max_logit_diff=MAX_LOGIT_DIFF)


def test_softmax_gated_glm4_moe_refused(tmp_path: Path, glm_checkpoint: Path) -> None:
    """A glm4moe file whose experts are routed by softmax (expert_gating_func 1) is refused, naming the key."""
    with pytest.raises(UnsupportedArchitectureError, match=r"expert_gating_func=1 .*sigmoid routing only"):
        open_gguf(write_glm4_moe_gguf(glm_checkpoint, tmp_path / "glm.gguf", gating=1))


DEEPSEEK = {"deepseek_v3": FAMILIES["deepseek_v3"], "plain_q": Family(deepseek_plain_q_config)}


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["k_b-v_b", "kv_b"])
@pytest.mark.parametrize("variant", list(DEEPSEEK))
def test_deepseek_gguf_equals_its_checkpoint(tmp_path: Path, variant: str, split_kv_b: bool) -> None:
    """DeepSeek-V3 as llama.cpp writes it (MLA as one latent key/value head, kv_b_proj split per head into
    attn_k_b/attn_v_b, or whole as older files hold it; yarn's mscale as yarn_log_multiplier): every tensor equals
    the source checkpoint's, kv_b_proj joined back (also row by row); the config describes the source's model (the
    latent ranks, head widths, yarn, grouped routing), with and without the q latent."""
    checkpoint = write_random_checkpoint(DEEPSEEK[variant], tmp_path / "hf")
    ckpt = open_gguf(write_deepseek_gguf(checkpoint, tmp_path / "ds.gguf", split_kv_b))
    saved = assert_equals_source(ckpt, checkpoint)
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
    assert torch.equal(ckpt.load_rows(kv_b, 3, 30), saved[kv_b][3:30])


@pytest.mark.parametrize("variant", list(DEEPSEEK))
def test_deepseek_gguf_two_stages_match_its_checkpoint(tmp_path: Path, variant: str) -> None:
    """An F32 DeepSeek-V3 GGUF (kv_b split, as current llama.cpp writes it) compiled to 2 fp32 stages greedy-decodes
    the tokens transformers decodes from its source checkpoint, logits within 1e-4: yarn x4 past its 32 original
    positions with a q latent, and the default rope without one."""
    checkpoint = write_random_checkpoint(DEEPSEEK[variant], tmp_path / "hf")
    bundle = compile_fp32(write_deepseek_gguf(checkpoint, tmp_path / "ds.gguf"), tmp_path / "bundle", stages=2)
    prompt = [1, 17, 42, 99, 5, 123, 77, 8, 250, 31, 64, 12, 90, 7, 201, 44, 3, 19, 160, 55]
    assert_greedy_like_hf(bundle, checkpoint, prompt, max_logit_diff=MAX_LOGIT_DIFF)


def test_deepseek_gguf_without_sigmoid_routing_refused(tmp_path: Path) -> None:
    """A deepseek2 file stating no expert_gating_func (DeepSeek-V2's, which llama.cpp routes by softmax) is refused."""
    checkpoint = write_random_checkpoint(DEEPSEEK["plain_q"], tmp_path / "hf")
    with pytest.raises(UnsupportedArchitectureError, match=r"expert_gating_func=1 .*sigmoid routing only"):
        open_gguf(write_deepseek_gguf(checkpoint, tmp_path / "ds.gguf", gating=None))


def test_llama4_gguf_equals_its_checkpoint_and_compiles_to_its_tokens(tmp_path: Path) -> None:
    """Llama 4 as llama.cpp writes it (gate_up_proj split in halves and transposed, down_proj transposed, the dense
    width as feed_forward_length): every tensor equals the source checkpoint's; the config describes the source's
    model with what llama.cpp fixes (chunks of 8192, every 4th layer NoPE, temperature 8192/0.1, q/k norms); compiled
    to 2 fp32 stages (stateful) it greedy-decodes transformers' tokens from the source, logits within 1e-4."""
    checkpoint = write_random_checkpoint(Family(llama4_config), tmp_path / "hf")
    path = write_llama4_gguf(checkpoint, tmp_path / "llama4.gguf")
    assert_equals_source(open_gguf(path), checkpoint)
    bundle = compile_fp32(path, tmp_path / "bundle", stages=2)
    prompt = [1, 17, 42, 99, 5, 123, 77]
    assert_greedy_like_hf(bundle, checkpoint, prompt, max_logit_diff=MAX_LOGIT_DIFF)


def test_llama4_gguf_without_chunks_refused(tmp_path: Path) -> None:
    """A llama4 file stating attention.sliding_window 0 (MobileLLM's: no chunks, no NoPE layers) is refused."""
    checkpoint = write_random_checkpoint(Family(llama4_config), tmp_path / "hf")
    with pytest.raises(UnsupportedArchitectureError, match=r"without chunked attention.*safetensors"):
        open_gguf(write_llama4_gguf(checkpoint, tmp_path / "llama4.gguf", chunked=False))
