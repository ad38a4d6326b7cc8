"""Tiny dense Hugging Face checkpoints written as GGUF files the way llama.cpp's convert_hf_to_gguf.py writes
them (its names, its q/k row permutation for llama, Gemma's norms stored as ``1 + w``), and transformers' reading
of a GGUF file to compare with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ovshard.frontend.description import describe

# Hugging Face name -> llama.cpp name, per family (the names in llama.cpp's gguf-py tensor table)
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
LLAMA_NORMS = {"post_attention_layernorm": "ffn_norm"}
GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}

DIMS = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=128)
# transformers reads no head size for qwen3 and no query scale for Gemma: its defaults (128; 256, the head
# size of every Gemma but the 27B) are what these files must have for it to read them right
FAMILIES: dict[str, dict[str, Any]] = {  # GGUF architecture, and what the tiny model has
    "llama": dict(arch="llama", norms=LLAMA_NORMS, tied=False),
    "mistral": dict(arch="llama", norms=LLAMA_NORMS, tied=False, name="Mistral 7B Instruct"),
    "qwen2": dict(arch="qwen2", norms=LLAMA_NORMS, bias=True),
    "qwen3": dict(arch="qwen3", norms=LLAMA_NORMS, qk_norm=True, dims=dict(head_dim=128)),
    "gemma2": dict(arch="gemma2", norms=GEMMA_NORMS, gemma=True, dims=dict(head_dim=256)),
    "gemma3": dict(arch="gemma3", norms=GEMMA_NORMS, gemma=True, qk_norm=True, dims=dict(head_dim=256)),
}


def dims_of(family: str, **overrides: int) -> dict[str, int]:
    return DIMS | FAMILIES[family].get("dims", {}) | overrides


def hf_weights(family: str, seed: int = 0, **overrides: int) -> dict[str, np.ndarray]:
    """Random Hugging Face weights (float32) of a tiny model of ``family``."""
    f, d = FAMILIES[family], dims_of(family, **overrides)
    rng = np.random.default_rng(seed)
    q, kv, h = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"], d["hidden"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d["vocab"], h)}
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (d["ffn"], h), p + "mlp.up_proj.weight": (d["ffn"], h),
                   p + "mlp.down_proj.weight": (h, d["ffn"]), p + "input_layernorm.weight": (h,)}
        shapes |= {p + norm + ".weight": (h,) for norm in f["norms"]}
        if f.get("bias"):
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if f.get("qk_norm"):
            shapes |= {p + "self_attn.q_norm.weight": (d["head_dim"],), p + "self_attn.k_norm.weight": (d["head_dim"],)}
    shapes["model.norm.weight"] = (h,)
    if not f.get("tied", True):
        shapes["lm_head.weight"] = (d["vocab"], h)
    return {name: rng.standard_normal(shape).astype(np.float32) * 0.5 for name, shape in shapes.items()}


def gguf_name(family: str, hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, i, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{i}.{(LAYER_NAMES | FAMILIES[family]['norms'])[module]}.{suffix}"


def to_llama_cpp(family: str, hf: str, w: np.ndarray, d: dict[str, int]) -> np.ndarray:
    """What convert_hf_to_gguf.py does to a tensor: llama permutes q/k rows, Gemma stores norms as 1 + w."""
    if FAMILIES[family]["arch"] == "llama" and (".q_proj." in hf or ".k_proj." in hf):
        heads = d["heads"] if ".q_proj." in hf else d["kv_heads"]
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    if FAMILIES[family].get("gemma") and hf.endswith("norm.weight"):
        return w + 1
    return w


def write_gguf(path: Path, family: str, weights: dict[str, np.ndarray], qtype: str = "F32",
               meta: dict[str, Any] | None = None, extra: dict[str, np.ndarray] | None = None,
               arch: str | None = None, dims: dict[str, int] | None = None,
               tokenizer: tuple[list[str], list[str], list[int]] | None = None) -> Path:
    """A GGUF of ``weights`` (Hugging Face names) as llama.cpp writes one; matrices stored as ``qtype``."""
    import gguf

    f, d = FAMILIES[family], dims or dims_of(family)
    arch = arch or f["arch"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f.get("name", f"tiny {family}"))
    writer.add_block_count(d["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(d["hidden"])
    writer.add_feed_forward_length(d["ffn"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_key_length(d["head_dim"])
    writer.add_value_length(d["head_dim"])
    writer.add_rope_dimension_count(d["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(d["vocab"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType[f"MOSTLY_{qtype}"]))
    if f.get("gemma"):
        writer.add_sliding_window(32)
    if tokenizer is not None:  # (tokens, merges, token types)
        writer.add_token_list(tokenizer[0])
        writer.add_token_merges(tokenizer[1])
        writer.add_token_types(tokenizer[2])
    for key, value in (meta or {}).items():
        (writer.add_string if isinstance(value, str) else writer.add_float32 if isinstance(value, float)
         else writer.add_uint32)(key.format(arch=arch), value)
    kind = gguf.GGMLQuantizationType[qtype]
    for hf, w in weights.items():
        data = to_llama_cpp(family, hf, w, d)
        if data.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(family, hf), gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(family, hf), data)
    for name, data in (extra or {}).items():  # stacked experts (3-D) quantized like the matrices, as llama.cpp does
        if data.ndim == 3 and kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def saved_as_floats(gguf_file: Path, out: Path, dtype: str, tokenizer: bool = False) -> Path:
    """``gguf_file`` dequantized by transformers and saved as a safetensors checkpoint (with its tokenizer), as a
    user shares one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    fresh.load_state_dict(model.state_dict())
    fresh.save_pretrained(out)
    if tokenizer:
        AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(out)
    return out


def hf_reading(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """transformers' config and float32 state dict of a GGUF file."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.config.to_dict(), model.state_dict()


def assert_config_matches(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Every key both configs set agrees, and ovshard reads the same model off either."""
    differ = {k: (v, theirs[k]) for k, v in ours.items() if k in theirs and theirs[k] != v}
    assert not differ, f"config keys (ours, transformers') differ: {differ}"
    mine, hf = describe(ours), describe(theirs)
    assert (mine.arch, mine.dims, mine.block, dict(mine.rope)) == (hf.arch, hf.dims, hf.block, dict(hf.rope))
