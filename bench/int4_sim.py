#!/usr/bin/env python
"""The default INT4 compile simulated in torch, to try a change of format or choice in minutes, not a compile.

SmolLM2-135M's float weights (its Q4_1 GGUF dequantized by transformers, as ``bench/int4_frontier.py``'s
"float" rows read it) get what the default compile writes, as float32 copies: the decoder weights that
``ovshard.plan.precision`` keeps INT8 and the tied table in INT8 per row (NNCF's asymmetric form), every other
decoder weight symmetric INT4 fitted to its inputs on the shipped calibration text (``ovshard.frontend.int4_fit``,
the compile's own fit, in the groups NNCF's fallback gives its width). Perplexity against the float model on
``bench/texts/`` (chunks of 512 as ``llama-perplexity``). No OpenVINO: activations stay float32, so a row reads
about a point under the bundle's (the bundle's int8 activations and u8 KV cache); compare rows with each other.

Variants (``--variants``):
    default   the compile's default, as above
    asym      the INT4 weights asymmetric, fitted the same way (int4_fit.fit_asym)
    gptq      the INT4 codes chosen column by column with the calibration's error fed forward (GPTQ), the
              fit's scales
    kl        the INT8 weights chosen by the calibration's own loss instead of the weights alone: each weight
              quantized alone, the KL divergence of the model's next-token distribution on the calibration
              samples, the most per byte kept INT8 within the default's bytes
    g32       the default's INT8 weights, the INT4 ones fitted in groups of 32
    minmax    the default's INT8 weights, the INT4 ones data-free (min-max scales), in the default's groups
    down      only the down projections INT8, the rest as the default
    int4      no decoder weight INT8
    rare      the tied table's rarer half of its rows (the higher ids: BPE merges come in order of frequency) INT4,
              fitted to the lm_head's inputs, and the bytes that saves added to the INT8 choice's budget (the
              compile's own choice, more weights INT8)
    gGbB      e.g. g32b1.15: the INT4 weights fitted in groups of G (NNCF's fallback below it), the INT8 choice the
              compile's own for that format within B times the all-INT4 size (the scales of smaller groups paid
              from the same budget, so rows of one B hold the same bytes)

    CI=true .venv/bin/python bench/int4_sim.py [--variants default,asym,gptq,kl,g32b1.15] [--out bench/results]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import progress, write_results  # noqa: E402

TEXTS = ("apache-2.0", "story", "code", "dialogue")
VARIANTS = ("default", "asym", "gptq", "kl", "g32", "minmax", "down", "int4", "rare")
PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def linears(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Linear]]:
    """Every decoder projection as ("layer.key", module), the compile's INT8 keys."""
    for i, layer in enumerate(model.model.layers):
        for key, path in PROJECTIONS.items():
            module = layer
            for part in path.split("."):
                module = getattr(module, part)
            yield f"{i}.{key}", module


def group_for(width: int) -> int:
    """The default format's INT4 group over ``width`` inputs (NNCF's fallback where 128 does not divide it)."""
    from ovshard.bundle.weights import WeightFormat

    group = WeightFormat().group_for(width)
    if group is None:
        raise SystemExit(f"a {width}-wide weight has no INT4 group: this simulation covers INT4 weights only")
    return group


def parse_format(variant: str):  # -> WeightFormat | None
    """``gGbB`` as the INT4 format it names, None for any other variant."""
    import re

    from ovshard.bundle.weights import WeightFormat

    found = re.fullmatch(r"g(\d+)b(\d+(?:\.\d+)?)", variant)
    return WeightFormat(group_size=int(found[1]), budget=float(found[2])) if found else None


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """INT8 per row with a zero point (NNCF's INT8_ASYM), back in float32."""
    low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    scale = ((high - low) / 255).clamp_min(1e-12)
    zero = torch.round(-low / scale)
    return (torch.clamp(torch.round(w / scale) + zero, 0, 255) - zero) * scale


def fitted(w: torch.Tensor, x: torch.Tensor, asym: bool = False, group: int = 0) -> torch.Tensor:
    from ovshard.frontend.int4_fit import fit, fit_asym, second_moments

    moments = second_moments(x, group or group_for(w.shape[1]))
    if asym:
        codes, zeros, scales = fit_asym(w.contiguous(), moments)
        return ((codes.float() - zeros.float()) * scales.float()).reshape(w.shape)
    codes, scales = fit(w.contiguous(), moments)
    return (codes.float() * scales.float()).reshape(w.shape)


def minmax(w: torch.Tensor) -> torch.Tensor:
    from ovshard.frontend import int4_fit

    codes, scales = int4_fit.minmax(w.contiguous(), group_for(w.shape[1]))
    return (codes.float() * scales.float()).reshape(w.shape)


def gptq(w: torch.Tensor, x: torch.Tensor, damp: float = 0.01, block: int = 128) -> torch.Tensor:
    """Symmetric INT4 codes on the fit's scales, chosen a column at a time with each column's error spread over
    the columns after it through the inverse of the inputs' second moments (Frantar et al., GPTQ)."""
    from ovshard.frontend.int4_fit import fit, second_moments

    out, width = w.shape
    group = group_for(width)
    _, scales = fit(w.contiguous(), second_moments(x, group))
    scales = scales.float().reshape(out, width // group)
    h = x.T @ x / x.shape[0]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(width) + torch.diag((torch.diag(h) == 0).float())
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    w, q = w.clone(), torch.zeros_like(w)
    for start in range(0, width, block):
        end = min(start + block, width)
        part, errors, hb = w[:, start:end].clone(), torch.zeros(out, end - start), inverse[start:end, start:end]
        for i in range(end - start):
            s = scales[:, (start + i) // group]
            q[:, start + i] = torch.clamp(torch.round(part[:, i] / s), -8, 7) * s
            errors[:, i] = (part[:, i] - q[:, start + i]) / hb[i, i]
            part[:, i:] -= errors[:, i:i + 1] @ hb[i:i + 1, i:]
        w[:, end:] -= errors @ inverse[start:end, end:]
    return q


class Sim:
    """The float model, its calibration inputs and the default's INT8 choice, read once."""

    def __init__(self, gguf: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ovshard.bundle.weights import WeightFormat
        from ovshard.frontend.calibration import calibration_text
        from ovshard.frontend.source import open_source
        from ovshard.verify import perplexity

        torch.set_grad_enabled(False)
        ckpt = self.ckpt = open_source(gguf)
        with tempfile.TemporaryDirectory() as scratch:  # the tokenizer's files, for the calibration text
            samples = calibration_text(ckpt, "text", 4, 128, Path(scratch)).samples
        self.samples = [torch.tensor([s]) for s in samples]
        self.model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bos = tok.bos_token_id
        self.chunks = {t: perplexity.chunks(tok(perplexity.read_text(HERE / "texts" / f"{t}.txt"))["input_ids"], 512,
                                            bos) for t in TEXTS}
        self.float = {key: m.weight.clone() for key, m in linears(self.model)}
        self.int8 = set(self.choice(WeightFormat()))
        self.table = self.model.model.embed_tokens.weight.clone()
        self.inputs = self._capture()
        self.head_inputs = self.inputs.pop("head")
        self.reference = self.perplexities()

    def _capture(self) -> dict[str, torch.Tensor]:
        """Every projection's inputs [tokens, in] on the calibration samples, the float model's (the lm_head's
        as "head")."""
        caught: dict[str, list[torch.Tensor]] = {}
        hooks = [m.register_forward_hook(lambda _m, inp, _o, key=key: caught.setdefault(key, []).append(
            inp[0].reshape(-1, inp[0].shape[-1]))) for key, m in [*linears(self.model), ("head", self.model.lm_head)]]
        for sample in self.samples:
            self.model(sample)
        for hook in hooks:
            hook.remove()
        return {key: torch.cat(parts) for key, parts in caught.items()}

    def perplexities(self) -> dict[str, float]:
        from ovshard.verify import perplexity

        return {t: perplexity.score(lambda c: self.model(torch.tensor([c])).logits[0].numpy(), chunks).perplexity
                for t, chunks in self.chunks.items()}

    def apply(self, int8: set[str], int4: Callable[[str], torch.Tensor], int4_from: int | None = None) -> None:
        """The table INT8 per row (its rows from ``int4_from`` on INT4, fitted to the lm_head's inputs), ``int8``
        INT8, every other decoder weight ``int4(key)``."""
        table = int8_rows(self.table)
        if int4_from is not None:
            table[int4_from:] = fitted(self.table[int4_from:], self.head_inputs)
        self.model.model.embed_tokens.weight.copy_(table)
        for key, m in linears(self.model):
            m.weight.copy_(int8_rows(self.float[key]) if key in int8 else int4(key))

    def restore(self) -> None:
        self.model.model.embed_tokens.weight.copy_(self.table)
        for key, m in linears(self.model):
            m.weight.copy_(self.float[key])

    def choice(self, fmt) -> tuple[str, ...]:
        """The compile's INT8 choice for ``fmt`` (``ovshard.plan.precision.choose_int8``, over the checkpoint)."""
        from ovshard.plan.precision import choose_int8

        return choose_int8(self.ckpt, fmt)

    def bits(self, int8: set[str], fmt, int4_from: int | None = None) -> float:
        """Bits a parameter of the matrices as a one-stage bundle stores them (the tied table once: INT8, its rows
        from ``int4_from`` on INT4)."""
        from ovshard.bundle.weights import WeightFormat
        from ovshard.plan.precision import int4_bytes, int8_bytes

        rows, width = self.table.shape
        cut = rows if int4_from is None else int4_from
        table = int8_bytes(cut, width) + (int4_bytes(WeightFormat(), rows - cut, width) if cut < rows else 0.0)
        stored = table + sum(int8_bytes(*w.shape) if k in int8 else int4_bytes(fmt, *w.shape)
                             for k, w in self.float.items())
        return 8 * stored / (self.table.numel() + sum(w.numel() for w in self.float.values()))

    def kl_choice(self) -> set[str]:
        """The INT8 weights by the calibration's loss (module docstring), within the default's bytes."""
        import torch.nn.functional as F

        from ovshard.bundle.weights import WeightFormat
        from ovshard.plan.precision import int4_bytes, int8_bytes

        def divergence() -> float:
            return sum(float((r.exp() * (r - F.log_softmax(self.model(s).logits[0], -1))).sum(-1).mean())
                       for s, r in zip(self.samples, ref, strict=True)) / len(self.samples)

        ref = [F.log_softmax(self.model(s).logits[0], -1) for s in self.samples]
        loss = {}
        for n, (key, m) in enumerate(linears(self.model)):
            m.weight.copy_(fitted(self.float[key], self.inputs[key]))
            loss[key] = divergence()
            m.weight.copy_(self.float[key])
            progress(f"kl: {n + 1} of {len(self.float)} weights scored", "int4_sim")
        extra = {k: int8_bytes(*w.shape) - int4_bytes(WeightFormat(), *w.shape) for k, w in self.float.items()}
        allowed, chosen, spent = sum(extra[k] for k in self.int8), set(), 0.0
        for key in sorted(loss, key=lambda k: loss[k] / extra[k], reverse=True):
            if spent + extra[key] <= allowed:
                chosen.add(key)
                spent += extra[key]
        return chosen

    def rare_choice(self, int4_from: int) -> set[str]:
        """The compile's own INT8 choice (:meth:`choice`) with its budget raised by the bytes the table's rows from
        ``int4_from`` on save by being INT4."""
        from dataclasses import replace

        from ovshard.bundle.weights import WeightFormat
        from ovshard.plan.precision import BASE, all_int4_bytes, int4_bytes, int8_bytes

        rows, width = self.table[int4_from:].shape
        saved = int8_bytes(rows, width) - int4_bytes(WeightFormat(), rows, width)
        fmt = WeightFormat()
        return set(self.choice(replace(fmt, budget=fmt.budget + saved / all_int4_bytes(self.ckpt.dims, BASE))))


def run(sim: Sim, variant: str) -> dict:
    from ovshard.bundle.weights import WeightFormat

    began = time.perf_counter()
    half = sim.table.shape[0] // 2
    rare = half if variant == "rare" else None  # the table's rows from here on INT4
    fmt = parse_format(variant)
    int8 = {"kl": sim.kl_choice, "int4": set, "down": lambda: {k for k in sim.float if k.endswith(".down")},
            "rare": lambda: sim.rare_choice(half)}.get(variant, lambda: sim.int8)()
    if fmt is not None:
        int8 = set(sim.choice(fmt))
        sim.apply(int8, lambda key: fitted(sim.float[key], sim.inputs[key], group=fmt.group_for(sim.float[key].shape[1])))
    elif variant == "gptq":
        sim.apply(int8, lambda key: gptq(sim.float[key], sim.inputs[key]))
    elif variant == "minmax":
        sim.apply(int8, lambda key: minmax(sim.float[key]))
    else:
        sim.apply(int8, lambda key: fitted(sim.float[key], sim.inputs[key], asym=variant == "asym",
                                           group=32 if variant == "g32" else 0), rare)
    found = sim.perplexities()
    sim.restore()
    bits = sim.bits(int8, fmt or WeightFormat(group_size=32 if variant == "g32" else 128), rare)
    row = {"variant": variant, "int8_weights": len(int8), "bits_per_parameter": round(bits, 2)}
    row.update({t: f"{100 * (found[t] / sim.reference[t] - 1):+.1f}%" for t in TEXTS})
    return {**row, "seconds": round(time.perf_counter() - began, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {', '.join(VARIANTS)}")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS and parse_format(v) is None]
    if unknown:
        raise SystemExit(f"--variants {','.join(unknown)}: expected some of {', '.join(VARIANTS)}, or gGbB (e.g. "
                         "g32b1.15)")
    from int4_frontier import _smollm2_gguf

    sim = Sim(_smollm2_gguf())
    rows = []
    for variant in variants:
        progress(f"{variant} ...", "int4_sim")
        rows.append(run(sim, variant))
        progress(str(rows[-1]), "int4_sim")
    print(write_results("int4_sim", rows, {"reference": sim.reference}, out=args.out,
                        title="The default INT4 compile simulated in torch, SmolLM2-135M float: perplexity vs float"))


if __name__ == "__main__":
    main()
