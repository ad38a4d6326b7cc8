"""The streamed compile: same numbers and weight formats as a whole-stage compile, chunked weights, the layer cache."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from ovshard.bundle.dims import ModelDims
from ovshard.bundle.stage import StageSpec
from ovshard.bundle.weights import WeightFormat
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.errors import PlanError
from ovshard.frontend import pieces
from ovshard.ir.pass_manager import PassContext, Piece
from ovshard.ir.splice import RowSplicer
from ovshard.passes import CompressWeightsPass
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.tools.synth import llama_config, write_checkpoint

pytestmark = pytest.mark.slow


PROMPT = [1, 403, 407, 261, 378]
FAST_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with its own lm_head, 6 layers (3 stages have a middle one)."""
    config = llama_config(tie_word_embeddings=False, num_hidden_layers=6, vocab_size=640, hidden_size=128,
                          intermediate_size=256, head_dim=32, rope_parameters=FAST_ROPE)
    return write_checkpoint(tmp_path_factory.mktemp("untied") / "ckpt", config)


@pytest.fixture(scope="module")
def cold(untied: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Reference bundles of ``untied`` (default INT4, no cache): 2 and 3 stages."""
    root = tmp_path_factory.mktemp("cold")
    for stages in (2, 3):
        compile_bundle(CompileConfig(untied, root / str(stages), stages=stages))
    return {2: root / "2", 3: root / "3"}


def weight_types(bundle: Path) -> Counter:
    """(stage file, element type, shape) of every weight-sized constant of the bundle's stages."""
    core, found = ov.Core(), Counter()
    for xml in sorted(bundle.glob("stage_*.xml")) + sorted(bundle.glob("openvino_model.xml")):
        for op in core.read_model(xml).get_ordered_ops():
            if op.get_type_name() == "Constant" and op.get_byte_size() >= 256:
                found[(xml.name, op.get_output_element_type(0).get_type_name(), tuple(op.get_output_shape(0)))] += 1
    return found


def greedy(bundle: Path, prompt: list[int] = PROMPT, tokens: int = 12) -> tuple[list[int], np.ndarray]:
    ids, rows = LocalPipeline(bundle, config=EXACT_HINTS).generate_greedy(prompt, tokens)
    return ids, np.stack(rows)


def both(checkpoint: Path, tmp: Path, **kwargs) -> tuple[Path, Path]:
    streamed, whole = tmp / "streamed", tmp / "whole"
    compile_bundle(CompileConfig(checkpoint, streamed, **kwargs))
    compile_bundle(CompileConfig(checkpoint, whole, streaming=False, **kwargs))
    return streamed, whole


@pytest.mark.parametrize("stages", [1, 3])
def test_streamed_fp32_equals_whole_stage(untied: Path, tmp_path: Path, stages: int) -> None:
    """fp32: a streamed compile gives the whole-stage compile's greedy tokens and logits (max |diff| <= 1e-5)."""
    streamed, whole = both(untied, tmp_path, stages=stages, weights=WeightFormat("fp32"))
    (a, la), (b, lb) = greedy(streamed), greedy(whole)
    assert a == b
    assert float(np.abs(la - lb).max()) <= 1e-5


def test_streamed_weights_have_the_whole_stage_formats(untied: Path, cold: dict[int, Path], tmp_path: Path) -> None:
    """Per-weight element types and shapes equal a whole-stage NNCF run's: INT8 on the embedding, the lm_head
    and the decoder weights the whole-model choice names, INT4 on the rest, however the stage is compiled."""
    compile_bundle(CompileConfig(untied, tmp_path / "whole", stages=3, streaming=False))
    assert weight_types(cold[3]) == weight_types(tmp_path / "whole")


def test_all_layers_formats_match_too(untied: Path, tmp_path: Path) -> None:
    """With all_layers the embedding and the lm_head are INT4 in both compiles alike."""
    streamed, whole = both(untied, tmp_path, stages=2, weights=WeightFormat(all_layers=True))
    assert weight_types(streamed) == weight_types(whole)


def test_tied_one_stage_keeps_one_shared_embedding(stories: Path, tmp_path: Path) -> None:
    """stories260K (tied) in one stage: the embedding and lm_head read one constant, as in a whole-stage compile."""
    streamed, whole = both(stories, tmp_path, stages=1)
    assert weight_types(streamed) == weight_types(whole)
    assert greedy(streamed)[0] == greedy(whole)[0]


@pytest.mark.parametrize(("mode", "cols"), [("int4_asym", 640), ("int4_sym", 256), ("int8", 256), ("fp16", 256)])
def test_row_chunks_splice_into_the_whole_weight(tmp_path: Path, mode: str, cols: int) -> None:
    """A matrix compressed in row chunks and spliced has the same constants, byte for byte, as compressed whole
    (640 columns: 5 INT4 groups a row, so packed 4-bit rows of zero points start mid-byte unless chunks are even)."""
    rows = np.random.default_rng(0).standard_normal((300, cols)).astype(np.float32)
    dims = ModelDims("llama", cols, 1, 2, 2, 8, 16, 300, 1e-5, False, False, False, 16, "default", 1e4)
    ctx = PassContext(StageSpec(0, 1, 0, 1), dims, 16, piece=Piece("layers", 0, 1))  # INT4: a head piece is INT8
    compress = CompressWeightsPass(WeightFormat(mode, group_size=128))

    def compressed(block: np.ndarray) -> tuple[ov.Model, ov.Output]:
        model, _ = pieces.head_chunk(block)
        model = compress(model, ctx).model
        return model, model.get_results()[0].input_value(0).get_node().input_value(1)

    whole, whole_weight = compressed(rows)
    splicer, keep = RowSplicer(300, tmp_path, "w"), []
    for start in range(0, 300, 64):
        model, weight = compressed(rows[start:start + 64])
        keep.append(model)
        splicer.add(start, weight)
    spliced = splicer.finish()

    def constants(out: ov.Output) -> list[bytes]:
        found, stack = [], [out.get_node()]
        while stack:
            node = stack.pop()
            if node.get_type_name() == "Constant":
                found.append((node.get_output_element_type(0).get_type_name(), tuple(node.get_output_shape(0)),
                              node.data.tobytes()))
            stack += [v.get_node() for v in node.input_values()]
        return sorted(found)

    assert constants(spliced) == constants(whole_weight)


def _bins(bundle: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(bundle.glob("*.bin"))
            if not p.name.startswith("openvino_")}


def test_cache_reuses_pieces_across_splits(untied: Path, cold: dict[int, Path], tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """2 stages then 3: every piece comes from the cache (a piece's bytes do not depend on the stage boundaries);
    the bundle equals a cold one."""
    cache = tmp_path / "cache"  # piece_bytes=1: one layer a piece, as for any layer over 16 MiB
    compile_bundle(CompileConfig(untied, tmp_path / "two", stages=2, cache_dir=cache, piece_bytes=1))
    with caplog.at_level("INFO", logger="ovshard.cache"):
        compile_bundle(CompileConfig(untied, tmp_path / "three", stages=3, cache_dir=cache, piece_bytes=1))
    reused = {line.split(" from ")[0].removeprefix("layer cache: ") for line in caplog.messages if " from " in line}
    # [0,3),[3,6) -> [0,2),[2,4),[4,6): no INT8 rule follows a stage's last layer
    assert reused == {"embedding", "head", *(f"layer {i}" for i in range(6))}
    assert _bins(tmp_path / "three") == _bins(cold[3])


def test_a_damaged_cache_entry_is_rebuilt(untied: Path, cold: dict[int, Path], tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """A cached piece whose bytes changed is detected by its sha256, removed and rebuilt; the bundle is right."""
    cache = tmp_path / "cache"
    compile_bundle(CompileConfig(untied, tmp_path / "a", stages=2, cache_dir=cache))
    victim = sorted(cache.glob("pieces/*/*/piece.bin"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="ovshard.cache"):
        compile_bundle(CompileConfig(untied, tmp_path / "b", stages=2, cache_dir=cache))
    assert any("is damaged" in m for m in caplog.messages)
    assert _bins(tmp_path / "a") == _bins(tmp_path / "b") == _bins(cold[2])


def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ovshard.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_a_killed_compile_resumes_from_its_finished_pieces(untied: Path, cold: dict[int, Path], tmp_path: Path) -> None:
    """SIGKILL mid-compile, then the same command: the pieces finished before the kill are reused."""
    cache, out = tmp_path / "cache", tmp_path / "b"
    args = ("compile", str(untied), "--stages", "2", "-o", str(out), "--cache-dir", str(cache))
    proc = _cli(*args)
    deadline = time.monotonic() + 300
    while len(list(cache.glob("pieces/*/*/entry.json"))) < 3 and time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the compile ended before it could be killed: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = len(list(cache.glob("pieces/*/*/entry.json")))
    assert not out.exists()
    again = _cli(*args)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    assert err.count("layer cache: ") >= finished
    assert _bins(out) == _bins(cold[2])


def test_two_concurrent_compiles_share_the_cache(untied: Path, cold: dict[int, Path], tmp_path: Path) -> None:
    """Two compiles of one checkpoint into one cache at once both succeed with the same stage weights."""
    cache = tmp_path / "cache"
    procs = [_cli("compile", str(untied), "--stages", "2", "-o", str(tmp_path / name), "--cache-dir", str(cache))
             for name in ("a", "b")]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    assert _bins(tmp_path / "a") == _bins(tmp_path / "b") == _bins(cold[2])
    assert not list((cache / "tmp").glob("*"))  # no half-written entry left


def test_parallel_jobs_give_the_same_bundle(untied: Path, cold: dict[int, Path], tmp_path: Path) -> None:
    """--jobs 2 (one layer a piece, in worker processes) writes the stage weights of one process, grouped."""
    compile_bundle(CompileConfig(untied, tmp_path / "jobs", stages=2, jobs=2, piece_bytes=1))
    assert _bins(tmp_path / "jobs") == _bins(cold[2])


def test_max_memory_below_one_layer_is_refused(untied: Path, tmp_path: Path) -> None:
    """--max-memory smaller than one layer's working set is a PlanError that says what one layer needs."""
    with pytest.raises(PlanError, match=r"cannot hold one layer of this model: compiling a layer needs about"):
        compile_bundle(CompileConfig(untied, tmp_path / "x", stages=2, max_memory=10_000_000))
    assert not (tmp_path / "x").exists()
