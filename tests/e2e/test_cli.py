"""The ``ovshard`` command line: help, compile/inspect happy paths, and every refusal is clear and atomic.

Refusals exit 2 with ``ovshard <cmd>: error: ...`` on stderr, no traceback, and leave no bundle (or
``.<name>.*.partial`` temp folder) behind. One stories260K bundle, compiled once in a real subprocess
with every dump flag, serves the inspect tests; the other compiles use tiny random checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ovshard.bundle.checked import CHECKED_FOLDER, CheckedFiles
from ovshard.bundle.manifest import Manifest, read_manifest, verify_files
from ovshard.cli import main
from ovshard.errors import BundleError
from ovshard.frontend.checkpoint import INDEX_FILE, open_checkpoint
from ovshard.passes import WeightFormat, pipeline
from ovshard.runtime.node.worker import StageWorker
from ovshard.tools.synth import llama_config, write_checkpoint

pytestmark = pytest.mark.e2e


OVSHARD = [sys.executable, "-m", "ovshard.cli"]
PASSES = [p.name for p in pipeline(WeightFormat("fp32"))]
# default rope: PrecomputeRotaryPass is several times faster than with the synth default (llama3)
FAST_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def tiny(path: Path, max_shard_bytes: int | None = None) -> Path:
    """A 4-layer random Llama checkpoint, ours to break (stories260K is read only)."""
    return write_checkpoint(path, llama_config(rope_parameters=FAST_ROPE), max_shard_bytes=max_shard_bytes)


def cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    """Run ``ovshard argv`` in process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def compile_args(checkpoint: Path, output: Path, *extra: str | Path) -> list[str | Path]:
    return ["-q", "compile", checkpoint, "--weights", "fp32", "-o", output, *extra]


def assert_refused(code: int, err: str, command: str, *fragments: str) -> None:
    """Exit 2 and an ``ovshard <command>: error:`` message naming every fragment, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith(f"ovshard {command}: error: "), err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"


def assert_nothing_written(output: Path) -> None:
    """No bundle at ``output`` and no ``.<name>.*`` temp or old folder beside it."""
    assert not output.exists()
    if output.parent.is_dir():
        assert list(output.parent.glob(f".{output.name}.*")) == []


# ----- the shared bundle: stories260K in two stages, compiled once by a real `ovshard` process -----


@dataclass(frozen=True)
class Built:
    bundle: Path
    dumps: Path
    process: subprocess.CompletedProcess[str]

    @property
    def manifest(self) -> Manifest:
        return read_manifest(self.bundle)


def path_without_graphviz() -> str:
    """PATH minus the folders holding Graphviz `dot`, so dumps skip SVG rendering (seconds per graph)."""
    folders = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in folders if d and not (Path(d) / "dot").exists())


@pytest.fixture(scope="module")
def built(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """stories260K in two stages with dumps before/after every pass, text only, printing after changes."""
    root = tmp_path_factory.mktemp("built")
    bundle, dumps = root / "out", root / "dumps"
    process = subprocess.run(
        [*OVSHARD, "compile", str(stories), "--stages", "2", "--weights", "fp32", "-o", str(bundle),
         "--dump-after", "all", "--dump-before", "all", "--no-dump-ir", "--dump-dir", str(dumps),
         "--print-after-change"],
        cwd=root, env={**os.environ, "PATH": path_without_graphviz()}, capture_output=True, text=True,
        timeout=300, check=False)
    assert process.returncode == 0, process.stderr
    return Built(bundle, dumps, process)


def copy_bundle(built: Built, dest: Path) -> Path:
    return Path(shutil.copytree(built.bundle, dest))


def test_subprocess_compile_writes_a_verified_bundle(built: Built) -> None:
    """`ovshard compile` as a real process exits 0 and writes manifest, one IR per stage and a tokenizer."""
    m = built.manifest
    assert [e.model_xml for e in m.stages] == ["stage_0.xml", "stage_1.xml"]
    assert m.tokenizer is not None
    verify_files(built.bundle, m)  # every file the manifest names is present with its sha256
    assert "Traceback" not in built.process.stderr


# ----- help -----

HELP = {
    "ovshard": ([], ("compile", "inspect", "demo", "--verbose", "--quiet")),
    "compile": (["compile"], ("--stages", "--layers", "--budgets", "--weights", "--output", "--dump-after",
                              "--dump-before", "--dump-dir", "--no-dump-ir", "--print-after-change")),
    "inspect": (["inspect"], ("--stage", "--pass", "--diff", "--format", "--dump-dir")),
    "demo": (["demo"], ("--stages", "--checkpoint", "--output")),
}


@pytest.mark.parametrize("command", sorted(HELP))
def test_help_exits_0_and_lists_key_options(capsys: pytest.CaptureFixture[str], command: str) -> None:
    """`ovshard [COMMAND] --help` exits 0 and mentions the command's key options."""
    argv, options = HELP[command]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert [o for o in options if o not in out] == []


# ----- compile refuses bad checkpoints -----


def test_missing_checkpoint_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A checkpoint path that does not exist is named and refused."""
    missing, out = tmp_path / "no-such-model", tmp_path / "out"
    code, _, err = cli(capsys, *compile_args(missing, out))
    assert_refused(code, err, "compile", str(missing), "does not exist")
    assert_nothing_written(out)


def test_checkpoint_without_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A folder without config.json is refused with how to produce a model directory."""
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    code, _, err = cli(capsys, *compile_args(tmp_path / "empty", out))
    assert_refused(code, err, "compile", "has no config.json", "save_pretrained")
    assert_nothing_written(out)


def test_truncated_safetensors(capsys: pytest.CaptureFixture[str], stories: Path, tmp_path: Path) -> None:
    """A truncated model.safetensors (in a copy of stories260K) is named and called truncated."""
    copy = Path(shutil.copytree(stories, tmp_path / "copy", copy_function=shutil.copyfile))
    copy.chmod(0o755)
    with (copy / "model.safetensors").open("r+b") as f:
        f.truncate(100_000)
    out = tmp_path / "out"
    code, _, err = cli(capsys, *compile_args(copy, out))
    assert_refused(code, err, "compile", str(copy / "model.safetensors"), "truncated")
    assert_nothing_written(out)


def test_unsupported_model_type(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """model_type gpt2 is refused with the list of supported types."""
    ckpt = tmp_path / "gpt2"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**llama_config(), "model_type": "gpt2"}))
    out = tmp_path / "out"
    code, _, err = cli(capsys, *compile_args(ckpt, out))
    assert_refused(code, err, "compile", "model_type='gpt2'", "supports: ", "gemma2", "llama", "qwen3", "deepseek_v3")
    assert_nothing_written(out)


# ----- compile refuses impossible plans -----


def test_more_stages_than_layers(capsys: pytest.CaptureFixture[str], stories: Path, tmp_path: Path) -> None:
    """--stages 9 on a 5-layer model names both numbers and the largest valid value."""
    out = tmp_path / "out"
    code, _, err = cli(capsys, *compile_args(stories, out, "--stages", "9"))
    assert_refused(code, err, "compile", "9 stages", "5 layers", "--stages 5 or fewer")
    assert_nothing_written(out)


def test_infeasible_budgets(capsys: pytest.CaptureFixture[str], stories: Path, tmp_path: Path) -> None:
    """--budgets 1GB,1KB names the overflowing stage (1, not 0) and by how much."""
    out = tmp_path / "out"
    code, _, err = cli(capsys, *compile_args(stories, out, "--budgets", "1GB,1KB"))
    assert_refused(code, err, "compile", "raise that budget")
    assert re.search(r"overflows stage 1 by \d+\.\d KiB \(needs \d+\.\d KiB\)", err), err
    assert "stage 0 by" not in err
    assert_nothing_written(out)


@pytest.mark.parametrize(("layers", "expected"), [
    ("0:2,3:5", "starts at layer 3, expected 2: layers [2, 3) are in no stage"),
    ("0-2,2:5", "expected comma-separated start:end layer ranges such as 0:3,3:5,5:7; found '0-2'"),
])
def test_malformed_layers(capsys: pytest.CaptureFixture[str], stories: Path, tmp_path: Path, layers: str,
                          expected: str) -> None:
    """A --layers value with a gap or bad syntax says what was expected and what was found."""
    out = tmp_path / "out"
    code, _, err = cli(capsys, *compile_args(stories, out, "--layers", layers))
    assert_refused(code, err, "compile", expected)
    assert_nothing_written(out)


def test_unknown_pass_in_dump_after(capsys: pytest.CaptureFixture[str], stories: Path, tmp_path: Path) -> None:
    """A misspelt --dump-after pass is refused with the pipeline's pass names, not silently ignored."""
    out = tmp_path / "out"
    code, _, err = cli(capsys, *compile_args(stories, out, "--dump-after", "MakeStatefulKV"))
    assert_refused(code, err, "compile", "--dump-after: no pass named MakeStatefulKV", ", ".join(PASSES))
    assert_nothing_written(out)


# ----- compile refuses bad output folders -----


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_unwritable_output(capsys: pytest.CaptureFixture[str], stories: Path, tmp_path: Path, where: str) -> None:
    """-o somewhere no folder can be made (under a regular file, in /proc) is named and refused."""
    (tmp_path / "file.txt").write_text("not a folder")
    out = tmp_path / "file.txt" / "out" if where == "under_a_file" else Path("/proc/ovshard-out")
    code, _, err = cli(capsys, *compile_args(stories, out))
    assert_refused(code, err, "compile", f"cannot write the bundle to {out.resolve()}", "choose a writable -o")
    assert not out.exists()


def test_output_folder_that_is_not_a_bundle(capsys: pytest.CaptureFixture[str], stories: Path,
                                            tmp_path: Path) -> None:
    """-o naming a folder of other files is refused and the files are left exactly as they were."""
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("keep me")
    code, _, err = cli(capsys, *compile_args(stories, out))
    assert_refused(code, err, "compile", "is not an ovshard bundle", "choose another -o")
    assert {p.name: p.read_text() for p in out.iterdir()} == {"todo.txt": "keep me"}
    assert list(tmp_path.glob(".notes.*")) == []


def test_output_that_is_a_file(capsys: pytest.CaptureFixture[str], stories: Path, tmp_path: Path) -> None:
    """-o naming an existing regular file is refused and the file is left alone."""
    out = tmp_path / "file.txt"
    out.write_text("not a folder")
    code, _, err = cli(capsys, *compile_args(stories, out))
    assert_refused(code, err, "compile", str(out))
    assert out.read_text() == "not a folder"


# ----- compile is atomic -----


def test_failure_in_stage_1_leaves_no_output(tmp_path: Path) -> None:
    """A compile that dies in stage 1 after stage 0 compiled leaves no bundle and no temp folder."""
    ckpt = tiny(tmp_path / "ckpt", max_shard_bytes=40_000)
    weight_map = json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]
    shard = weight_map["model.layers.3.mlp.down_proj.weight"]
    stage_0 = ("model.embed_tokens.", "model.layers.0.", "model.layers.1.")
    assert shard not in {f for name, f in weight_map.items() if name.startswith(stage_0)}  # stage 1 reads it
    with (ckpt / shard).open("ab") as f:  # the header still checks out; safetensors rejects the file on load
        f.write(b"\0" * 16)
    out = tmp_path / "out"
    process = subprocess.run(
        [*OVSHARD, "compile", str(ckpt), "--layers", "0:2,2:4", "--weights", "fp32", "-o", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert process.returncode == 2, process.stderr
    assert "Traceback" not in process.stderr
    assert "stage 1: cannot read tensor" in process.stderr
    assert "stage 0: compiled" in process.stderr  # the failure came mid-way, after a stage was written
    assert_nothing_written(out)


def test_unreadable_tensor_data(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A weight file safetensors refuses at load time gives exit 2 naming the file, not a traceback."""
    ckpt = tiny(tmp_path / "ckpt")
    with (ckpt / "model.safetensors").open("ab") as f:
        f.write(b"\0" * 16)
    out = tmp_path / "out"
    code, _, err = cli(capsys, *compile_args(ckpt, out))
    assert_refused(code, err, "compile", "model.safetensors")
    assert_nothing_written(out)


def test_recompile_replaces_the_bundle(capsys: pytest.CaptureFixture[str], built: Built, tmp_path: Path) -> None:
    """Compiling over an existing bundle replaces the whole folder: new fingerprint, no old files, no temp."""
    out = copy_bundle(built, tmp_path / "out")
    ckpt = tiny(tmp_path / "ckpt")
    code, _, err = cli(capsys, *compile_args(ckpt, out))
    assert code == 0, err
    source = read_manifest(out).source.fingerprint
    assert source == open_checkpoint(ckpt).fingerprint() != built.manifest.source.fingerprint
    assert not (out / "stage_1.xml").exists() and (out / "openvino_model.xml").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]


def test_unwritable_dump_dir_keeps_the_old_bundle(capsys: pytest.CaptureFixture[str], built: Built,
                                                  tmp_path: Path) -> None:
    """A recompile whose --dump-dir cannot be written fails clearly and leaves the old bundle untouched."""
    out = copy_bundle(built, tmp_path / "out")
    before = (out / "manifest.json").read_bytes()
    (tmp_path / "file.txt").write_text("not a folder")
    dumps = tmp_path / "file.txt" / "dumps"
    code, _, err = cli(capsys, *compile_args(tiny(tmp_path / "ckpt"), out, "--dump-after", "all",
                                             "--dump-dir", dumps))
    assert_refused(code, err, "compile", f"cannot write the graph dump {dumps}", "choose a writable --dump-dir")
    assert (out / "manifest.json").read_bytes() == before
    assert list(tmp_path.glob(".out.*")) == []


# ----- dumps and print-after-change (the shared bundle's flags) -----


def test_dump_before_writes_before_files(built: Built) -> None:
    """--dump-before all writes NN_<pass>.before.txt for every pass of every stage."""
    missing = [f"stage{s}/{n:02d}_{name}.before.txt" for s in (0, 1) for n, name in enumerate(PASSES, start=1)
               if not (built.dumps / f"stage{s}" / f"{n:02d}_{name}.before.txt").is_file()]
    assert missing == []


def test_no_dump_ir_writes_text_but_no_ir(built: Built) -> None:
    """--no-dump-ir leaves text and DOT dumps but no .xml/.bin in the dump dir."""
    assert (built.dumps / "stage1" / f"03_{PASSES[2]}.txt").is_file()
    assert (built.dumps / "stage1" / f"03_{PASSES[2]}.dot").is_file()
    assert sorted(built.dumps.rglob("*.xml")) + sorted(built.dumps.rglob("*.bin")) == []


def test_print_after_change_prints_exactly_the_changing_passes(built: Built) -> None:
    """--print-after-change prints the graph after each pass that changed it (per the pass log), no others."""
    stdout = built.process.stdout
    printed = re.findall(r"^// ----- stage (\d+) after (\w+) -----$", stdout, flags=re.M)
    changed = [(str(r.stage), r.name) for r in built.manifest.pass_log if r.modified]
    assert printed == changed
    after_stateful = stdout.split("// ----- stage 0 after MakeStatefulKVPass -----")[1].split("// -----")[0]
    assert "ReadValue(" in after_stateful


# ----- inspect -----


def test_inspect_summary(capsys: pytest.CaptureFixture[str], built: Built) -> None:
    """The summary lists every stage's layer range and every pass with per-stage outcome and timing."""
    code, out, err = cli(capsys, "inspect", built.bundle)
    assert code == 0, err
    for a, b in (e.layers for e in built.manifest.stages):
        assert re.search(rf"^\d\s+\[{a}, {b}\)\s+stage_", out, flags=re.M), f"[{a}, {b}) missing"
    timing = r"(changed|no-op) \d+\.\d\ds"
    for name in PASSES:
        assert re.search(rf"^{name}\s+{timing}\s+{timing}$", out, flags=re.M), f"{name} missing"


def test_inspect_diff_shows_beam_idx_gathers(capsys: pytest.CaptureFixture[str], built: Built) -> None:
    """--diff of InjectBeamIdxGatherPass adds the beam_idx Parameter and one Gather per KV state."""
    code, out, err = cli(capsys, "inspect", built.bundle, "--stage", "1", "--pass", "InjectBeamIdxGatherPass",
                         "--diff")
    assert code == 0, err
    assert "+input beam_idx: i32[?]" in out.splitlines()
    assert re.search(r"^\+%beam_idx = Parameter -> i32\[\?\]", out, flags=re.M)
    gathers = re.findall(r"^\+%[\w.]+ = Gather\(%[\w.]+, %beam_idx, %[\w.]+\)", out, flags=re.M)
    assert len(gathers) == len(built.manifest.stages[1].state_variables)


def test_inspect_dot(capsys: pytest.CaptureFixture[str], built: Built) -> None:
    """--format dot prints a Graphviz digraph of the stage."""
    code, out, err = cli(capsys, "inspect", built.bundle, "--stage", "1", "--format", "dot")
    assert code == 0, err
    assert out.startswith("digraph")


def test_inspect_xml_prints_the_stage_path(capsys: pytest.CaptureFixture[str], built: Built) -> None:
    """--format xml prints the path of the stage's IR, which exists."""
    code, out, err = cli(capsys, "inspect", built.bundle, "--stage", "0", "--format", "xml")
    assert code == 0, err
    assert Path(out.strip()) == built.bundle / "stage_0.xml"
    assert Path(out.strip()).is_file()


def test_inspect_unknown_pass_lists_dumped_passes(capsys: pytest.CaptureFixture[str], built: Built) -> None:
    """--pass NoSuchPass is refused with the passes that were dumped (not their .before dumps)."""
    code, _, err = cli(capsys, "inspect", built.bundle, "--stage", "1", "--pass", "NoSuchPass")
    assert_refused(code, err, "inspect", "no dump after pass 'NoSuchPass'")
    assert err.strip().split("dumped passes: ")[1].split(", ") == sorted(PASSES)


def test_inspect_pass_without_dumps(capsys: pytest.CaptureFixture[str], built: Built, tmp_path: Path) -> None:
    """--pass on a bundle compiled without dumps says how to recompile with them."""
    bundle = copy_bundle(built, tmp_path / "b")
    manifest = json.loads((bundle / "manifest.json").read_text())
    (bundle / "manifest.json").write_text(json.dumps({**manifest, "dumps": None}))
    code, _, err = cli(capsys, "inspect", bundle, "--stage", "1", "--pass", "InjectBeamIdxGatherPass")
    assert_refused(code, err, "inspect", "compiled without graph dumps", "--dump-after all --dump-dir DIR")


def test_inspect_stage_out_of_range(capsys: pytest.CaptureFixture[str], built: Built) -> None:
    """--stage 9 on a two-stage bundle names the valid range."""
    code, _, err = cli(capsys, "inspect", built.bundle, "--stage", "9")
    assert_refused(code, err, "inspect", "--stage 9", "stages 0..1")


def test_inspect_non_bundle_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """inspect on a folder without manifest.json says so and how to make a bundle."""
    (tmp_path / "notes.txt").write_text("hi")
    code, _, err = cli(capsys, "inspect", tmp_path)
    assert_refused(code, err, "inspect", "is not an ovshard bundle", "manifest.json", "ovshard compile")


def test_inspect_into_closed_pipe(built: Built) -> None:
    """`ovshard inspect ... | head` whose reader has gone exits quietly: no BrokenPipeError traceback."""
    process = subprocess.Popen([*OVSHARD, "inspect", str(built.bundle), "--stage", "1", "--pass",
                                "InjectBeamIdxGatherPass", "--diff"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # long before the child has imported openvino and printed anything
    err = process.stderr.read()
    assert process.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err


# ----- bundle integrity -----


def test_verify_files_names_a_corrupt_stage(built: Built, tmp_path: Path) -> None:
    """A flipped byte in stage_0.bin is caught by verify_files with a message naming the file."""
    bundle = copy_bundle(built, tmp_path / "b")
    verify_files(bundle, read_manifest(bundle))  # the intact copy passes
    data = bytearray((bundle / "stage_0.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bundle / "stage_0.bin").write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"stage_0\.bin has sha256 .* the manifest expects"):
        verify_files(bundle, read_manifest(bundle))


def _flip_keeping_times(path: Path) -> None:
    """Flip a byte in place and set the modification time back: size and mtime as before, content not."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        byte = f.read(1)
        f.seek(before.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_checked_record_skips_unchanged_files_and_never_hides_a_change(built: Built, tmp_path: Path) -> None:
    """With records (a worker's restart), an unchanged file is trusted without reading it, and a file written
    since, even with its size and modification time put back, is read again and refused."""
    bundle, checked = copy_bundle(built, tmp_path / "b"), CheckedFiles(tmp_path / "records")
    manifest, weights = read_manifest(bundle), bundle / "stage_0.bin"
    digest = manifest.stages[0].sha256["stage_0.bin"]
    assert not checked.known(weights, digest)
    verify_files(bundle, manifest, stages=[0], checked=checked)
    assert checked.known(weights, digest) and not checked.known(weights, "0" * 64)
    verify_files(bundle, manifest, stages=[0], checked=checked)  # trusted from the record
    _flip_keeping_times(weights)
    assert not checked.known(weights, digest)  # the inode change time moved
    with pytest.raises(BundleError, match=r"stage_0\.bin has sha256 .* the manifest expects"):
        verify_files(bundle, manifest, stages=[0], checked=checked)


def test_a_worker_restart_reads_a_changed_stage_file_again(built: Built, tmp_path: Path) -> None:
    """Two starts of a real StageWorker with one cache: the second refuses a stage file changed in between."""
    bundle, cache = copy_bundle(built, tmp_path / "b"), tmp_path / "cache"
    StageWorker(bundle, 0, cache_dir=cache)  # never listens: nothing to stop
    assert list((cache / CHECKED_FOLDER).glob("*.json")), "the first start recorded no checked file"
    _flip_keeping_times(bundle / "stage_0.bin")
    with pytest.raises(BundleError, match=r"stage_0\.bin has sha256"):
        StageWorker(bundle, 0, cache_dir=cache)
