"""A serving node needs only openvino, openvino-tokenizers and numpy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import compile_fp32

HEAVY = ("torch", "transformers", "nncf", "onnx", "networkx", "safetensors", "huggingface_hub")


def test_running_a_bundle_imports_no_compile_time_package(stories: Path, tmp_path: Path) -> None:
    """Running a bundle (plain and speculative), and importing every runtime module (found by walking the
    package, so a new module is covered by itself), leaves torch, transformers, nncf (and co.) unimported."""
    bundle = compile_fp32(stories, tmp_path / "b", stages=2)
    script = f"""
import importlib, pkgutil, sys
import ovshard.runtime
modules = [m.name for m in pkgutil.walk_packages(ovshard.runtime.__path__, "ovshard.runtime.")]
assert len(modules) > 40, modules
for name in modules:
    importlib.import_module(name)
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.decoding import speculative
from ovshard.runtime.engine import sampler
from ovshard.verify.fusion import check_cpu_fusion
pipe = LocalPipeline({str(bundle)!r})
tokens, _ = pipe.generate_greedy([1, 403, 407], 4)
assert len(tokens) == 4
spec = speculative.make_speculation("prompt-lookup", "auto", pipe.manifest)
assert len(list(pipe.generate([1, 403, 407, 403], sampler.SamplingConfig(max_tokens=6), None, spec))) == 6
check_cpu_fusion(pipe.bundle, pipe.manifest)
print(",".join(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"runtime imported {out.stdout.strip()}"


def test_the_command_line_starts_without_any_extra() -> None:
    """A node with the base install only (no compile, api, cluster or secure extra) gets its `ovshard` command:
    the parser of every subcommand builds, and `serve --help` answers, with none of those packages importable."""
    extras = ["torch", "transformers", "nncf", "onnx", "networkx", "safetensors", "gguf", "huggingface_hub", "starlette",
              "uvicorn", "jinja2", "prometheus_client", "ray", "cryptography"]
    script = f"""
import sys
for name in {extras!r}:
    sys.modules[name] = None  # an import of it raises ImportError, as on a node without the extra
from ovshard.cli import main
sys.exit(main(["serve", "--help"]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--stage" in out.stdout
