"""The fastest llama.cpp that runs on this CPU: built native, with AMX where its kernels run, else without.

llama.cpp built with ``GGML_NATIVE=ON`` on a CPU that reports AMX compiles its AMX kernels in. On some Xeons
under KVM the kernel lets the process ask for the AMX tiles and the first ``tilezero`` still dies with SIGILL
(seen on a 2-core Xeon: ``tinygemm_kernel_amx<block_q8_1, block_q4_1>``). So a build is checked with a one-token
run on the model about to be measured; a build that dies by a signal is replaced by one built with
``-mno-amx-tile -mno-amx-int8 -mno-amx-bf16`` (into ``build-noamx``), and the choice is reported beside every
figure. A CPU without AMX gets the native build unchecked.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


@dataclass(frozen=True)
class LlamaBuild:
    """A built tree: its binaries and what was built, in words."""

    tree: Path
    bins: Path
    label: str

    def tool(self, name: str) -> Path:
        return self.bins / name


def build(tree: Path, targets: tuple[str, ...], folder: str = "build", extra_flags: str = "",
          log=print) -> Path:  # noqa: ANN001  (a message sink)
    """``targets`` built native into ``tree/folder`` (once); returns the folder's bin/."""
    bins = tree / folder / "bin"
    if all((bins / t).is_file() for t in targets):
        return bins
    log(f"building llama.cpp into {folder} ({extra_flags or 'native'})")
    flags = [f"-DCMAKE_C_FLAGS={extra_flags}", f"-DCMAKE_CXX_FLAGS={extra_flags}"] if extra_flags else []
    if "llama-server" not in targets:
        flags.append("-DLLAMA_BUILD_SERVER=OFF")  # its web UI's sources need not be there
    subprocess.run(["cmake", "-B", folder, "-DGGML_RPC=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *flags],
                   cwd=tree, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", folder, "-j", str(os.cpu_count() or 2), "--target", *targets], cwd=tree,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return bins


def one_token_runs(bins: Path, gguf: Path) -> bool:
    """Whether ``llama-bench`` reads a 16-token prompt of ``gguf`` and makes one token without dying (a signal:
    SIGILL at an AMX op; AMX kernels run on prompts)."""
    done = subprocess.run([str(bins / "llama-bench"), "-m", str(gguf), "-p", "16", "-n", "1", "-r", "1", "-t", "1"],
                          capture_output=True, text=True)
    return done.returncode == 0


def fastest(tree: Path, targets: tuple[str, ...], probe: Path, log=print) -> LlamaBuild:  # noqa: ANN001
    """The native build where it runs ``probe`` (AMX in it when the CPU has AMX), else the one without AMX."""
    bins = build(tree, targets, log=log)
    from ovshard.runtime.engine.cpu import cpu_flags

    if "amx_tile" not in cpu_flags():
        return LlamaBuild(tree, bins, "native build (this CPU has no AMX)")
    if one_token_runs(bins, probe):
        return LlamaBuild(tree, bins, "native build with AMX (checked: a one-token run works)")
    log("llama.cpp's AMX build dies on this CPU (a one-token run); building it without AMX")
    bins = build(tree, targets, "build-noamx", NO_AMX_FLAGS, log=log)
    return LlamaBuild(tree, bins, f"native build without AMX ({NO_AMX_FLAGS}: the AMX build dies here)")
