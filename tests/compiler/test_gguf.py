"""GGUF files as checkpoints: config, tensor names and values against transformers' own GGUF loader.

Tiny files written with ``gguf.GGUFWriter`` the way llama.cpp's ``convert_hf_to_gguf.py`` writes them
(:mod:`dense_gguf`, :mod:`moe_gguf`); the real Gemma 3 270M is test_gguf_real_gemma.py's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dense_gguf import FAMILIES, assert_config_matches, dims_of, hf_reading, hf_weights, write_gguf
from families import Family, as_saved_state, write_random_checkpoint
from moe_gguf import gpt_oss_config, mixtral_config, write_gpt_oss_gguf, write_mixtral_gguf

from ovshard.errors import CheckpointError, UnsupportedArchitectureError
from ovshard.frontend.description import describe
from ovshard.frontend.gguf import GGUFCheckpoint, open_gguf

pytestmark = pytest.mark.slow


# ---- the tiny families against transformers ------------------------------------------------------

def test_qwen3moe_experts_match_transformers_tensor_by_tensor(tmp_path: Path) -> None:
    """A qwen3moe GGUF (Q8_0 experts stacked in ffn_*_exps, an f32 router ffn_gate_inp): the config, and every
    expert's matrix read as its slab of the stacked tensor, equal transformers' reading of the same file."""
    d = dims_of("qwen3", head_dim=16)
    experts, size = 4, 768  # transformers reads no expert size from a GGUF: its default, 768, must be the file's
    weights = {n: w for n, w in hf_weights("qwen3", head_dim=16).items() if ".mlp." not in n}
    rng = np.random.default_rng(1)
    stacked = {}
    for i in range(d["layers"]):
        stacked[f"blk.{i}.ffn_gate_inp.weight"] = rng.standard_normal((experts, d["hidden"])).astype(np.float32)
        for kind, shape in (("gate", (size, d["hidden"])), ("up", (size, d["hidden"])), ("down", (d["hidden"], size))):
            stacked[f"blk.{i}.ffn_{kind}_exps.weight"] = rng.standard_normal((experts, *shape)).astype(np.float32)
    meta = {"{arch}.expert_count": experts, "{arch}.expert_used_count": 2, "{arch}.expert_feed_forward_length": size}
    path = write_gguf(tmp_path / "moe.gguf", "qwen3", weights, qtype="Q8_0", meta=meta, extra=stacked, arch="qwen3moe",
                      dims=d)
    ckpt = open_gguf(path)
    ckpt.validate_tensors()
    config, state = hf_reading(path)
    assert_config_matches(ckpt.config, config)
    assert (ckpt.dims.num_experts, ckpt.dims.experts_per_token, ckpt.dims.expert_size) == (experts, 2, size)
    saved = as_saved_state(state, "qwen3_moe")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in ckpt.tensor_names()
    for name in ckpt.tensor_names():
        assert torch.equal(ckpt.load(name), saved[name]), name


def test_fused_gate_up_experts_read_as_the_split_ones(tmp_path: Path) -> None:
    """convert_hf_to_gguf.py --fuse-gate-up-exps stores a layer's expert gate and up in one ffn_gate_up_exps
    [E, 2 * size, hidden], each expert's gate rows first: a qwen3moe file so written (Q8_0) reads tensor for
    tensor as the same experts written split; gpt-oss files so written are refused, saying how to convert."""
    d = dims_of("qwen3", head_dim=16)
    experts, size = 4, 64
    weights = {n: w for n, w in hf_weights("qwen3", head_dim=16).items() if ".mlp." not in n}
    rng = np.random.default_rng(3)
    split, fused = {}, {}
    for i in range(d["layers"]):
        router = rng.standard_normal((experts, d["hidden"])).astype(np.float32)
        gate, up = (rng.standard_normal((experts, size, d["hidden"])).astype(np.float32) for _ in range(2))
        down = rng.standard_normal((experts, d["hidden"], size)).astype(np.float32)
        common = {f"blk.{i}.ffn_gate_inp.weight": router, f"blk.{i}.ffn_down_exps.weight": down}
        split |= common | {f"blk.{i}.ffn_gate_exps.weight": gate, f"blk.{i}.ffn_up_exps.weight": up}
        fused |= common | {f"blk.{i}.ffn_gate_up_exps.weight": np.concatenate([gate, up], axis=1)}
    meta = {"{arch}.expert_count": experts, "{arch}.expert_used_count": 2, "{arch}.expert_feed_forward_length": size}
    one, two = (open_gguf(write_gguf(tmp_path / f"{name}.gguf", "qwen3", weights, qtype="Q8_0", meta=meta, extra=extra,
                                     arch="qwen3moe", dims=d)) for name, extra in (("split", split), ("fused", fused)))
    two.validate_tensors()
    assert sorted(two.tensor_names()) == sorted(one.tensor_names())
    for name in one.tensor_names():
        assert torch.equal(two.load(name), one.load(name)), name
    assert two.nbytes("model.layers.1.mlp.experts.3.up_proj.weight") == one.nbytes("model.layers.1.mlp.experts.3.up_proj.weight")
    checkpoint = write_random_checkpoint(Family(gpt_oss_config), tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"fused \(blk\.0\.ffn_gate_up_exps\.weight.*without --fuse-gate-up-exps"):
        open_gguf(write_gpt_oss_gguf(checkpoint, tmp_path / "gpt-oss.gguf", fuse_gate_up=True))


def test_qwen2moe_shared_expert_matches_transformers(tmp_path: Path) -> None:
    """A qwen2moe GGUF: routed experts (ffn_*_exps) and the shared expert (ffn_*_shexp, its gate stored 1-D)
    equal transformers' reading of the same file, tensor by tensor."""
    d = dims_of("qwen2")
    experts, size, shared = 4, 1408, 5632  # transformers reads neither size from a GGUF: its defaults
    weights = {n: w for n, w in hf_weights("qwen2").items() if ".mlp." not in n}
    rng = np.random.default_rng(2)
    h = d["hidden"]
    extra = {}
    for i in range(d["layers"]):
        extra[f"blk.{i}.ffn_gate_inp.weight"] = rng.standard_normal((experts, h)).astype(np.float32)
        extra[f"blk.{i}.ffn_gate_inp_shexp.weight"] = rng.standard_normal(h).astype(np.float32)
        for kind, shape in (("gate", (size, h)), ("up", (size, h)), ("down", (h, size))):
            extra[f"blk.{i}.ffn_{kind}_exps.weight"] = rng.standard_normal((experts, *shape)).astype(np.float32)
        for kind, shape in (("gate", (shared, h)), ("up", (shared, h)), ("down", (h, shared))):
            extra[f"blk.{i}.ffn_{kind}_shexp.weight"] = rng.standard_normal(shape).astype(np.float32)
    meta = {"{arch}.expert_count": experts, "{arch}.expert_used_count": 2, "{arch}.expert_feed_forward_length": size,
            "{arch}.expert_shared_feed_forward_length": shared}
    path = write_gguf(tmp_path / "moe.gguf", "qwen2", weights, meta=meta, extra=extra, arch="qwen2moe", dims=d)
    ckpt = open_gguf(path)
    ckpt.validate_tensors()
    config, state = hf_reading(path)
    assert_config_matches(ckpt.config, config)
    assert ckpt.dims.shared_expert_size == shared and not ckpt.block.norm_topk
    saved = as_saved_state(state, "qwen2_moe")
    for name in ckpt.tensor_names():
        assert torch.equal(ckpt.load(name), saved[name]), name


@pytest.fixture(scope="module")
def mixtral_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(Family(mixtral_config), tmp_path_factory.mktemp("mixtral"))


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_mixtral_gguf_equals_its_checkpoint(tmp_path: Path, mixtral_checkpoint: Path, qtype: str) -> None:
    """Mixtral as llama.cpp writes it ("llama" with expert_count, q/k permuted, experts stacked): every tensor equals
    the source checkpoint's (F32 bit for bit, Q8_0 its quantize-dequantize round trip); the config describes the
    source's model (no sliding window, renormalized top-k)."""
    import gguf
    from safetensors.torch import load_file

    ckpt = open_gguf(write_mixtral_gguf(mixtral_checkpoint, tmp_path / "mixtral.gguf", qtype))
    ckpt.validate_tensors()
    assert_describes_source(ckpt.config, mixtral_checkpoint)
    assert ckpt.dims.model_type == "mixtral" and ckpt.block.norm_topk and ckpt.dims.num_experts == 4
    saved = load_file(mixtral_checkpoint / "model.safetensors")
    assert set(ckpt.tensor_names()) == set(saved)
    kind = gguf.GGMLQuantizationType[qtype]
    for name, w in saved.items():
        if w.ndim == 2 and qtype != "F32" and not name.endswith("block_sparse_moe.gate.weight"):  # router kept f32
            w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), kind), kind))
        assert torch.equal(ckpt.load(name), w), name


def assert_describes_source(config: dict[str, Any], source: Path) -> None:
    """``config`` (read from a GGUF) describes the model of the checkpoint ``source``, whose eps the file holds as f32."""
    theirs = json.loads((source / "config.json").read_text())
    theirs["rms_norm_eps"] = float(np.float32(theirs["rms_norm_eps"]))
    ours, hf = describe(config), describe(theirs)
    assert (ours.arch, ours.dims, ours.block, dict(ours.rope)) == (hf.arch, hf.dims, hf.block, dict(hf.rope))


@pytest.mark.parametrize("qtype", ["F32", "MXFP4"])
def test_gpt_oss_gguf_equals_its_checkpoint(tmp_path: Path, qtype: str) -> None:
    """gpt-oss as llama.cpp writes it (experts split into ffn_{gate,up,down}_exps [E, out, in], biases split, sinks as
    attn_sinks.weight): gate_up_proj re-interleaved and every other tensor equal the source checkpoint's (F32 bit for
    bit, MXFP4 experts their quantize-dequantize round trip); the config describes the source's model (sliding and
    full layers alternating, yarn, clamped SwiGLU). transformers 5 cannot read these files (it fails parsing the
    yarn keys), so the source is the reference."""
    import gguf
    from safetensors.torch import load_file

    checkpoint = write_random_checkpoint(Family(gpt_oss_config), tmp_path / "hf")
    ckpt = open_gguf(write_gpt_oss_gguf(checkpoint, tmp_path / "gpt-oss.gguf", qtype))
    ckpt.validate_tensors()
    assert_describes_source(ckpt.config, checkpoint)
    assert ckpt.block.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert ckpt.block.swiglu_limit == 7.0 and ckpt.block.attention_sinks
    saved = load_file(checkpoint / "model.safetensors")
    assert set(ckpt.tensor_names()) == set(saved)
    kind = gguf.GGMLQuantizationType[qtype]
    for name, w in saved.items():
        if w.ndim == 3 and qtype != "F32":  # stored [E, out, in]: quantization blocks run along in
            rows = w.transpose(1, 2).contiguous().numpy()
            w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(rows, kind), kind)).transpose(1, 2)
        assert torch.equal(ckpt.load(name), w), name
    gate_up = "model.layers.1.mlp.experts.gate_up_proj_bias"
    assert torch.equal(ckpt.load_rows(gate_up, 1, 3), saved[gate_up][1:3])


def test_gpt_oss_tokenizer_export(tmp_path: Path) -> None:
    """A gpt-oss GGUF's BPE vocabulary exports (transformers' AutoTokenizer fails on the file, reading its yarn keys)
    and encodes by the file's merges."""
    from transformers import AutoTokenizer

    tokens = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ġs", "th"]
    tokens += [f"<|reserved_{i}|>" for i in range(len(tokens), 320)]  # up to the eos id, 319
    checkpoint = write_random_checkpoint(Family(gpt_oss_config), tmp_path / "hf")
    path = write_gpt_oss_gguf(checkpoint, tmp_path / "gpt-oss.gguf", vocabulary=(tokens, ["Ġ s", "t h"]))
    with pytest.raises(TypeError):  # transformers 5.25's bug this sidesteps
        AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert "tokenizer.json" in open_gguf(path).export_tokenizer(tmp_path / "out")
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("the cat sat").input_ids == [28, 4, 26, 2, 0, 19, 27, 0, 19]


def test_mixtral_unstacked_experts_refused(tmp_path: Path) -> None:
    """A Mixtral GGUF of llama.cpp's old layout (one tensor an expert, blk.N.ffn_gate.E) is refused: convert again."""
    meta = {"{arch}.expert_count": 4, "{arch}.expert_used_count": 2}
    extra = {f"blk.0.ffn_{k}.{e}.weight": np.zeros((4, 4), np.float32) for k in ("gate", "up", "down") for e in range(4)}
    with pytest.raises(CheckpointError, match=r"12 tensors such as blk.0.ffn_gate.0.weight.*current llama.cpp"):
        open_gguf(write_gguf(tmp_path / "old.gguf", "llama", hf_weights("llama"), meta=meta, extra=extra))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(tmp_path: Path, family: str) -> None:
    """Config and every tensor (Q8_0 matrices) equal what transformers reads from the same GGUF file."""
    path = write_gguf(tmp_path / f"{family}.gguf", family, hf_weights(family), qtype="Q8_0")
    ckpt = open_gguf(path)
    ckpt.validate_tensors()
    config, state = hf_reading(path)
    assert_config_matches(ckpt.config, config)
    assert set(ckpt.tensor_names()) <= set(state)
    for name in ckpt.tensor_names():
        assert torch.equal(ckpt.load(name), state[name]), name


def test_llama_permutation_undone_exactly(tmp_path: Path) -> None:
    """Float32 llama q/k rows come back in Hugging Face order, bit for bit, from llama.cpp's permuted layout."""
    weights = hf_weights("llama")
    ckpt = open_gguf(write_gguf(tmp_path / "llama.gguf", "llama", weights))
    for name, w in weights.items():
        assert torch.equal(ckpt.load(name), torch.from_numpy(w)), name


def test_gemma_norms_stored_plus_one(tmp_path: Path) -> None:
    """Gemma norm scales (llama.cpp's 1 + w) come back as Hugging Face's w; other tensors are untouched."""
    weights = hf_weights("gemma3")
    ckpt = open_gguf(write_gguf(tmp_path / "gemma3.gguf", "gemma3", weights))
    for name, w in weights.items():
        expected = (w + 1) - 1 if name.endswith("norm.weight") else w  # float32 rounding of the round trip
        assert torch.equal(ckpt.load(name), torch.from_numpy(expected)), name


@pytest.mark.parametrize("qtype", ["Q8_0", "F16"])
def test_load_rows_equals_rows_of_load(tmp_path: Path, qtype: str) -> None:
    """load_rows returns the same rows as load, for quantized and half tensors and permuted q/k rows alike."""
    ckpt = open_gguf(write_gguf(tmp_path / "llama.gguf", "llama", hf_weights("llama"), qtype=qtype))
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "lm_head.weight"):
        whole = ckpt.load(name)
        for start, end in ((0, 3), (5, 17), (whole.shape[0] - 1, whole.shape[0])):
            assert torch.equal(ckpt.load_rows(name, start, end), whole[start:end]), (name, start, end)


def test_reader_fields_equal_gguf_reader(tmp_path: Path) -> None:
    """The faster reader yields the metadata and tensor bytes gguf.GGUFReader does."""
    import gguf

    from ovshard.frontend.gguf_reader import reader_class

    path = write_gguf(tmp_path / "llama.gguf", "llama", hf_weights("llama"), qtype="Q8_0")
    writer_extra = gguf.GGUFWriter(str(tmp_path / "arrays.gguf"), "llama")
    writer_extra.add_token_list([f"tok{i}" for i in range(50)])
    writer_extra.add_token_scores([float(i) / 3 for i in range(50)])
    writer_extra.add_token_types([i % 4 for i in range(50)])
    writer_extra.write_header_to_file()
    writer_extra.write_kv_data_to_file()
    writer_extra.close()
    for p in (path, tmp_path / "arrays.gguf"):
        ours, theirs = reader_class()(p), gguf.GGUFReader(p)
        assert {k: f.contents() for k, f in ours.fields.items()} == {k: f.contents() for k, f in theirs.fields.items()}
        for a, b in zip(ours.tensors, theirs.tensors, strict=True):
            assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
            assert np.array_equal(a.data, b.data)


def test_fingerprint_and_digests(tmp_path: Path) -> None:
    """The fingerprint is stable across opens and follows the metadata; a tensor digest follows its bytes."""
    weights = hf_weights("qwen3")
    first = open_gguf(write_gguf(tmp_path / "a.gguf", "qwen3", weights))
    again = open_gguf(tmp_path / "a.gguf")
    assert first.fingerprint() == again.fingerprint() and first.fingerprint().startswith("sha256:")
    other = open_gguf(write_gguf(tmp_path / "b.gguf", "qwen3", weights, meta={"{arch}.context_length": 512}))
    assert other.fingerprint() != first.fingerprint()
    name = "model.layers.0.mlp.up_proj.weight"
    assert other.tensor_digest(name) == first.tensor_digest(name)
    weights[name] = weights[name] * 2
    changed = open_gguf(write_gguf(tmp_path / "c.gguf", "qwen3", weights))
    assert changed.tensor_digest(name) != first.tensor_digest(name)
    assert changed.tensor_digest("model.norm.weight") == first.tensor_digest("model.norm.weight")


def test_quantized_file_reports_and_warns_only_where_it_is_compressed_again(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A quantized file reports its types; the compile's format rules warn that two quantizations' errors compound
    where its weights are compressed again in another form (a Q8_0 file to INT4), and not where they are kept as
    float (--weights fp16) or as they are (an all-Q4_1 decoder in int4_affine groups of 32); a float file never."""
    from dataclasses import replace

    from ovshard.bundle.weights import WeightFormat
    from ovshard.compile import CompileConfig
    from ovshard.compile_config import source_weights

    def warned(source: Path, **config: object) -> bool:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            default = CompileConfig(checkpoint=source, output=tmp_path / "out", weights_from_source=True)
            source_weights(replace(default, **config), open_gguf(source))
        return any("compounds the two quantization errors" in r.getMessage() for r in caplog.records)

    q8 = write_gguf(tmp_path / "q.gguf", "llama", hf_weights("llama"), qtype="Q8_0")
    quant = open_gguf(q8).source_quantization
    assert quant.file_type == "Q8_0" and quant.quantized
    assert dict(quant.tensor_types) == {"Q8_0": 16, "F32": 5}
    assert warned(q8) and not warned(q8, weights=WeightFormat("fp16"), weights_from_source=False)
    assert not warned(write_gguf(tmp_path / "q41.gguf", "llama", hf_weights("llama"), qtype="Q4_1"))
    plain = write_gguf(tmp_path / "f.gguf", "llama", hf_weights("llama"), qtype="F16")
    assert not warned(plain) and not open_gguf(plain).source_quantization.quantized


def test_llama3_rope_table_read_as_llama3_parameters(tmp_path: Path) -> None:
    """Llama 3's rope_freqs table becomes llama3 rope_parameters; a table they do not reproduce is refused."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=params)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    table = (plain / scaled).numpy().astype(np.float32)  # llama.cpp divides each frequency by its factor
    ckpt = open_gguf(write_gguf(tmp_path / "l3.gguf", "llama", hf_weights("llama"), extra={"rope_freqs.weight": table}))
    assert ckpt.config["rope_parameters"] == params
    ckpt.validate_tensors()
    table[3] *= 1.5
    with pytest.raises(UnsupportedArchitectureError, match="rope_freqs"):
        open_gguf(write_gguf(tmp_path / "bad.gguf", "llama", hf_weights("llama"), extra={"rope_freqs.weight": table}))


def test_yarn_rope_scaling_read(tmp_path: Path) -> None:
    """llama.cpp's yarn keys (Qwen's long-context files) become yarn rope_parameters."""
    meta = {"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
            "{arch}.rope.scaling.original_context_length": 32768}
    ckpt = open_gguf(write_gguf(tmp_path / "q.gguf", "qwen2", hf_weights("qwen2"), meta=meta))
    assert ckpt.config["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 32768, "beta_fast": 32.0,
                                              "beta_slow": 1.0}
    assert ckpt.dims.rope_type == "yarn"


def test_gemma_27b_query_scale(tmp_path: Path) -> None:
    """Gemma 3 27B (62 layers) scales queries by hidden / heads as llama.cpp does; the others by head_dim."""
    d = dims_of("gemma3", layers=62, heads=2, kv_heads=1, head_dim=16)
    ckpt = open_gguf(write_gguf(tmp_path / "g27.gguf", "gemma3", hf_weights("gemma3", **d), dims=d))
    assert ckpt.config["query_pre_attn_scalar"] == 32 and ckpt.block.attention_scale == 32 ** -0.5
    d = dims_of("gemma3", heads=2, kv_heads=1, head_dim=16)
    ckpt = open_gguf(write_gguf(tmp_path / "g.gguf", "gemma3", hf_weights("gemma3", **d), dims=d))
    assert ckpt.config["query_pre_attn_scalar"] == 16


def test_gemma_rope_scaling_and_generation_ids(tmp_path: Path) -> None:
    """Linear rope scaling applies to Gemma 3's full layers only; eos and end-of-turn both end generation."""
    meta = {"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 8.0, "tokenizer.ggml.eot_token_id": 106}
    ckpt = open_gguf(write_gguf(tmp_path / "g.gguf", "gemma3", hf_weights("gemma3"), meta=meta))
    assert ckpt.config["rope_parameters"] == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0},
    }
    assert ckpt.generation_config == {"eos_token_id": [2, 106], "bos_token_id": 1}


CHATML_GGUF = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def chatml_gguf(path: Path) -> Path:
    """A tiny qwen3 GGUF with a BPE vocabulary whose last three tokens are control tokens, and a ChatML template."""
    tokens = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ġt", "th", "<|endoftext|>", "<|im_start|>",
                                                               "<|im_end|>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.chat_template": CHATML_GGUF,
            "tokenizer.ggml.eot_token_id": 31}
    return write_gguf(path, "qwen3", hf_weights("qwen3"), meta=meta, tokenizer=(tokens, ["Ġ t", "t h"], [1] * 29 + [3] * 3))


def test_tokenizer_export_with_chat_template(tmp_path: Path) -> None:
    """A BPE tokenizer and chat template export as transformers reads them; a file without one is refused."""
    from transformers import AutoTokenizer

    template = CHATML_GGUF
    path = chatml_gguf(tmp_path / "q.gguf")
    ckpt = open_gguf(path)
    assert ckpt.has_tokenizer and "chat_template.jinja" in ckpt.export_tokenizer(tmp_path / "out")
    exported = AutoTokenizer.from_pretrained(tmp_path / "out")
    direct = AutoTokenizer.from_pretrained(tmp_path, gguf_file="q.gguf")
    assert exported("the cat sat").input_ids == direct("the cat sat").input_ids
    assert exported.chat_template == template
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == [2, 31]
    bare = open_gguf(write_gguf(tmp_path / "bare.gguf", "qwen3", hf_weights("qwen3")))
    with pytest.raises(CheckpointError, match="no tokenizer"):
        bare.export_tokenizer(tmp_path / "bare")


def test_gguf_chat_template_reaches_the_chat_record(tmp_path: Path) -> None:
    """The file's tokenizer.chat_template becomes the bundle's chat_template.jinja, and <|im_end|> (a control
    token written after each message) the end of a turn."""
    from ovshard.frontend.tokenizer import convert_tokenizer

    ckpt = open_gguf(chatml_gguf(tmp_path / "q.gguf"))
    (tmp_path / "out").mkdir()
    files, chat = convert_tokenizer(ckpt.tokenizer_folder(tmp_path / "scratch"), tmp_path / "out")
    assert chat is not None and chat.end_of_turn_ids == (31,) and chat.template in files
    assert (tmp_path / "out" / chat.template).read_text() == CHATML_GGUF


def test_open_source_tells_gguf_from_folders(tmp_path: Path) -> None:
    """A .gguf name or GGUF bytes (an Ollama blob has no suffix) open as GGUF; anything else as a folder."""
    from ovshard.frontend.source import open_source

    path = write_gguf(tmp_path / "m.gguf", "qwen3", hf_weights("qwen3"))
    blob = tmp_path / "sha256-0123abcd"
    blob.write_bytes(path.read_bytes())
    assert isinstance(open_source(path), GGUFCheckpoint) and isinstance(open_source(blob), GGUFCheckpoint)
    with pytest.raises(CheckpointError, match="expected a Hugging Face model directory"):
        open_source(tmp_path / "no-such-model")


# ---- refusals ---------------------------------------------------------------------------------------

def test_missing_folder_and_foreign_files(tmp_path: Path) -> None:
    """A missing path, a folder and a file that is not GGUF are refused with what was expected."""
    with pytest.raises(CheckpointError, match="missing; expected a .gguf file"):
        open_gguf(tmp_path / "none.gguf")
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(CheckpointError, match="is a folder"):
        open_gguf(tmp_path / "dir.gguf")
    (tmp_path / "text.gguf").write_text("<html>404 Not Found</html>")
    with pytest.raises(CheckpointError, match="not a GGUF file: it starts with b'<htm'"):
        open_gguf(tmp_path / "text.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        open_gguf(tmp_path / "empty.gguf")


def test_truncated_file_refused(tmp_path: Path) -> None:
    """A file cut anywhere (header, metadata, tensor table, tensor data) is a CheckpointError, not a traceback."""
    whole = write_gguf(tmp_path / "whole.gguf", "qwen2", hf_weights("qwen2"), qtype="Q8_0").read_bytes()
    for cut in (6, 30, 200, len(whole) // 3, len(whole) - 1):
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(CheckpointError, match="truncated or corrupt"):
            open_gguf(tmp_path / "cut.gguf")


def test_unsupported_architectures_refused(tmp_path: Path) -> None:
    """An architecture outside the table, and experts in an architecture read dense only, name what is supported."""
    with pytest.raises(UnsupportedArchitectureError, match=r"architecture 'phi2'.*deepseek2, gemma2, gemma3, glm4moe, gpt-oss, llama, llama4, qwen2, qwen2moe, qwen3, qwen3moe"):
        open_gguf(write_gguf(tmp_path / "phi2.gguf", "llama", hf_weights("llama"), arch="phi2"))
    with pytest.raises(UnsupportedArchitectureError, match=r"mixture-of-experts.*deepseek2, glm4moe, gpt-oss, llama \(mixtral\), llama4, qwen2moe, qwen3moe"):
        open_gguf(write_gguf(tmp_path / "moe.gguf", "qwen2", hf_weights("qwen2"), meta={"{arch}.expert_count": 8}))
    with pytest.raises(UnsupportedArchitectureError, match="rope.scaling.type='longrope'"):
        open_gguf(write_gguf(tmp_path / "lr.gguf", "llama", hf_weights("llama"),
                             meta={"{arch}.rope.scaling.type": "longrope"}))


def test_incomplete_or_foreign_tensors_refused(tmp_path: Path) -> None:
    """A missing layer tensor or a tensor no Hugging Face name maps to fails validate_tensors by name."""
    weights = hf_weights("qwen3")
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(CheckpointError, match=r"lacks 1 of the .* model.layers.1.mlp.down_proj.weight"):
        open_gguf(write_gguf(tmp_path / "short.gguf", "qwen3", weights)).validate_tensors()
    extra = {"v.blk.0.attn_q.weight": np.zeros((4, 4), np.float32)}
    with pytest.raises(CheckpointError, match="does not use, e.g. v.blk.0.attn_q.weight"):
        open_gguf(write_gguf(tmp_path / "extra.gguf", "qwen3", hf_weights("qwen3"), extra=extra)).validate_tensors()
