"""The runtime on a hostile network: many clients, dead clients, restarted stages, attackers, limits.

Every test runs real `ovshard serve` worker processes on loopback; the heads are real clients (the
`generate` command in a subprocess, or Head in this process); attackers are raw sockets.
"""

from __future__ import annotations

import os
import resource
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from conftest import compile_fp32

from ovshard.bundle.manifest import bundle_fingerprint
from ovshard.errors import OvshardError
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.launch import WorkerProcess, serve_command
from ovshard.runtime.client.scheduler import Scheduler
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.framing import PREFIX, encode, read_message
from ovshard.runtime.wire.transport import connect

pytestmark = pytest.mark.slow


PROMPT_A, PROMPT_B = [1, 403, 407, 261, 378], [1, 365, 261, 466, 14, 92]
CLI = [sys.executable, "-m", "ovshard.cli"]


@pytest.fixture(scope="module")
def bundles(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("net")
    return {n: compile_fp32(stories, root / f"b{n}", stages=n) for n in (1, 2, 3)}


def reference(bundle: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of one uninterrupted in-process run (f32 hints, like the workers' --exact)."""
    from ovshard.runtime.client.inprocess import LocalPipeline
    from ovshard.runtime.engine.stage import EXACT_HINTS

    return list(LocalPipeline(bundle, config=EXACT_HINTS).generate(prompt, SamplingConfig(max_tokens=n)))


class Workers:
    """One worker process per stage on loopback; any of them can be killed and restarted on its port. They keep
    stateful streams (--kv stateful): these tests drive the stream messages by hand; the paged path's faults
    are in tests/runtime/client/test_batching_tcp.py."""

    def __init__(self, bundle: Path, options: list[str], stages: int) -> None:
        self.bundle, self.options = bundle, ["--exact", "--kv", "stateful", *options]
        self.procs = [self._start(i, "127.0.0.1:0") for i in range(stages)]
        self.addresses = [w.wait_listening(120) for w in self.procs]

    def _start(self, stage: int, listen: str) -> WorkerProcess:
        return WorkerProcess(serve_command(self.bundle, stage, listen, self.options), stage, stderr=subprocess.PIPE)

    def restart(self, stage: int) -> None:
        self.procs[stage].process.kill()
        self.procs[stage].process.wait()
        self.procs[stage] = self._start(stage, self.addresses[stage])
        assert self.procs[stage].wait_listening(120) == self.addresses[stage]

    def pid(self, stage: int) -> int:
        return self.procs[stage].process.pid

    def stop(self) -> None:
        for w in self.procs:
            w.stop()


@contextmanager
def workers(bundle: Path, *options: str) -> Iterator[Workers]:
    from ovshard.bundle.manifest import read_manifest

    running = Workers(bundle, list(options), read_manifest(bundle).num_stages)
    try:
        yield running
    finally:
        running.stop()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def raw_head(address: str, bundle: Path, stage: int = 0, next_hop: str | None = None) -> socket.socket:
    """A hand-driven head connection that completed the handshake under a fresh session."""
    conn = connect(address, stage, bundle_fingerprint(bundle), "head", secrets.token_hex(16), next_hop)
    conn.sock.settimeout(30)
    return conn.sock


def ask(sock: socket.socket, msg: p.Message) -> p.Message:
    sock.sendall(encode(msg))
    return read_message(sock)


def step(stream: int, position: int, ids: list[int], seq: int = 0) -> p.Step:
    return p.Step(stream, seq, position, "argmax", p.Tensor.from_array(np.array([ids], dtype=np.int64)))


def generate_cli(bundle: Path, addresses: list[str], prompt: list[int], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, "-q", "generate", str(bundle), "--stages", ",".join(addresses), "--prompt-ids",
                             ",".join(map(str, prompt)), "--speculative", "off", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ----- row 1: isolation between clients -----

def test_two_clients_at_once_each_get_their_solo_output(bundles: dict[int, Path]) -> None:
    """Two `generate` clients on the same workers at the same time each print what they print alone."""
    with workers(bundles[2]) as w:
        solo = []
        for prompt in (PROMPT_A, PROMPT_B):
            out = generate_cli(bundles[2], w.addresses, prompt, "--max-tokens", "120")
            solo.append(out.communicate(timeout=120)[0])
        both = [generate_cli(bundles[2], w.addresses, prompt, "--max-tokens", "120") for prompt in (PROMPT_A, PROMPT_B)]
        results = [c.communicate(timeout=120) for c in both]
    assert [c.returncode for c in both] == [0, 0], [r[1] for r in results]
    assert [r[0] for r in results] == solo
    assert solo[0] != solo[1]


def test_one_session_can_neither_step_nor_close_anothers_stream(bundles: dict[int, Path]) -> None:
    """A second head's Close(0) and Step(0) find no stream 0 of its own; the first head's stream goes on."""
    expected = reference(bundles[1], PROMPT_A, 40)
    with workers(bundles[1]) as w:
        head = Head(bundles[1], w.addresses)
        try:
            tokens = head.generate(PROMPT_A, SamplingConfig(max_tokens=40))
            got = [next(tokens) for _ in range(5)]
            rogue = raw_head(w.addresses[0], bundles[1])
            rogue.sendall(encode(p.Close(0)))
            reply = ask(rogue, step(0, 5, [1]))
            assert isinstance(reply, p.Error) and reply.code == "no_stream"
            got += list(tokens)
        finally:
            head.close()
    assert got == expected


def test_a_next_hop_named_by_one_head_carries_only_its_own_session(bundles: dict[int, Path]) -> None:
    """A rogue head naming its own listener as next_hop gets a link for its own session only: no Step of the
    real user's stream ever reaches it, and the user's tokens are unchanged."""
    expected = reference(bundles[2], PROMPT_A, 30)
    seen: list[bytes] = []
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(20)

    def listen() -> None:
        try:
            sock, _ = trap.accept()
            sock.settimeout(2)
            while data := sock.recv(65536):
                seen.append(data)
        except OSError:
            pass

    catcher = threading.Thread(target=listen, daemon=True)
    with workers(bundles[2]) as w:
        head = Head(bundles[2], w.addresses)
        try:
            tokens = head.generate(PROMPT_A, SamplingConfig(max_tokens=30))
            got = [next(tokens)]
            catcher.start()
            with pytest.raises(OvshardError, match="cannot link to the next stage"):  # the trap never says HelloOk
                raw_head(w.addresses[0], bundles[2], next_hop=f"127.0.0.1:{trap.getsockname()[1]}")
            got += list(tokens)
        finally:
            head.close()
    catcher.join(10)
    trap.close()
    assert got == expected
    data = b"".join(seen)
    kinds = []
    while len(data) >= 16:  # every frame that reached the trap
        _, _, kind, _, header_len, body_len = PREFIX.unpack(data[:16])
        kinds.append(kind)
        data = data[16 + header_len + body_len:]
    assert kinds == [p.Hello.kind()]  # the upstream Hello of the rogue's own session, and nothing else


# ----- row 2: a dead client -----

def test_a_client_killed_under_four_streams_frees_them_and_the_next_client_works(bundles: dict[int, Path],
                                                                                tmp_path: Path) -> None:
    """SIGKILL a `generate --streams 4` client mid-generation: its 4 streams are freed on every stage (a worker
    that grants 4 streams grants 4 again) and the next client gets the right tokens."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(",".join(map(str, q)) for q in (PROMPT_A, PROMPT_B) * 40) + "\n")  # busy a while
    expected = reference(bundles[2], PROMPT_B, 40)
    with workers(bundles[2], "--max-streams", "4") as w:
        client = subprocess.Popen([*CLI, "-q", "generate", str(bundles[2]), "--stages", ",".join(w.addresses),
                                   "--prompts-file", str(prompts), "--streams", "4", "--max-tokens", "480",
                                   "--speculative", "off"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = raw_head(w.addresses[1], bundles[2], stage=1)
        time.sleep(2)  # the client starts up and opens its 4 streams
        deadline = time.monotonic() + 60
        while not isinstance(reply := ask(probe, p.Open(99)), p.Error):  # until the client holds all 4
            probe.sendall(encode(p.Close(99)))
            assert time.monotonic() < deadline and client.poll() is None
            time.sleep(0.2)
        assert reply.code == "busy"
        client.kill()
        client.wait()
        probe.close()
        for stage, address in enumerate(w.addresses):  # every stage frees the dead client's 4 streams
            probe = raw_head(address, bundles[2], stage=stage)
            deadline = time.monotonic() + 10
            while not all(ask(probe, p.Open(i)) == p.OpenOk(i) for i in range(4)):
                assert time.monotonic() < deadline, f"stage {stage} did not free the dead client's streams"
                for i in range(4):
                    probe.sendall(encode(p.Close(i)))
                time.sleep(0.05)
            for i in range(4):
                probe.sendall(encode(p.Close(i)))
            assert ask(probe, p.Ping(1)) == p.Pong(1)  # the Closes before it are done: the 4 are free again
            probe.close()
        head = Head(bundles[2], w.addresses)
        try:
            assert list(head.generate(PROMPT_B, SamplingConfig(max_tokens=40))) == expected
        finally:
            head.close()


# ----- row 3 and Must-include 2: a restarted stage -----

@pytest.mark.parametrize("speculative", ["off", "prompt-lookup"])
def test_a_stage_killed_and_restarted_mid_stream_finishes_with_the_uninterrupted_tokens(
        bundles: dict[int, Path], speculative: str) -> None:
    """SIGKILL the middle stage of three mid-generation and restart it on the same port: stage 0 links to the
    new process, the head replays the stream, and the tokens equal an uninterrupted run."""
    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.decoding.speculative import make_speculation

    bundle = bundles[3]
    prompt = [1, 403, 407, 261, 378, 403, 407, 261]
    expected = reference(bundle, prompt, 150)
    speculation = make_speculation(speculative, "auto", read_manifest(bundle)) if speculative != "off" else None
    with workers(bundle) as w:
        head = Head(bundle, w.addresses, retry_s=60)
        stats = Stats()
        try:
            tokens = head.generate(prompt, SamplingConfig(max_tokens=150), stats, speculation)
            got = [next(tokens) for _ in range(30)]
            w.restart(1)
            got += list(tokens)
        finally:
            head.close()
    assert got == expected
    assert head.reconnects >= 1 and stats.replays >= 1


def test_a_stage_that_stays_down_fails_cleanly_with_the_partial_output(bundles: dict[int, Path]) -> None:
    """`generate --retry-s 1` with a stage killed for good prints the tokens made so far, then exits 2 with an
    error that says how many there were and which stage went away."""
    with workers(bundles[2]) as w:
        client = generate_cli(bundles[2], w.addresses, PROMPT_A, "--max-tokens", "480", "--retry-s", "1")
        assert client.stdout is not None
        first = client.stdout.read(20)  # some tokens are out
        w.procs[1].process.kill()
        out, err = client.communicate(timeout=60)
    assert client.returncode == 2
    assert len((first + out).strip()) >= 10  # the story so far
    assert "generation failed after" in err and "stage 1 at" in err and "--retry-s" in err
    assert "Traceback" not in err


# ----- rows 4 and Must-include 3: authentication and TLS -----

@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ovshard.runtime.tools.keygen import keygen

    folder = tmp_path_factory.mktemp("keys") / "cluster"
    keygen(folder, stages=["s0", "s1"], heads=["head"])
    return folder


def test_tls_links_give_the_same_tokens_and_plain_clients_are_refused(bundles: dict[int, Path], credentials: Path,
                                                                      tmp_path: Path) -> None:
    """Workers with --credentials: a head with credentials generates the reference tokens over TLS on every
    link; a plain-TCP client, a client without credentials and one with another cluster's are all refused."""
    from ovshard.runtime.tools.keygen import keygen
    from ovshard.runtime.wire.tls import client_context, load_credentials

    expected = reference(bundles[2], PROMPT_A, 30)
    other = tmp_path / "other"
    keygen(other, stages=["x"], heads=["head"])
    w = Workers.__new__(Workers)
    w.bundle, w.options = bundles[2], ["--exact"]
    w.procs = [WorkerProcess(serve_command(bundles[2], i, "127.0.0.1:0",
                                           ["--exact", "--credentials", str(credentials / f"s{i}")]), i)
               for i in range(2)]
    try:
        w.addresses = [proc.wait_listening(120) for proc in w.procs]
        head = Head(bundles[2], w.addresses, tls=client_context(load_credentials(credentials / "head")))
        try:
            assert list(head.generate(PROMPT_A, SamplingConfig(max_tokens=30))) == expected
        finally:
            head.close()
        fingerprint = bundle_fingerprint(bundles[2])
        with pytest.raises(OvshardError, match="closed the handshake"):
            connect(w.addresses[0], 0, fingerprint, "head", secrets.token_hex(16))
        with pytest.raises(OvshardError):
            connect(w.addresses[0], 0, fingerprint, "head", secrets.token_hex(16),
                    tls=client_context(load_credentials(other / "head")))
        # a stage's certificate cannot open a head session (and so cannot name a next_hop)
        with pytest.raises(OvshardError, match="needs a 'head' certificate"):
            connect(w.addresses[0], 0, fingerprint, "head", secrets.token_hex(16), w.addresses[1],
                    tls=client_context(load_credentials(credentials / "s1")))
    finally:
        w.stop()


def test_listening_beyond_loopback_needs_credentials_or_insecure(bundles: dict[int, Path]) -> None:
    """`serve --listen 0.0.0.0:0` without credentials refuses to start, naming --credentials and --insecure;
    with --insecure it starts and warns that the port is open to anyone."""
    refused = subprocess.run([*CLI, "serve", str(bundles[1]), "--stage", "0", "--listen", "0.0.0.0:0"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--credentials" in refused.stderr and "--insecure" in refused.stderr
    insecure = WorkerProcess(serve_command(bundles[1], 0, "0.0.0.0:0", ["--insecure"]), 0, stderr=subprocess.PIPE)
    try:
        insecure.wait_listening(120)
    finally:
        insecure.stop()
    assert insecure.process.stderr is not None
    assert "WITHOUT authentication or encryption" in insecure.process.stderr.read()


# ----- rows 5, 6, 7 and Must-include 4: hostile input bounded -----

def test_running_out_of_file_descriptors_does_not_stop_the_worker(bundles: dict[int, Path]) -> None:
    """With its descriptor limit nearly reached, a flood of connections makes accept() fail with EMFILE; the
    worker backs off, stays up, and serves a real head once the flood is gone."""
    expected = reference(bundles[1], PROMPT_A, 10)
    with workers(bundles[1]) as w:
        pid = w.pid(0)
        used = len(os.listdir(f"/proc/{pid}/fd"))
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (used + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        host, port = w.addresses[0].split(":")
        flood = [socket.create_connection((host, int(port)), timeout=10) for _ in range(64)]
        time.sleep(1.0)
        assert w.procs[0].process.poll() is None
        for sock in flood:
            sock.close()
        head = Head(bundles[1], w.addresses)
        try:
            assert list(head.generate(PROMPT_A, SamplingConfig(max_tokens=10))) == expected
        finally:
            head.close()
        assert w.procs[0].process.poll() is None


def test_oversized_frames_before_the_handshake_are_refused_without_allocating(bundles: dict[int, Path]) -> None:
    """Frames announcing 256 MiB before any handshake get an `oversized` Error at once and the worker's
    memory does not move (the cap before the handshake is a few KiB)."""
    with workers(bundles[1]) as w:
        pid, (host, port) = w.pid(0), w.addresses[0].split(":")
        before = rss_mb(pid)
        for _ in range(10):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(PREFIX.pack(b"OVSH", p.PROTOCOL_VERSION, 1, 0, 100, 256 * 1024 * 1024 - 200))
                reply = read_message(sock)
                assert isinstance(reply, p.Error) and reply.code == "oversized"
        assert rss_mb(pid) - before < 20


def test_a_frame_left_one_byte_short_is_dropped_at_its_deadline(bundles: dict[int, Path]) -> None:
    """A head that sends all but the last byte of a frame gets a `timeout` Error after --frame-timeout and
    the connection closes; the worker keeps serving."""
    with workers(bundles[1], "--frame-timeout", "1") as w:
        sock = raw_head(w.addresses[0], bundles[1])
        frame = encode(p.Ping(7))
        start = time.monotonic()
        sock.sendall(frame[:-1])
        reply = read_message(sock)
        assert isinstance(reply, p.Error) and reply.code == "timeout"
        assert time.monotonic() - start < 10
        assert sock.recv(1) == b""
        assert ask(raw_head(w.addresses[0], bundles[1]), p.Ping(8)) == p.Pong(8)


def test_connections_over_the_cap_are_closed_at_once(bundles: dict[int, Path]) -> None:
    """With --max-connections 4, a fifth connection is closed at once; when one of the four goes, a head is
    served again."""
    with workers(bundles[1], "--max-connections", "4") as w:
        host, port = w.addresses[0].split(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]
        time.sleep(0.3)
        extra = socket.create_connection((host, int(port)), timeout=10)
        try:
            assert extra.recv(1) == b""
        except ConnectionResetError:
            pass
        idle.pop().close()
        time.sleep(0.3)
        assert ask(raw_head(w.addresses[0], bundles[1]), p.Ping(1)) == p.Pong(1)


def test_streams_are_capped_and_disconnects_free_them_with_flat_memory(bundles: dict[int, Path]) -> None:
    """Past --max-streams-per-session an Open gets `busy`; 2,500 Opens over 100 sessions that vanish without
    Close leave the worker's memory flat and every stream free."""
    with workers(bundles[1], "--max-streams-per-session", "25") as w:
        pid = w.pid(0)
        sock = raw_head(w.addresses[0], bundles[1])
        for i in range(25):
            assert ask(sock, p.Open(i)) == p.OpenOk(i)
        refused = ask(sock, p.Open(25))
        assert isinstance(refused, p.Error) and refused.code == "busy"
        sock.close()
        baseline = None
        for n in range(100):
            sock = raw_head(w.addresses[0], bundles[1])
            for i in range(25):
                assert ask(sock, p.Open(i)) == p.OpenOk(i)
            sock.close()
            if n == 9:
                baseline = rss_mb(pid)
        time.sleep(0.5)
        assert baseline is not None and rss_mb(pid) - baseline < 30
        sock = raw_head(w.addresses[0], bundles[1])
        assert all(ask(sock, p.Open(i)) == p.OpenOk(i) for i in range(25))


# ----- rows 8, 11, 12 -----

def test_a_full_context_stops_with_finish_reason_length(bundles: dict[int, Path]) -> None:
    """Asking for more tokens than the rotary table holds (no eos ids to stop at) stops at the last position
    with finish reason "length", rather than failing."""
    with workers(bundles[1]) as w:
        head = Head(bundles[1], w.addresses)
        stats = Stats()
        try:
            tokens = list(head.generate(PROMPT_A, SamplingConfig(max_tokens=100000), stats))
        finally:
            head.close()
    # every position holds a fed token; the last token sampled needs none
    assert len(tokens) == 512 - len(PROMPT_A) + 1 and stats.finish_reason == "length"


def test_steps_are_checked_against_the_stages_own_state(bundles: dict[int, Path]) -> None:
    """A Step at the wrong position is refused with `position`, one with batch 2 is a malformed frame; an Open
    is acknowledged before any Step; a bad request keeps the connection."""
    with workers(bundles[1]) as w:
        sock = raw_head(w.addresses[0], bundles[1])
        assert ask(sock, p.Open(1)) == p.OpenOk(1)
        reply = ask(sock, step(1, 3, [1, 403]))
        assert isinstance(reply, p.Error) and reply.code == "position" and reply.reply_to == 0
        reply = ask(sock, p.Step(1, 1, 0, "argmax", p.Tensor.from_array(np.array([[1]], np.int64)), rewind=4))
        assert isinstance(reply, p.Error) and reply.code == "position"
        reply = ask(sock, step(1, 0, [1, 99999]))
        assert isinstance(reply, p.Error) and "token ids must be in [0, 512)" in reply.message
        assert ask(sock, p.Ping(5)) == p.Pong(5)
        body = np.zeros((2, 1), np.int64).tobytes()
        header = (b'{"kind":6,"stream":1,"step":2,"position":0,"want":"argmax",'
                  b'"tensor":{"dtype":"i64","shape":[2,1]}}')
        sock.sendall(PREFIX.pack(b"OVSH", p.PROTOCOL_VERSION, 6, 0, len(header), len(body)) + header + body)
        reply = read_message(sock)
        assert isinstance(reply, p.Error) and reply.code == "bad_header" and "batch 1" in reply.message


def test_a_session_slot_survives_a_failing_head(bundles: dict[int, Path]) -> None:
    """When every stage is gone, each queued request of a Scheduler ends with an error (no slot thread dies,
    run_all returns) and keeps the tokens it made."""
    with workers(bundles[2]) as w:
        head = Head(bundles[2], w.addresses, retry_s=0.5)
        session = Scheduler(head, streams=2)
        requests = [session.submit(PROMPT_A, SamplingConfig(max_tokens=480)) for _ in range(3)]
        deadline = time.monotonic() + 30
        while not requests[0].partial:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for proc in w.procs:
            proc.process.kill()
        for request in requests:
            assert request._done.wait(60)
        session.close()
        head.close()
    assert all(r.error is not None and r.finish_reason == "error" for r in requests)
    assert len(requests[0].partial) > 0


def test_sigterm_drains_in_flight_steps_and_exits_zero(bundles: dict[int, Path]) -> None:
    """SIGTERM mid-generation: the worker stops accepting, lets running steps finish, says so, exits 0."""
    command = [c for c in serve_command(bundles[1], 0, "127.0.0.1:0", ["--exact"]) if c != "-q"]
    worker = WorkerProcess(command, 0, stderr=subprocess.PIPE)
    try:
        head = Head(bundles[1], [worker.wait_listening(120)], retry_s=0)
        tokens = head.generate(PROMPT_A, SamplingConfig(max_tokens=400))
        next(tokens)
        proc = worker.process
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
        with pytest.raises(OvshardError):
            list(tokens)
        head.close()
        assert proc.stderr is not None
        assert "SIGTERM: stopped accepting, in-flight steps finished; exiting" in proc.stderr.read()
    finally:
        worker.stop()


def test_hello_with_wrong_fields_is_a_protocol_error_not_a_crash(bundles: dict[int, Path]) -> None:
    """A Hello with a short session id or an unknown field gets a `bad_header` Error; the worker lives on."""
    with workers(bundles[1]) as w:
        host, port = w.addresses[0].split(":")
        for header in (b'{"kind":1,"role":"head","protocol":5,"bundle_fingerprint":"x","stage":0,"session":"00"}',
                       b'{"kind":1,"role":"head","protocol":5,"bundle_fingerprint":"x","stage":0,"session":"'
                       + b"0" * 32 + b'","auth":{}}'):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(struct.pack("<4sHBBII", b"OVSH", p.PROTOCOL_VERSION, 1, 0, len(header), 0) + header)
                reply = read_message(sock)
                assert isinstance(reply, p.Error) and reply.code == "bad_header"
        assert ask(raw_head(w.addresses[0], bundles[1]), p.Ping(2)) == p.Pong(2)
