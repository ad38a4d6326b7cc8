"""Where each tensor of a GGUF file lies under its Hugging Face name, and what undoes llama.cpp's conversion.

llama.cpp's ``convert_hf_to_gguf.py`` renames tensors and rearranges some; each :class:`GGUFTensor` says
which stored bytes a Hugging Face tensor is and how to turn them back, as transformers' GGUF loader does:

- llama: q and k rows permuted into llama.cpp's rotary layout (``permute``); undone per head;
- Gemma 2/3: RMSNorm scales stored as ``1 + w``; Hugging Face keeps ``w`` (and adds the 1 at run time);
- mixture of experts (qwen2moe, qwen3moe, Mixtral as llama): each projection's experts stacked in one
  [E, out, in] tensor; each expert is read as its own slab of it;
- gpt-oss and Llama 4: their experts' x @ W tensors split into gate and up and transposed; joined back into
  Hugging Face's ``gate_up_proj`` (gate and up interleaved; Llama 4's in halves) and ``down_proj`` when read.
- DeepSeek-V3: MLA's ``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and ``attn_v_b``; joined back;
- GLM-4.5 and DeepSeek-V3: the routing bias ``e_score_correction_bias`` spelled ``exp_probs_b.bias``;
- GLM-4.5: the next-token-prediction layers appended after the model's (``blk.N`` from the model's layer count
  on, ``nextn_predict_layers``) are skipped.

Pure bookkeeping over the tensor table: :mod:`ovshard.frontend.gguf` decodes the bytes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ovshard.errors import CheckpointError
from ovshard.frontend.arch import ArchSpec
from ovshard.frontend.gguf_config import GGUFFamily
from ovshard.frontend.tensors import MLA_NAMES, model_tensors

if TYPE_CHECKING:
    from gguf import GGUFReader

    from ovshard.bundle.dims import ModelDims

logger = logging.getLogger(__name__)

LAYOUT_VERSION = "ovshard-gguf-1"  # bump when a tensor's undo changes: it is part of every tensor digest
PER_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")  # experts unstacked (old llama.cpp)
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rope factors: read into the config, not a model tensor


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file under its Hugging Face name, and what undoes llama.cpp's conversion."""

    gguf_name: str
    index: int  # in the reader's tensor list
    ggml_type: str  # "Q4_K", "Q8_0", "F32" ...
    shape: tuple[int, ...]  # Hugging Face (torch) order: [out_features, in_features]
    begin: int  # absolute byte range in the file
    end: int
    norm_offset: bool = False  # stored 1 + w
    permute_heads: int | None = None  # rows permuted per head into llama.cpp's rotary layout
    expert: int | None = None  # one expert's [out, in] slab of a stacked [E, out, in] tensor (ffn_*_exps)
    first_row: int = 0  # where its rows start in that slab (up's half of a fused ffn_gate_up_exps expert)
    transposed: bool = False  # held by Hugging Face as x @ W: the stored tensor's last two axes swapped
    interleaved: GGUFTensor | None = None  # its rows alternate with this tensor's (gate, up, gate, up ...)
    halves: GGUFTensor | None = None  # its rows, then this tensor's (Llama 4's gate, then up)
    # each head's rows followed by this tensor's rows of that head: MLA's kv_b, stored per head as k_b [rank, nope]
    # (transposed) and v_b [v, rank]
    appended: GGUFTensor | None = None

    @property
    def undo(self) -> str:
        """The transform, as a string for digests."""
        undo = f"norm_offset={self.norm_offset};permute_heads={self.permute_heads};expert={self.expert}"
        if self.first_row:
            undo += f";first_row={self.first_row}"
        if self.transposed:
            undo += ";transposed"
        if self.interleaved is not None:
            undo += f";interleaved={self.interleaved.gguf_name}"
        if self.halves is not None:
            undo += f";halves={self.halves.gguf_name}"
        if self.appended is not None:
            undo += f";appended={self.appended.gguf_name}"
        return undo

    @property
    def parts(self) -> tuple[GGUFTensor, ...]:
        """The stored tensors its values come from."""
        return (self, *(t for t in (self.interleaved, self.halves, self.appended) if t is not None))

    @property
    def joined(self) -> bool:
        """Rearranged from the stored tensor (transposed, or joined with others), not one of its slabs."""
        return self.transposed or len(self.parts) > 1


def refuse_unread_expert_layouts(path: Path, reader: GGUFReader, spec: ArchSpec) -> None:
    """Refuse the expert layouts not read: one tensor an expert (``blk.N.ffn_gate.E.weight``, llama.cpp's layout
    before it stacked experts), and gate and up fused (``ffn_gate_up_exps``) for a family that holds its experts
    stacked itself (gpt-oss: ``_join_experts`` interleaves separate gate and up tensors)."""
    old = [t.name for t in reader.tensors if PER_EXPERT.fullmatch(t.name)]
    if old:
        raise CheckpointError(
            f"{path} stores its experts one tensor each ({len(old)} tensors such as {old[0]}), the layout of "
            "llama.cpp conversions from before April 2024; ovshard reads experts stacked (blk.N.ffn_gate_exps). "
            "Convert the model again with a current llama.cpp's convert_hf_to_gguf.py, or start from the "
            "safetensors checkpoint.")
    fused = next((t.name for t in reader.tensors if t.name.endswith(".ffn_gate_up_exps.weight")), None)
    if fused and spec.stacked_experts:
        raise CheckpointError(
            f"{path} holds its experts' gate and up projections fused ({fused}, convert_hf_to_gguf.py "
            f"--fuse-gate-up-exps), which ovshard splits for families of one matrix an expert only, not "
            f"{spec.family}'s. Convert the model again without --fuse-gate-up-exps, or start from the safetensors "
            "checkpoint.")


def map_tensors(reader: GGUFReader, arch: str, family: GGUFFamily, spec: ArchSpec, dims: ModelDims,
                 ) -> tuple[dict[str, GGUFTensor], tuple[str, ...]]:
    """GGUF tensors under their Hugging Face names (gguf-py's name table, as transformers uses it)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch)
    names = get_tensor_name_map(arch_id, dims.num_layers)
    hf_names = [*model_tensors(spec, dims), spec.lm_head]
    to_hf = {names.get_name(_spelled(n), try_suffixes=(".weight", ".bias")): n for n in hf_names}
    to_hf.pop(None, None)  # a name the table lacks: validate_tensors reports it missing
    # a parameter Hugging Face names without a suffix (gpt-oss's sinks) llama.cpp stores as <name>.weight
    to_hf |= {f"{g}.weight": n for g, n in to_hf.items() if not n.endswith((".weight", ".bias"))}
    if spec.mla:  # MLA's kv_b as current llama.cpp writes it, split per head: _join_kv_b names it
        to_hf |= {f"blk.{i}.attn_{k}_b.weight": f"blk.{i}.attn_{k}_b.weight" for i in range(dims.num_layers)
                  for k in ("k", "v")}
    if spec.moe:  # stacked experts keep their GGUF name here; _split_experts and _join_experts name them
        to_hf |= {f"blk.{i}.{kind}.{suffix}": f"blk.{i}.{kind}.{suffix}" for i in range(dims.num_layers)
                  for kind in _STACKED for suffix in ("weight", "bias")}
    norms = {t.format(i=i) for t in spec.norm_templates() for i in range(dims.num_layers)} | {spec.final_norm}
    heads = {spec.q_proj.format(i=i): dims.num_heads for i in range(dims.num_layers)}
    heads |= {spec.k_proj.format(i=i): dims.num_kv_heads for i in range(dims.num_layers)}
    mtp = _mtp_layers(reader, arch, dims)
    tensors, unmapped, skipped = {}, [], 0
    for index, t in enumerate(reader.tensors):
        hf = to_hf.get(t.name)
        if hf is None:
            if t.name.startswith(mtp):
                skipped += 1
            elif t.name != ROPE_FREQS:  # read into rope_parameters
                unmapped.append(t.name)
            continue
        module = hf.rsplit(".", 1)[0]
        tensors[hf] = GGUFTensor(
            gguf_name=t.name, index=index, ggml_type=t.tensor_type.name,
            shape=tuple(int(d) for d in reversed(t.shape.tolist())), begin=int(t.data_offset),
            end=int(t.data_offset) + int(t.n_bytes), norm_offset=family.norm_offset and hf in norms,
            permute_heads=heads.get(module) if family.permute_qk else None,
        )
    if skipped:
        logger.info("%s: %d tensors of the next-token-prediction layers %s not read (ovshard decodes without "
                    "them)", reader.data.filename, skipped, ", ".join(m.rstrip(".") for m in mtp))
    return _join_kv_b(_join_experts(_split_experts(tensors, spec, dims), spec, dims), spec, dims), tuple(unmapped)


# Hugging Face names that convert_hf_to_gguf.py spells otherwise before looking them up in gguf-py's table:
# DeepSeek-V3's and GLM-4.5's routing bias (a parameter without a suffix) becomes exp_probs_b.bias
_SPELLED = {"e_score_correction_bias": "e_score_correction.bias"}


def _spelled(name: str) -> str:
    return next((name.removesuffix(end) + spelled for end, spelled in _SPELLED.items() if name.endswith(end)), name)


def _mtp_layers(reader: GGUFReader, arch: str, dims: ModelDims) -> tuple[str, ...]:
    """The tensor name prefixes ("blk.46.") of the next-token-prediction layers convert_hf_to_gguf.py appends
    after the model's own (GLM-4.5's; ``{arch}.nextn_predict_layers`` of the ``block_count``): not read."""
    field = reader.fields.get(f"{arch}.block_count")
    blocks = dims.num_layers if field is None else int(field.contents())
    return tuple(f"blk.{i}." for i in range(dims.num_layers, blocks))


# each stacked GGUF tensor and the expert projections it holds, in the order of its rows: convert_hf_to_gguf.py
# --fuse-gate-up-exps writes one ffn_gate_up_exps [E, 2 * size, hidden] a layer, each expert's gate rows first
_STACKED = {"ffn_gate_exps": ("expert_gate",), "ffn_up_exps": ("expert_up",), "ffn_down_exps": ("expert_down",),
            "ffn_gate_up_exps": ("expert_gate", "expert_up")}


def _split_experts(tensors: dict[str, GGUFTensor], spec: ArchSpec, dims: ModelDims) -> dict[str, GGUFTensor]:
    """Each stacked expert tensor (``blk.N.ffn_gate_exps`` [E, out, in], mapped under its own GGUF name) as one
    entry an expert under the checkpoint's names, each its byte slab of the file (rows stay whole blocks)."""
    out = {}
    shared_gates = {spec.shared_expert_gate.format(i=i) + ".weight" for i in range(dims.num_layers)} \
        if spec.shared_expert_gate else set()
    for name, t in tensors.items():
        if name in shared_gates and len(t.shape) == 1:  # llama.cpp stores the [1, hidden] gate as [hidden]
            t = replace(t, shape=(1, *t.shape))
        kind = t.gguf_name.split(".")[-2] if t.gguf_name.startswith("blk.") else ""
        found = [getattr(spec, p) for p in _STACKED[kind]] if kind in _STACKED and spec.moe else [None]
        templates = [str(f) for f in found if f is not None]
        if len(templates) < len(found):  # not stacked experts, or stacked as the family holds them (gpt-oss)
            out[name] = t
            continue
        layer, experts, parts = int(t.gguf_name.split(".")[1]), t.shape[0], len(templates)
        slab, rows = (t.end - t.begin) // experts // parts, t.shape[1] // parts  # one projection of one expert
        for e in range(experts):
            for p, template in enumerate(templates):
                hf = template.replace("{i}", str(layer)).replace("{e}", str(e)) + ".weight"
                begin = t.begin + (e * parts + p) * slab
                out[hf] = replace(t, shape=(rows, *t.shape[2:]), begin=begin, end=begin + slab, expert=e,
                                  first_row=p * rows)
    return out


def _join_experts(tensors: dict[str, GGUFTensor], spec: ArchSpec, dims: ModelDims) -> dict[str, GGUFTensor]:
    """gpt-oss's and Llama 4's experts under Hugging Face's names: they hold each layer's as x @ W tensors, gate and
    up in one (``gate_up_proj`` [E, hidden, 2 * size], gate and up alternating along the last axis (Llama 4: gate
    the first half, ``spec.stacked_halves``), and gpt-oss's bias
    [E, 2 * size]; ``down_proj`` [E, size, hidden]); llama.cpp's converter splits and transposes them into
    ``ffn_{gate,up,down}_exps`` [E, out, in] with biases [E, out]. A stacked tensor missing from the file leaves
    its Hugging Face name missing, for validate_tensors to report."""
    if not spec.stacked_experts:
        return tensors
    out = dict(tensors)
    for i in range(dims.num_layers):
        prefix = spec.stacked_experts.format(i=i)
        stored = {f"{kind}.{suffix}": out.pop(f"blk.{i}.ffn_{kind}_exps.{suffix}", None)
                  for kind in ("gate", "up", "down") for suffix in ("weight", "bias")}
        gate, up, down, gate_bias, up_bias, down_bias = (stored[k] for k in (
            "gate.weight", "up.weight", "down.weight", "gate.bias", "up.bias", "down.bias"))
        if gate is not None and up is not None:
            experts, size, hidden = gate.shape
            halves, interleaved = (up, None) if spec.stacked_halves else (None, up)
            out[prefix + ".gate_up_proj"] = replace(gate, shape=(experts, hidden, 2 * size), transposed=True,
                                                    interleaved=interleaved, halves=halves)
        if gate_bias is not None and up_bias is not None:
            out[prefix + ".gate_up_proj_bias"] = replace(gate_bias, shape=(gate_bias.shape[0], 2 * gate_bias.shape[1]),
                                                         interleaved=up_bias)
        if down is not None:
            out[prefix + ".down_proj"] = replace(down, shape=(down.shape[0], down.shape[2], down.shape[1]),
                                                 transposed=True)
        if down_bias is not None:
            out[prefix + ".down_proj_bias"] = down_bias
    return out


def _join_kv_b(tensors: dict[str, GGUFTensor], spec: ArchSpec, dims: ModelDims) -> dict[str, GGUFTensor]:
    """MLA's ``kv_b_proj`` [heads * (nope + v), rank] (each head's key rows, then its value rows), which current
    llama.cpp writes split for its absorbed attention: ``attn_k_b`` [heads, rank, nope] (each head's key rows
    transposed) and ``attn_v_b`` [heads, v, rank]. A file of the older layout holds ``attn_kv_b`` whole."""
    if not spec.mla:
        return tensors
    out = dict(tensors)
    for i in range(dims.num_layers):
        k_b, v_b = (out.pop(f"blk.{i}.attn_{k}_b.weight", None) for k in ("k", "v"))
        if k_b is None or v_b is None:  # the older layout, or missing: validate_tensors names what is
            continue
        heads, rank, nope = k_b.shape
        out[f"{spec.mla.format(i=i)}.{MLA_NAMES['kv_b'][0]}.weight"] = replace(
            k_b, shape=(heads * (nope + v_b.shape[1]), rank), transposed=True, appended=v_b)
    return out


def permutation(rows: int, heads: int) -> np.ndarray:
    """Row r of a Hugging Face q/k projection is row ``perm[r]`` of llama.cpp's.

    convert_hf_to_gguf.py's ``permute`` interleaves each head's two rotary halves:
    [heads, 2, half] -> [heads, half, 2]; reading the rows back through ``perm`` undoes it.
    """
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
