"""The numerical half of ``ovshard verify --reference``: a bundle against its Hugging Face source.

Compares, on one prompt: hidden states at every stage boundary and logits (prefill, teacher-forced
over the reference's greedy continuation), the free-running greedy tokens, and with ``--perplexity``
the perplexity of a text, the top-1 tokens along it (``ovshard.verify.perplexity``) and the bundle's
stored bits per parameter. Thresholds depend on the weight format: fp32 bundles run with f32 hints must
match exactly (hidden states and logits within 1e-5 of their own scale, max |diff| / max(1, max |ref|),
and every token but those at a near-tie: a step where the reference's top-2 margin is at most twice the
logit error measured there, so the two floats can order a tie either way); compressed bundles run with
the device's default hints and are judged on agreement and on their perplexity increase. The reference is
a Hugging Face folder or a ``.gguf`` file (transformers' own reading of it). Needs ``ovshard[compile]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ovshard.bundle import names
from ovshard.bundle.manifest import Manifest
from ovshard.errors import ConfigError
from ovshard.frontend.arch import ARCHITECTURES
from ovshard.plan.costs import bits_per_parameter, parameter_count
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.verify import perplexity
from ovshard.verify.rows import Row


@dataclass(frozen=True)
class Thresholds:
    """Pass bars for one weight format (docs/verify.md, "Thresholds by weight format")."""

    max_rel_logits: float | None  # logits: max |diff| / max(1, max |reference|); None: reported only
    agreement: float  # teacher-forced top-1 agreement, on the greedy continuation and along the text
    exact_hints: bool  # f32 hints, and partings only counted where the reference's margin is no near-tie
    perplexity_increase: float  # the bundle's perplexity at most (1 + this) x the reference's
    max_rel_hidden: float | None = None  # hidden states: max |diff| / max(1, max |reference|)


THRESHOLDS = {
    "fp32": Thresholds(1e-5, 1.0, True, 1e-4, 1e-5),
    "fp16": Thresholds(None, 0.95, False, 0.005),
    "int8": Thresholds(None, 0.90, False, 0.01),
    "int4_sym": Thresholds(None, 0.70, False, 0.04),
    "int4_asym": Thresholds(None, 0.70, False, 0.04),
    "int4_affine": Thresholds(None, 0.70, False, 0.04),
}


@dataclass(frozen=True)
class VerifyText:
    """``--perplexity TEXT`` and its chunk length (None: 512, or the bundle's positions when fewer)."""

    path: Path
    context: int | None = None


def load_reference(checkpoint: Path) -> tuple[Any, Any]:
    """The float32 Hugging Face model and its tokenizer (None when the checkpoint has none)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    checkpoint = Path(checkpoint)
    where: dict[str, Any] = {"pretrained_model_name_or_path": checkpoint}
    if checkpoint.suffix == ".gguf":
        where = {"pretrained_model_name_or_path": checkpoint.parent, "gguf_file": checkpoint.name}
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


def _greedy(model: Any, prompt_ids: list[int], tokens: int):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0)
        sequence = out[0].tolist()
        full = model(torch.tensor([sequence]), output_hidden_states=True)
    hidden = [h[0].numpy() for h in full.hidden_states]  # [embeddings, after layer 1, ...], each [T, H]
    return sequence, full.logits[0].numpy(), hidden


def numerical_rows(bundle: Path, m: Manifest, checkpoint: Path, prompt: str, tokens: int,
                   text: VerifyText | None = None) -> list[Row]:
    limits = THRESHOLDS[m.weights.mode]
    model, tokenizer = load_reference(checkpoint)
    prompt_ids = tokenizer(prompt)["input_ids"] if tokenizer is not None else m.generation.start_ids
    sequence, ref_logits, ref_hidden = _greedy(model, prompt_ids, tokens)
    pipe = LocalPipeline(bundle, config=EXACT_HINTS if limits.exact_hints else None, verify=False)
    logits, boundaries = pipe.forward(sequence)  # teacher-forced over prompt + reference tokens
    hints = "f32 hints" if limits.exact_hints else "default hints"
    rows = []
    for entry, hidden in zip(m.stages, boundaries, strict=False):
        ref = ref_hidden[entry.layers[1]]
        rel = float(np.abs(hidden[0] - ref).max()) / max(1.0, float(np.abs(ref).max()))
        check = f"max |diff| / max(1, max |ref|) hidden states after layer {entry.layers[1]} ({hints})"
        rows.append(_bound_row(entry.index, check, rel, limits.max_rel_hidden))
    scale = max(1.0, float(np.abs(ref_logits).max()))
    rel = float(np.abs(logits - ref_logits).max()) / scale
    rows.append(_bound_row(m.num_stages - 1, f"max |diff| / max(1, max |ref|) logits ({hints}; max |ref| "
                           f"{scale:.3g})", rel, limits.max_rel_logits))
    steps = range(len(prompt_ids) - 1, len(sequence) - 1)
    # the reference's choice at each step is its own forward pass's argmax: its generate() ran with
    # min_new_tokens, which holds an end-of-text token back, so its tokens there are not its top-1
    choice = {t: int(ref_logits[t].argmax()) for t in steps}
    # near-ties excuse a parting only where the logits passed their bound: wrong numbers excuse nothing
    trusted = limits.exact_hints and limits.max_rel_logits is not None and rel <= limits.max_rel_logits
    ties = {t for t in steps if _near_tie(ref_logits[t], logits[t])} if trusted else set()
    counted = [t for t in steps if logits[t].argmax() == choice[t] or t not in ties]
    agree = float(np.mean([logits[t].argmax() == choice[t] for t in counted])) if counted else 1.0
    tied = f", {len(steps) - len(counted)} near-tie steps left out" if len(counted) < len(steps) else ""
    rows.append(Row(None, f"greedy top-1 agreement over {tokens} tokens{tied}", f">= {limits.agreement:.0%}",
                    f"{agree:.1%}", "pass" if agree >= limits.agreement else "FAIL"))
    free, _ = pipe.generate_greedy(prompt_ids, tokens)
    reference = sequence[len(prompt_ids):]
    prefix = next((i for i, (a, b) in enumerate(zip(free, reference, strict=True)) if a != b), tokens)
    exact = limits.exact_hints
    found = f"{prefix}/{tokens} identical before the first difference"
    t = len(prompt_ids) - 1 + prefix  # up to the parting both ran the same tokens: the teacher-forced row
    excused = ""
    if prefix < tokens and t in ties:
        excused = (f" (a near-tie: the reference's top-2 margin {_margin(ref_logits[t]):.2e} <= 2 x the logit "
                   f"error there, {float(np.abs(logits[t] - ref_logits[t]).max()):.2e})")
    elif prefix < tokens and trusted and free[prefix] == choice[t] != reference[prefix]:
        excused = (f" (where the reference's generate() was held past its own top-1, token {choice[t]}: "
                   f"min_new_tokens holds back an end of text)")
    rows.append(Row(None, "free-running greedy tokens equal to the reference's", f"{tokens}/{tokens}" if exact
                    else "reported", found + excused, "pass" if prefix == tokens or not exact or excused else "FAIL"))
    if text is not None:
        rows += perplexity_rows(pipe, m, model, tokenizer, text, limits)
        rows.append(bits_row(bundle, m))
    return rows


def _margin(row: np.ndarray) -> float:
    top2 = np.partition(row, -2)[-2:]
    return float(top2[1] - top2[0])


def _near_tie(ref_row: np.ndarray, row: np.ndarray) -> bool:
    """Whether the reference's top-2 margin at this step is within what the measured logit error can swap:
    each of the two logits may move by the row's max |diff|, so a margin up to twice that."""
    return _margin(ref_row) <= 2.0 * float(np.abs(row - ref_row).max())


def weight_bytes(bundle: Path, m: Manifest) -> int:
    """Bytes of the stages' weight files less the rotary tables each stage stores (constants the precompute
    pass computed from the positions, not parameters)."""
    import xml.etree.ElementTree as ET

    total = 0
    for entry in m.stages:
        total += (Path(bundle) / entry.model_bin).stat().st_size
        for _, layer in ET.iterparse(Path(bundle) / entry.model_xml):
            if layer.tag == "layer" and layer.get("type") == "Const" and layer.get("name") == names.ROTARY_TABLE:
                data = layer.find("data")
                total -= int(data.get("size", 0)) if data is not None else 0
    return total


def bits_row(bundle: Path, m: Manifest) -> Row:
    """The bundle's stored bits per parameter, every parameter counted once (a tied embedding's second copy
    left out), as llama.cpp's files are measured."""
    spec = ARCHITECTURES[m.architecture.model_type]
    bits = bits_per_parameter(weight_bytes(bundle, m), spec, m.architecture, m.weights, m.num_stages)
    return Row(None, "stored bits per parameter (each once)", "reported",
               f"{bits:.2f} ({parameter_count(spec, m.architecture) / 1e6:.1f}M parameters)", "pass")


def perplexity_rows(pipe: LocalPipeline, m: Manifest, model: Any, tokenizer: Any, text: VerifyText,
                    limits: Thresholds) -> list[Row]:
    import torch

    if tokenizer is None:
        raise ConfigError("--perplexity needs the reference's tokenizer, and the checkpoint has none")
    context = text.context or min(perplexity.DEFAULT_CONTEXT, pipe.max_positions)
    if context > pipe.max_positions:
        raise ConfigError(f"--perplexity-context {context} exceeds the bundle's {pipe.max_positions} "
                                     f"positions: give at most {pipe.max_positions}")
    ids = tokenizer(perplexity.read_text(text.path))["input_ids"]
    chunks = perplexity.chunks(ids, context, m.generation.bos_token_id)

    def bundle_logits(chunk: list[int]) -> np.ndarray:
        pipe.reset()
        return pipe.forward(chunk)[0]

    def reference_logits(chunk: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([chunk])).logits[0].numpy()

    ours, ref = perplexity.score(bundle_logits, chunks), perplexity.score(reference_logits, chunks)
    increase = ours.perplexity / ref.perplexity - 1
    where = f"{Path(text.path).name}: {len(chunks)} chunks of {context}, second halves ({len(ours.nll)} tokens)"
    top1 = float(np.mean(ours.top1 == ref.top1))
    return [
        Row(None, f"perplexity over {where}", f"<= reference +{limits.perplexity_increase:.2%}",
            f"{ours.perplexity:.4f} vs {ref.perplexity:.4f} ({increase:+.2%})",
            "pass" if increase <= limits.perplexity_increase else "FAIL"),
        Row(None, "top-1 agreement along the text (teacher-forced)", f">= {limits.agreement:.0%}", f"{top1:.1%}",
            "pass" if top1 >= limits.agreement else "FAIL"),
    ]


def _bound_row(stage: int, check: str, value: float, bound: float | None) -> Row:
    if bound is None:
        return Row(stage, check, "reported", f"{value:.2e}", "pass")
    return Row(stage, check, f"<= {bound:.0e}", f"{value:.2e}", "pass" if value <= bound else "FAIL")
