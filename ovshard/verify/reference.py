"""The numerical half of ``ovshard verify --reference``: a bundle against its Hugging Face source.

Compares, on one prompt: hidden states at every stage boundary and logits (prefill), and greedy
tokens over N steps. Thresholds depend on the weight format: fp32 bundles run with f32 hints must
match exactly (1e-4 and every token); compressed bundles run with the device's default hints and
are judged on teacher-forced top-1 agreement (random weights say nothing about INT4 accuracy, so
the INT4 bar is low and real-model accuracy needs real evaluation). Needs ``ovshard[compile]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ovshard.bundle.manifest import Manifest
from ovshard.runtime.local import LocalPipeline
from ovshard.runtime.stage import EXACT_HINTS
from ovshard.verify.rows import Row


@dataclass(frozen=True)
class Thresholds:
    max_abs_diff: float | None  # on boundary hidden states and logits; None: reported only
    agreement: float  # share of greedy steps where the bundle's top-1 equals the reference's
    exact_hints: bool


THRESHOLDS = {
    "fp32": Thresholds(1e-4, 1.0, True),
    "fp16": Thresholds(None, 0.95, False),
    "int8": Thresholds(None, 0.90, False),
    "int4_sym": Thresholds(None, 0.70, False),
    "int4_asym": Thresholds(None, 0.70, False),
}


def _reference(checkpoint: Path, prompt_ids: list[int], tokens: int):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0)
        sequence = out[0].tolist()
        full = model(torch.tensor([sequence]), output_hidden_states=True)
    hidden = [h[0].numpy() for h in full.hidden_states]  # [embeddings, after layer 1, ...], each [T, H]
    return sequence, full.logits[0].numpy(), hidden


def _prompt_ids(checkpoint: Path, prompt: str, m: Manifest) -> list[int]:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(checkpoint)(prompt)["input_ids"]
    except (OSError, ValueError):
        return m.generation.start_ids


def numerical_rows(bundle: Path, m: Manifest, checkpoint: Path, prompt: str, tokens: int) -> list[Row]:
    limits = THRESHOLDS[m.weights.mode]
    prompt_ids = _prompt_ids(checkpoint, prompt, m)
    sequence, ref_logits, ref_hidden = _reference(checkpoint, prompt_ids, tokens)
    pipe = LocalPipeline(bundle, config=EXACT_HINTS if limits.exact_hints else None, verify=False)
    logits, boundaries = pipe.forward(sequence)  # teacher-forced over prompt + reference tokens
    hints = "f32 hints" if limits.exact_hints else "default hints"
    rows = []
    for entry, hidden in zip(m.stages, boundaries, strict=False):
        diff = float(np.abs(hidden[0] - ref_hidden[entry.layers[1]]).max())
        rows.append(_diff_row(entry.index, f"hidden states after layer {entry.layers[1]} ({hints})",
                              diff, limits))
    rows.append(_diff_row(m.num_stages - 1, f"logits ({hints})", float(np.abs(logits - ref_logits).max()),
                          limits))
    steps = range(len(prompt_ids) - 1, len(sequence) - 1)
    agree = float(np.mean([logits[t].argmax() == sequence[t + 1] for t in steps]))
    rows.append(Row(None, f"greedy top-1 agreement over {tokens} tokens", f">= {limits.agreement:.0%}",
                    f"{agree:.1%}", "pass" if agree >= limits.agreement else "FAIL"))
    return rows


def _diff_row(stage: int, check: str, diff: float, limits: Thresholds) -> Row:
    if limits.max_abs_diff is None:
        return Row(stage, f"max |diff| {check}", "reported", f"{diff:.2e}", "pass")
    ok = diff <= limits.max_abs_diff
    return Row(stage, f"max |diff| {check}", f"<= {limits.max_abs_diff:.0e}", f"{diff:.2e}",
                    "pass" if ok else "FAIL")
