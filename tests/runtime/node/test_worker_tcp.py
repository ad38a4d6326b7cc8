"""The runtime over real loopback TCP: one worker process per stage, the head in the test process."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import compile_fp32, hf_greedy, hf_sampled

from ovshard.bundle.manifest import bundle_fingerprint
from ovshard.errors import OvshardError
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.launch import LocalWorkers, WorkerProcess, local_workers, serve_command
from ovshard.runtime.decoding.decode import want_for
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.testing import free_port
from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.framing import read_message
from ovshard.runtime.wire.transport import connect

pytestmark = pytest.mark.slow


SESSION = "0123456789abcdef" * 2
PROMPTS = ([1, 403, 407, 261, 378], [1, 365, 261, 466, 14], [1, 92, 388])


@pytest.fixture(scope="module")
def bundles(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("tcp")
    return {n: compile_fp32(stories, root / f"b{n}", stages=n) for n in (1, 2, 3, 5)}


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
def test_greedy_over_tcp_equals_hugging_face(stories: Path, bundles: dict[int, Path], stages: int) -> None:
    """Greedy tokens through 1, 2, 3 and 5 worker processes equal HF's for several prompts (f32 hints)."""
    with local_workers(bundles[stages], exact=True) as addresses:
        head = Head(bundles[stages], addresses)
        try:
            for prompt in PROMPTS:
                expected, _ = hf_greedy(stories, prompt, 24)
                got = list(head.generate(prompt, SamplingConfig(max_tokens=24)))
                assert got == expected, f"prompt {prompt}"
        finally:
            head.close()


def test_top_k_sampling_over_the_wire_draws_what_full_logits_draw(stories: Path, bundles: dict[int, Path]) -> None:
    """Seeded top-k sampling (top_p 1, so the last stage sends only its top 40 per row, "topk:40") through 1
    and 3 worker processes draws exactly the tokens that the same seed draws from Hugging Face's full rows of
    logits, and the same again on a second run."""
    config = SamplingConfig(temperature=0.9, top_k=40, seed=7, max_tokens=30)
    assert want_for(config, 1) == "topk:40"
    expected = hf_sampled(stories, [1, 403, 407], config)
    assert len(set(expected)) > 5  # a sampled story, not one repeated token
    for stages in (1, 3, 3):
        with local_workers(bundles[stages], exact=True) as addresses:
            head = Head(bundles[stages], addresses)
            try:
                assert list(head.generate([1, 403, 407], config)) == expected, f"{stages} stages"
            finally:
                head.close()


def test_handshake_mismatches_are_refused(bundles: dict[int, Path]) -> None:
    """A wrong stage index or another bundle's fingerprint is refused with a message naming both sides."""
    with local_workers(bundles[2]) as addresses:
        good = bundle_fingerprint(bundles[2])
        with pytest.raises(OvshardError, match=r"refused: stage 1 at .*serves stage 1, the peer expected stage 0"):
            connect(addresses[1], 0, good, "head", SESSION)
        with pytest.raises(OvshardError, match="bundle mismatch"):
            connect(addresses[0], 0, bundle_fingerprint(bundles[3]), "head", SESSION)


def test_malformed_frame_gets_an_error_and_the_worker_keeps_serving(bundles: dict[int, Path]) -> None:
    """Garbage on one connection gets an Error frame and a close; a proper head is served afterwards."""
    with local_workers(bundles[1], exact=True) as addresses:
        host, port = addresses[0].split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
            reply = read_message(sock)
            assert isinstance(reply, p.Error) and reply.code == "bad_magic"
            try:
                assert sock.recv(1) == b""  # closed
            except ConnectionResetError:
                pass  # closed with our unread bytes still queued: the kernel resets instead
        head = Head(bundles[1], addresses)
        try:
            assert len(list(head.generate([1, 403], SamplingConfig(max_tokens=3)))) == 3
        finally:
            head.close()


def test_peer_down_names_the_address_and_stage(bundles: dict[int, Path]) -> None:
    """A stage that is not running gives an error naming its host:port and stage index."""
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(OvshardError, match=rf"cannot reach stage 1 at {address}"):
        connect(address, 1, bundle_fingerprint(bundles[2]), "head", SESSION)


def test_run_local_streams_text(bundles: dict[int, Path]) -> None:
    """`ovshard run --local` starts the workers, prints the story to stdout and timings to stderr."""
    out = subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "run", str(bundles[2]), "--local",
                          "--exact", "--max-tokens", "20"], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.startswith("Once upon a time, there was a little girl named Lily")
    assert "decode_tokens_per_s" in out.stderr


def test_stages_compile_with_the_manifests_measured_cpu_hints(bundles: dict[int, Path]) -> None:
    """A compile records the CPU plugin defaults chosen by bench/against_llama_cpp/decode_overhead.py (and that measurement) in
    the manifest's runtime hints; a stage compiles with them, and a caller's setting (--exact) wins key by key."""
    import dataclasses

    from ovshard.bundle.manifest import CPU_PLUGIN_HINTS, read_manifest
    from ovshard.runtime.engine.stage import EXACT_HINTS, Stage

    manifest = read_manifest(bundles[2])
    assert manifest.runtime_hints.cpu_plugin == CPU_PLUGIN_HINTS
    assert "decode_overhead.py" in manifest.runtime_hints.cpu_plugin_measured
    hints = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "64", "KV_CACHE_PRECISION": "f16"}
    edited = dataclasses.replace(manifest, runtime_hints=dataclasses.replace(manifest.runtime_hints, cpu_plugin=hints,
                                                                             cpu_plugin_by_isa={}))
    stage = Stage(bundles[2], edited, 1)
    assert int(stage.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 64
    assert str(stage.compiled.get_property("KV_CACHE_PRECISION")) == "<Type: 'float16'>"
    exact = Stage(bundles[2], edited, 1, config=EXACT_HINTS)
    assert int(exact.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 0
    assert str(exact.compiled.get_property("KV_CACHE_PRECISION")) == "<Type: 'float32'>"


def with_isa_hints(bundle: Path, into: Path) -> Path:
    """A copy of ``bundle`` whose manifest hints PERFORMANCE_HINT and KV_CACHE_PRECISION u8 for every CPU, and
    KV_CACHE_PRECISION f16 and DYNAMIC_QUANTIZATION_GROUP_SIZE 64 for ISA class avx2 (the stage files unchanged)."""
    shutil.copytree(bundle, into)
    manifest = json.loads((into / "manifest.json").read_text())
    manifest["runtime_hints"]["cpu_plugin"] = {"PERFORMANCE_HINT": "LATENCY", "KV_CACHE_PRECISION": "u8"}
    manifest["runtime_hints"]["cpu_plugin_by_isa"] = {
        "avx2": {"KV_CACHE_PRECISION": "f16", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "64"}}
    (into / "manifest.json").write_text(json.dumps(manifest))
    return into


def test_a_worker_compiles_with_the_bundles_hints_for_its_isa_class(bundles: dict[int, Path], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On a node of ISA class avx2 (forced by OVSHARD_CPU_ISA) a worker's stage compiles with the bundle's hints
    for avx2 over its hints for every CPU; on a node of another class, with the latter alone."""
    from ovshard.runtime.node.worker import StageWorker

    bundle = with_isa_hints(bundles[1], tmp_path / "b")
    kv_precision = {}
    for isa in ("avx2", "other"):
        monkeypatch.setenv("OVSHARD_CPU_ISA", isa)
        worker = StageWorker(bundle, 0, cache_dir=tmp_path / "cache")
        assert worker.backend.paged is not None
        compiled = worker.backend.paged.compiled
        assert str(compiled.get_property("PERFORMANCE_HINT")) == "LATENCY"
        kv_precision[isa] = str(compiled.get_property("KV_CACHE_PRECISION"))
        if isa == "avx2":
            assert int(compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 64
    assert kv_precision == {"avx2": "<Type: 'float16'>", "other": "<Type: 'uint8_t'>"}


def test_serve_names_its_isa_class_and_settings_at_startup(bundles: dict[int, Path], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`ovshard serve` (default verbosity) says on stderr, once, its CPU's name and ISA class and each property
    its stage compiles with under the layer that set it: the bundle's, the bundle's for the class, its own."""
    monkeypatch.setenv("OVSHARD_CPU_ISA", "avx2")
    command = serve_command(with_isa_hints(bundles[1], tmp_path / "b"), 0, options=["--threads", "1"])
    with (tmp_path / "stderr").open("w") as log:
        worker = WorkerProcess([c for c in command if c != "-q"], 0, stderr=log)
        try:
            worker.wait_listening(120)
        finally:
            worker.stop()
    lines = [line for line in (tmp_path / "stderr").read_text().splitlines() if "ISA class" in line]
    assert len(lines) == 1 and re.fullmatch(
        r"ovshard: stage 0: CPU '.+' \(ISA class avx2 from OVSHARD_CPU_ISA\): PERFORMANCE_HINT=LATENCY from the "
        r"bundle's hints; KV_CACHE_PRECISION=f16, DYNAMIC_QUANTIZATION_GROUP_SIZE=64 from the bundle's hints for avx2; "
        r"INFERENCE_NUM_THREADS=1, ENABLE_CPU_PINNING=NO from the node's settings \(--exact, --threads\)",
        lines[0]), lines


def test_run_local_names_its_isa_class_and_settings(bundles: dict[int, Path]) -> None:
    """`ovshard run --local` says on stderr by default what its workers (which run -q) compile with on this CPU,
    and `--in-process` what its stages do; stdout holds the story alone."""
    env = {**os.environ, "OVSHARD_CPU_ISA": "avx512_amx"}
    for extra, who in (([], "local workers"), (["--in-process"], "every stage")):
        out = subprocess.run([sys.executable, "-m", "ovshard.cli", "run", str(bundles[2]), "--local", "--exact",
                              "--max-tokens", "5", *extra], capture_output=True, text=True, timeout=300, check=True,
                             env=env)
        assert out.stdout.startswith("Once upon a time") and "ISA class" not in out.stdout
        lines = [line for line in out.stderr.splitlines() if "ISA class" in line]
        assert len(lines) == 1 and lines[0].startswith(f"ovshard: {who}: CPU '"), out.stderr
        assert "(ISA class avx512_amx from OVSHARD_CPU_ISA" in lines[0]
        assert lines[0].endswith("INFERENCE_PRECISION_HINT=f32, KV_CACHE_PRECISION=f32, "
                                 "DYNAMIC_QUANTIZATION_GROUP_SIZE=0 from the node's settings (--exact, --threads)")


def test_run_in_process_prints_the_workers_text(bundles: dict[int, Path], tmp_path: Path) -> None:
    """`ovshard run --local --in-process` (every stage in the CLI's process, the last one computing only the
    rows each step reads) prints what `run --local` over worker processes prints, with prompt-lookup
    speculation and without, and for a --prompts-file over --streams (its requests at once, one pool)."""
    def run(*extra: str) -> str:
        return subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "run", str(bundles[2]), "--local",
                               "--exact", "--max-tokens", "40", *extra], capture_output=True, text=True,
                              timeout=300, check=True).stdout

    for speculative in ("prompt-lookup", "off"):
        assert run("--in-process", "--speculative", speculative) == run("--speculative", speculative)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe little dog\nOnce upon a time there was\n")

    def blocks(out: str) -> list[str]:  # each completion's block, in prompt order (they print as they finish)
        return sorted(out.split("=== ")[1:])

    in_process = run("--in-process", "--prompts-file", str(prompts), "--streams", "3")
    assert blocks(in_process) == blocks(run("--prompts-file", str(prompts), "--streams", "3"))
    assert len(blocks(in_process)) == 3


def test_llama3_rope_random_checkpoint_over_four_stages(tmp_path: Path) -> None:
    """A random-weight llama3-rope Llama split into 4 worker processes generates HF's greedy tokens."""
    from ovshard.tools.synth import llama_config, write_checkpoint

    checkpoint = write_checkpoint(tmp_path / "ckpt", llama_config(), seed=5)
    bundle = compile_fp32(checkpoint, tmp_path / "b", stages=4)
    expected, _ = hf_greedy(checkpoint, [1, 17, 42, 99], 20)
    with local_workers(bundle, exact=True) as addresses:
        head = Head(bundle, addresses)
        try:
            assert list(head.generate([1, 17, 42, 99], SamplingConfig(max_tokens=20))) == expected
        finally:
            head.close()


def test_a_stage_dying_mid_stream_is_named(bundles: dict[int, Path]) -> None:
    """When a worker process dies during generation the head raises naming that stage and its address."""
    with LocalWorkers(bundles[2], exact=True) as workers:
        head = Head(bundles[2], workers.addresses, retry_s=1)
        try:
            tokens = head.generate([1, 403], SamplingConfig(max_tokens=200))
            next(tokens)
            workers.processes[1].kill()
            with pytest.raises(OvshardError, match=r"stage \d at 127\.0\.0\.1:\d+"):
                for _ in tokens:
                    pass
        finally:
            head.close()


def test_serve_on_port_0_reports_the_port_it_bound(bundles: dict[int, Path]) -> None:
    """`serve --listen 127.0.0.1:0` prints one JSON line with the real port, and a head can connect there."""
    cmd = [sys.executable, "-m", "ovshard.cli", "-q", "serve", str(bundles[1]), "--stage", "0",
           "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        report = json.loads(proc.stdout.readline())
        host, _, port = report["address"].rpartition(":")
        assert report == {"event": "listening", "stage": 0, "address": f"127.0.0.1:{port}"}
        assert host == "127.0.0.1" and 0 < int(port) < 65536
        conn = connect(report["address"], 0, bundle_fingerprint(bundles[1]), "head", SESSION, timeout=10)
        try:
            conn.send(p.Ping(77))
            assert conn.receive() == p.Pong(77)
        finally:
            conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serving_writes_nothing_into_the_bundle(bundles: dict[int, Path], tmp_path: Path) -> None:
    """The compiled-model cache goes to --cache-dir (default: the user's cache folder), never into the bundle,
    so a bundle may be read-only; a second start finds the cached model there."""
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(bundles[1], bundle)
    before = sorted(p.relative_to(bundle) for p in bundle.rglob("*"))
    cache = tmp_path / "ov-cache"
    for _ in range(2):
        cmd = [sys.executable, "-m", "ovshard.cli", "-q", "serve", str(bundle), "--stage", "0", "--listen",
               "127.0.0.1:0", "--cache-dir", str(cache)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and json.loads(proc.stdout.readline())["event"] == "listening"
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert sorted(p.relative_to(bundle) for p in bundle.rglob("*")) == before
    assert [p for p in cache.iterdir() if p.suffix == ".blob"], list(cache.iterdir())


def test_a_worker_that_exits_before_listening_is_a_clear_error(bundles: dict[int, Path], tmp_path: Path) -> None:
    """A worker that dies before it reports an address (here: a stage the bundle lacks) fails the launch
    at once with an error naming the stage and its exit code, not a wait until the timeout."""
    with (tmp_path / "stderr").open("w") as log:
        worker = WorkerProcess(serve_command(bundles[1], 7), 7, stderr=log)
        start = time.monotonic()
        with pytest.raises(OvshardError, match=r"stage 7 exited before it listened \(exit code 2\)"):
            worker.wait_listening(120)
    assert time.monotonic() - start < 60
    assert "the bundle has stages 0..0" in (tmp_path / "stderr").read_text()


def test_a_worker_that_never_reports_times_out_with_a_clear_error() -> None:
    """A process that neither listens nor exits fails wait_listening after its timeout, naming the stage."""
    worker = WorkerProcess([sys.executable, "-c", "import time; time.sleep(60)"], 3)
    try:
        with pytest.raises(OvshardError, match=r"stage 3 .* did not report a listening address within 1 s"):
            worker.wait_listening(1)
    finally:
        worker.stop()


def test_ctrl_c_stops_a_worker_cleanly(bundles: dict[int, Path], tmp_path: Path) -> None:
    """SIGINT to `ovshard serve` ends it with exit 0 and no traceback."""
    with (tmp_path / "stderr").open("w") as log:
        worker = WorkerProcess(serve_command(bundles[1], 0), 0, stderr=log)
        worker.wait_listening(120)
        time.sleep(0.2)
        worker.process.send_signal(signal.SIGINT)
        assert worker.process.wait(timeout=30) == 0, (tmp_path / "stderr").read_text()
    assert "Traceback" not in (tmp_path / "stderr").read_text()


def test_refusal_is_logged_by_the_worker_and_a_busy_port_is_a_clear_error(bundles: dict[int, Path],
                                                                         tmp_path: Path) -> None:
    """Both sides of a refused handshake say why; serving on a port in use names the port."""
    with (tmp_path / "stderr").open("w") as log:
        worker = WorkerProcess(serve_command(bundles[1], 0), 0, stderr=log)
        try:
            address = worker.wait_listening(120)
            with pytest.raises(OvshardError, match="the peer expected stage 3"):
                connect(address, 3, bundle_fingerprint(bundles[1]), "head", SESSION)
            busy = subprocess.run(serve_command(bundles[1], 0, address), capture_output=True, text=True,
                                  timeout=120)
            assert busy.returncode == 2 and f"cannot listen on {address}" in busy.stderr
            assert "Traceback" not in busy.stderr
        finally:
            worker.stop()
    err = (tmp_path / "stderr").read_text()
    assert "refused" in err and "the peer expected stage 3" in err


def test_a_port_still_held_is_waited_for_when_asked(bundles: dict[int, Path]) -> None:
    """listen(wait_s=...) binds a port once its holder lets go (a stage actor replacing one whose process has not
    exited yet); without a wait, a port in use is refused at once."""
    from ovshard.runtime.node.worker import StageWorker

    worker = StageWorker(bundles[1], 0)
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    try:
        with pytest.raises(OvshardError, match=f"cannot listen on 127.0.0.1:{port}"):
            worker.listen("127.0.0.1", port)
        threading.Timer(1.0, holder.close).start()  # the old holder exits a second later
        assert worker.listen("127.0.0.1", port, wait_s=60).endswith(f":{port}")
    finally:
        holder.close()
        worker.stop()


def test_a_bad_request_is_answered_and_the_connection_stays(bundles: dict[int, Path]) -> None:
    """A Step for a stream that was never opened gets an Error naming the stream; the same head then works."""
    with local_workers(bundles[1], exact=True) as addresses:
        head = Head(bundles[1], addresses)
        try:
            with pytest.raises(OvshardError, match="stream 99 is not open at stage 0"):
                step = p.Step(99, 7, 0, "argmax", p.Tensor.from_array(np.array([[1, 403]], np.int64)))
                head.chain.ask(("step", 7), 99, [(0, step)], 1)
            assert len(list(head.generate([1, 403], SamplingConfig(max_tokens=3)))) == 3
        finally:
            head.close()


def _serve_logged(bundle: Path, stages: int, options: list[str], log_file: Path) -> list[WorkerProcess]:
    """A worker process per stage with its INFO log (no ``-q``) appended to ``log_file``."""
    with log_file.open("a") as err:  # each child holds its own copy of the descriptor
        return [WorkerProcess([arg for arg in serve_command(bundle, i, "127.0.0.1:0", options) if arg != "-q"],
                              i, stderr=err) for i in range(stages)]


@pytest.mark.parametrize("hints", [["--exact"], []])
def test_a_lone_streams_decode_steps_run_each_workers_static_copy(bundles: dict[int, Path], tmp_path: Path,
                                                                   hints: list[str]) -> None:
    """One stream alone through 2 paged worker processes: every one-row step (its decode steps, and each
    worker's warm-up step) runs the stage's static decode copy, counted in the log the worker writes at
    SIGTERM, and the greedy tokens equal those of workers started with --no-static-decode, under f32 hints and
    under the bundle's own; those workers say they have no copy."""
    n = 24
    tokens: dict[str, list[list[int]]] = {}
    for label, options in (("static", hints), ("dynamic", [*hints, "--no-static-decode"])):
        log_file = tmp_path / f"{label}.log"
        procs = _serve_logged(bundles[2], 2, options, log_file)
        try:
            head = Head(bundles[2], [w.wait_listening(120) for w in procs])
            try:
                tokens[label] = [list(head.generate(prompt, SamplingConfig(max_tokens=n))) for prompt in PROMPTS]
            finally:
                head.close()
        finally:
            for w in procs:
                w.stop()
        text = log_file.read_text()
        counts = sorted(int(c) for c in re.findall(r"stage \d: ran \d+ steps .*?, (\d+) one-row steps on the static", text))
        if label == "static":
            assert counts == [1 + len(PROMPTS) * (n - 1)] * 2, text  # the warm-up, then n - 1 fed tokens a prompt
        else:
            assert counts == [] and text.count("no static decode copy") == 2, text
            assert text.count("decode steps run the dynamic paged model (--no-static-decode)") == 2, text
    assert tokens["static"] == tokens["dynamic"]
