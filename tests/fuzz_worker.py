"""Fuzz a real stage worker over loopback TCP, then check it survived, still serves, did not bloat, leaked nothing.

    python tests/fuzz_worker.py --frames N [--seed S] [--workers W] [--bundle PATH]

One ``ovshard serve`` process (stage 0 of a one-stage fp32 stories260K bundle) takes N frames from W client
processes (one in-process client when W is 1). Most frames travel on long-lived handshaken sessions:

  (c) valid but hostile requests in batches: Open/Reset/Close of random stream ids, Steps with right and wrong
      positions, rewinds, compaction, out-of-range token ids, wrong dtypes and shapes, odd ``want``s, Pings,
      and requests whose frame was mutated but still decodes. A session ends cleanly, or with a message a head
      must not send (Result, HelloOk, OpenOk, Pong, Error, a second Hello), with (a) random bytes, (b) a
      valid frame with mutated bytes (bit flips, cuts, changed or huge lengths, a field swapped for random
      JSON), or (d) a drop mid-frame or with requests in flight.

Some connections never finish a handshake: random bytes, mutated or refused Hellos, a request before the
Hello, a Hello cut short. A background thread leaves frames half-sent, which the worker must time out.

Every reply is checked against :class:`SessionModel` (tests/fuzz_session.py), the worker's rules restated:
what each request is owed (OpenOk, Pong, a Result of a given shape, an Error with a given code, stream and
seq, or nothing), in request order; a malformed frame is owed the Error code the local decoder gives the same
bytes, then a close. After the fuzz the worker must be alive, generate the tokens it generated before, have
grown its RSS by at most RSS_BOUND_MB since warm-up, and have its whole capacity: MAX_CONNECTIONS head
sessions at once (one more turned away) and MAX_STREAMS streams before its worker-wide cap answers busy, so no
connection, session or stream leaked. Prints one JSON line; exits 1 on any failure, with each failure (and its
frames, in hex) on stderr.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
from fuzz_frames import (
    REPLY_TIMEOUT_S,
    close,
    decode_all,
    drain,
    half_close,
    mutate,
    random_bytes,
    receive,
    refused_hello,
    session_id,
)
from fuzz_session import (
    FRAME_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_STREAMS,
    MAX_STREAMS_PER_SESSION,
    PRE_AUTH_FRAME_BYTES,
    WANTS,
    Mismatch,
    SessionModel,
    Spec,
    expect_error,
)

from ovshard.bundle.manifest import bundle_fingerprint
from ovshard.errors import OvshardError
from ovshard.runtime.client.launch import WorkerProcess, serve_command
from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.framing import encode

STORIES = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"
PROMPT = [1, 403, 407]
WORKER_OPTIONS = ["--kv", "stateful",  # the stream messages: Batches are fuzzed by tests/batch_fuzz.py
                  "--max-connections", str(MAX_CONNECTIONS), "--max-sessions", str(MAX_CONNECTIONS),
                  "--max-streams", str(MAX_STREAMS), "--max-streams-per-session", str(MAX_STREAMS_PER_SESSION),
                  "--frame-timeout", str(FRAME_TIMEOUT_S)]
# How much the worker's RSS may grow after warm-up (which already filled every cap once). What the worker may
# keep on purpose is less: MAX_STREAMS KV caches of the tiny model (5 layers x 2 x 4 heads x 8 x 4 B = 1.25 KiB
# a position, 512 positions: 40 MiB in all, and freed when their sessions end), allocator slack (glibc keeps
# freed arenas for up to 8 x cores threads) and the log buffers. A leaked stream or frame buffer per
# connection, over the thousands of connections of a run, shows far above it.
RSS_BOUND_MB = 100.0


# ----- one client: sessions, side episodes, counts -----

@dataclass
class Counts:
    frames: int = 0
    connections: int = 0
    sessions: int = 0
    replies: int = 0
    results: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)

    def add(self, other: Counts) -> None:
        for name in ("frames", "connections", "sessions", "replies", "results"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for code, n in other.errors.items():
            self.errors[code] = self.errors.get(code, 0) + n
        self.failures += other.failures


class Client:
    """Sends exactly ``frames`` frames to the worker and checks every reply against :class:`SessionModel`."""

    def __init__(self, spec: Spec, frames: int, seed: int) -> None:
        self.spec, self.left, self.rng, self.seed = spec, frames, random.Random(seed), seed
        self.counts = Counts()
        self.model: SessionModel | None = None
        self.sock: socket.socket | None = None
        self.sent: list[tuple[int, bytes]] = []  # (connection, frame), the latest few: for a failure report

    def run(self) -> Counts:
        while self.left > 0:
            roll = self.rng.random()
            try:
                if roll < 0.03 or self.left < 3:
                    self.side_episode()
                elif self.model is None:
                    self.open_session()
                elif roll < 0.07:
                    self.end_session()
                else:
                    self.batch()
            except Mismatch as e:
                self.fail(str(e))
            except ConnectionRefusedError:
                self.fail("the worker refuses connections: is it still running?")
                break
            except OSError as e:
                self.fail(f"{type(e).__name__}: {e}")
        self.drop(abort=False)
        return self.counts

    # --- plumbing ---
    def fail(self, what: str) -> None:
        if len(self.counts.failures) < 20:
            self.counts.failures.append({"seed": self.seed, "what": what,
                                         "frames": [(c, f.hex()[:1000]) for c, f in self.sent[-4:]]})
        else:  # something is badly wrong: stop here
            self.left = 0
        self.drop(abort=True)

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.spec.host_port, timeout=REPLY_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.counts.connections += 1
        return sock

    def send(self, sock: socket.socket, frames: list[bytes]) -> None:
        self.left -= len(frames)
        self.counts.frames += len(frames)
        self.sent = (self.sent + [(self.counts.connections, f) for f in frames])[-8:]
        sock.sendall(b"".join(frames))

    def read(self, sock: socket.socket) -> p.Message:
        try:
            reply = receive(sock)
        except p.ProtocolError as e:
            raise Mismatch(f"the worker sent a frame its peers must refuse: {e}") from e
        except TimeoutError as e:
            raise Mismatch(f"no reply within {REPLY_TIMEOUT_S:.0f} s") from e
        except (p.ConnectionClosed, OSError) as e:
            raise Mismatch(f"the worker closed the connection early: {e}") from e
        self.counts.replies += 1
        if isinstance(reply, p.Error):
            self.counts.errors[reply.code] = self.counts.errors.get(reply.code, 0) + 1
        elif isinstance(reply, p.Result):
            self.counts.results += 1
        return reply

    def expect_close(self, sock: socket.socket) -> None:
        """Nothing more arrives: the worker closes (FIN or RST) within the reply timeout."""
        try:
            extra = receive(sock)
        except (p.ConnectionClosed, ConnectionResetError):
            return
        except TimeoutError as e:
            raise Mismatch(f"the worker kept the connection open {REPLY_TIMEOUT_S:.0f} s after it should close") from e
        except p.ProtocolError as e:
            raise Mismatch(f"the worker sent a frame its peers must refuse: {e}") from e
        raise Mismatch(f"expected the worker to close the connection, got {extra!r:.300}")

    def drop(self, abort: bool) -> None:
        if self.sock is not None:
            close(self.sock, abort)
        self.sock, self.model = None, None

    # --- sessions ---
    def open_session(self) -> None:
        self.sock = self.connect()
        session = session_id(self.rng)
        self.send(self.sock, [encode(p.Hello("head", p.PROTOCOL_VERSION, self.spec.fingerprint, 0, session))])
        if (reply := self.read(self.sock)) != p.HelloOk(0, self.spec.fingerprint, 1):
            raise Mismatch(f"expected HelloOk to a valid Hello, got {reply!r:.300}")
        self.model = SessionModel(self.spec, session)
        self.counts.sessions += 1

    def batch(self) -> None:
        """1-12 hostile requests (some with mutated frames that still decode) and a Ping, checked in order."""
        sock, model = self.sock, self.model
        assert sock is not None and model is not None
        frames, requests = [], []
        for _ in range(min(self.rng.randint(1, 12), self.left - 1)):
            msg = model.hostile_request(self.rng)
            data = encode(msg)
            if self.rng.random() < 0.1:
                mutated = mutate(data, self.rng)
                decoded, tail = decode_all(mutated, self.spec.max_frame)
                if tail is None and len(decoded) == 1 and isinstance(decoded[0], (p.Ping, p.Open, p.Reset, p.Close,
                                                                                   p.Step)):
                    msg, data = decoded[0], mutated
            frames.append(data)
            requests.append(msg)
        requests.append(p.Ping(self.rng.getrandbits(63)))
        self.send(sock, frames + [encode(requests[-1])])
        for msg in requests:
            model.settle(msg, lambda: self.read(sock))

    def end_session(self) -> None:
        sock, model, how = self.sock, self.model, self.rng.random()
        assert sock is not None and model is not None
        if how < 0.3:  # a clean close
            self.drop(abort=False)
        elif how < 0.5:  # a message a head must not send
            self.send(sock, [encode(model.forbidden_message(self.rng))])
            expect_error(self.read(sock), "unknown_kind", None, None)
            self.expect_close(sock)
            self.drop(abort=False)
        elif how < 0.85:  # random bytes or a mutated frame
            frame = encode(model.hostile_request(self.rng))
            self.malformed(sock, random_bytes(self.rng) if how < 0.6 else mutate(frame, self.rng), model)
        else:  # a drop: mid-frame, or with requests in flight
            frames = [encode(model.hostile_request(self.rng)) for _ in range(min(self.rng.randint(1, 6), self.left))]
            if how < 0.95:
                frames[-1] = frames[-1][:self.rng.randrange(len(frames[-1]))]
            self.send(sock, frames)
            self.drop(abort=self.rng.random() < 0.7)

    def malformed(self, sock: socket.socket, blob: bytes, model: SessionModel) -> None:
        """Send ``blob`` and half-close: owed are the replies to the frames the local decoder reads from it,
        then the Error for the frame it refuses, then a close."""
        self.send(sock, [blob])
        half_close(sock)
        messages, tail = decode_all(blob, self.spec.max_frame)
        if all(model.settle(msg, lambda: self.read(sock)) for msg in messages) and isinstance(tail, p.ProtocolError):
            expect_error(self.read(sock), tail.code, None, None)
        self.expect_close(sock)
        self.drop(abort=False)

    # --- connections that never finish a handshake ---
    def side_episode(self) -> None:
        sock, how = self.connect(), self.rng.random()
        hello = p.Hello("head", p.PROTOCOL_VERSION, self.spec.fingerprint, 0, session_id(self.rng))
        abort = True
        try:
            if how < 0.25:
                self.pre_auth(sock, random_bytes(self.rng))
            elif how < 0.55:
                self.pre_auth(sock, mutate(encode(hello), self.rng))
            elif how < 0.8:
                bad = refused_hello(self.spec, self.rng, self.model)
                self.send(sock, [encode(bad)])
                expect_error(self.read(sock), "refused", None, None)
                self.expect_close(sock)
            elif how < 0.9:  # a request before the Hello
                self.send(sock, [encode(self.rng.choice([p.Ping(1), p.Open(0), p.Close(0)]))])
                expect_error(self.read(sock), "bad_header", None, None, "expected Hello first")
                self.expect_close(sock)
            else:  # a Hello cut short, then a reset or a close
                data = encode(hello)
                self.send(sock, [data[:self.rng.randrange(len(data))]])
                abort = self.rng.random() < 0.5
            abort = abort and how >= 0.9
        finally:
            close(sock, abort)

    def pre_auth(self, sock: socket.socket, blob: bytes) -> None:
        """Bytes as a connection's first frame: owed is the Error the local decoder predicts, then a close."""
        self.send(sock, [blob])
        half_close(sock)
        messages, tail = decode_all(blob, PRE_AUTH_FRAME_BYTES)
        if messages and isinstance(messages[0], p.Hello):
            drain(sock)  # a Hello that survived mutation: accepted or refused, any answer will do
            return
        if messages:
            tail = p.ProtocolError("bad_header", "expected Hello first")
        if isinstance(tail, p.ProtocolError):
            expect_error(self.read(sock), tail.code, None, None)
        self.expect_close(sock)


def run_client(spec: Spec, frames: int, seed: int) -> Counts:
    return Client(spec, frames, seed).run()


class Staller(threading.Thread):
    """Until stopped: a head session sends half a frame and waits for the worker's Error "timeout" and close."""

    def __init__(self, spec: Spec, pid: int | None = None) -> None:
        super().__init__(name="staller", daemon=True)
        self.spec, self.stop, self.counts = spec, threading.Event(), Counts()
        self.pid, self.rss = pid, list[float]()  # the worker's RSS (MB) before each stall

    def run(self) -> None:
        rng = random.Random(0)
        while not self.stop.wait(0.2):
            if self.pid is not None:
                self.rss.append(round(rss_mb(self.pid), 1))
            client = Client(self.spec, 2, rng.getrandbits(32))
            try:
                client.open_session()
                assert client.sock is not None and client.model is not None
                frame = encode(client.model.hostile_request(rng))
                client.send(client.sock, [frame[:rng.randrange(1, len(frame))]])
                start = time.monotonic()
                expect_error(client.read(client.sock), "timeout", None, None)
                waited = time.monotonic() - start
                if not 0.9 * FRAME_TIMEOUT_S <= waited <= 2 * FRAME_TIMEOUT_S + 1:
                    raise Mismatch(f"a stalled frame timed out after {waited:.2f} s (--frame-timeout {FRAME_TIMEOUT_S})")
                client.expect_close(client.sock)
            except Mismatch as e:
                client.fail(f"stall: {e}")
            except ConnectionRefusedError:
                client.fail("stall: the worker refuses connections")
                return
            finally:
                client.drop(abort=False)
                self.counts.add(client.counts)


# ----- the checks after the fuzz -----

def handshake(spec: Spec) -> tuple[socket.socket, p.Message | None]:
    """A head connection with a fresh session, and the worker's answer (None: closed without one)."""
    sock = socket.create_connection(spec.host_port, timeout=REPLY_TIMEOUT_S)
    sock.sendall(encode(p.Hello("head", p.PROTOCOL_VERSION, spec.fingerprint, 0, secrets.token_hex(16))))
    try:
        return sock, receive(sock)
    except (p.ConnectionClosed, ConnectionResetError):
        return sock, None


def capacity(spec: Spec) -> dict[str, int]:
    """Fill the worker through the protocol: MAX_CONNECTIONS head sessions at once (one more turned away),
    then streams over three of them until the worker-wide cap answers busy. Returns how many of each are missing."""
    held: list[socket.socket] = []
    try:
        missing = {"leaked_connections": 0, "leaked_sessions": 0}
        for _ in range(MAX_CONNECTIONS):
            sock, reply = handshake(spec)
            held.append(sock)
            if not isinstance(reply, p.HelloOk):
                missing["leaked_sessions" if isinstance(reply, p.Error) else "leaked_connections"] += 1
        extra, reply = handshake(spec)
        extra.close()
        if reply is not None and not missing["leaked_connections"]:
            raise Mismatch(f"connection {MAX_CONNECTIONS + 1} was answered {reply!r:.200}: the cap is not enforced")
        opened, full = 0, False
        for sock in held[:3]:
            for stream in range(MAX_STREAMS_PER_SESSION):
                sock.sendall(encode(p.Open(stream)))
                reply = receive(sock)
                if reply != p.OpenOk(stream):
                    full = isinstance(reply, p.Error) and reply.code == "busy" and "--max-streams)" in reply.message
                    break
                opened += 1
            if full:
                break
        if not full:
            raise Mismatch(f"{opened} streams opened without the worker-wide cap of {MAX_STREAMS} answering busy")
        return {**missing, "leaked_streams": MAX_STREAMS - opened}
    finally:
        for sock in held:
            sock.close()


def warm_shapes(spec: Spec) -> None:
    """Run a Step of every token count in Spec.tokens once (each from position 0, then a Reset)."""
    sock, reply = handshake(spec)
    try:
        if not isinstance(reply, p.HelloOk):
            raise Mismatch(f"warm-up: expected HelloOk, got {reply!r:.200}")
        sock.sendall(encode(p.Open(0)))
        receive(sock)
        for seq, tokens in enumerate(spec.tokens):
            step = p.Step(0, seq, 0, WANTS[seq % len(WANTS)], p.Tensor.from_array(np.ones((1, tokens), np.int64)))
            sock.sendall(encode(step) + encode(p.Reset(0)))
            receive(sock)
    finally:
        sock.close()


def settled_capacity(spec: Spec, attempts: int = 5) -> dict[str, int]:
    """:func:`capacity`, tried again after a pause while something is missing (the thread of a connection
    closed a moment ago may still be finishing its step)."""
    for _ in range(attempts - 1):
        missing = capacity(spec)
        if not any(missing.values()):
            return missing
        time.sleep(2.0)
    return capacity(spec)


# ----- the run -----

def cached_bundle(root: Path | None = None) -> Path:
    """A one-stage fp32 bundle of stories260K, compiled once into the temp folder and reused while it verifies."""
    from ovshard.bundle.manifest import read_manifest, verify_files

    out = (root or Path(tempfile.gettempdir())) / "ovshard-fuzz" / "stories260K-fp32-1stage"
    try:
        verify_files(out, read_manifest(out), stages=[0])
        return out
    except Exception:  # missing, partial, or from an older ovshard: compile afresh
        pass
    from ovshard.compile import CompileConfig, compile_bundle
    from ovshard.passes import WeightFormat

    building = out.with_name(f"{out.name}.{os.getpid()}")
    compile_bundle(CompileConfig(STORIES, building, weights=WeightFormat("fp32"), stages=1))
    shutil.rmtree(out, ignore_errors=True)
    try:
        building.rename(out)
    except OSError:  # another run got there first
        shutil.rmtree(building, ignore_errors=True)
    return out


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def generate(bundle: Path, address: str) -> list[int]:
    from ovshard.runtime.client.head import Head
    from ovshard.runtime.engine.sampler import SamplingConfig

    head = Head(bundle, [address], timeout=30, retry_s=0)
    try:
        return list(head.generate(PROMPT, SamplingConfig(max_tokens=8)))
    finally:
        head.close()


def run_fuzz(frames: int, seed: int = 0, workers: int = 1, bundle: Path | None = None,
             log: IO[str] | None = None) -> dict:
    """Fuzz one fresh worker process with ``frames`` frames from ``workers`` clients; the report as a dict."""
    bundle = Path(bundle) if bundle is not None else cached_bundle()
    with tempfile.TemporaryDirectory(prefix="ovshard-fuzz-") as tmp, open(Path(tmp) / "worker.log", "w+") as stderr:
        worker = WorkerProcess(serve_command(bundle, 0, "127.0.0.1:0", WORKER_OPTIONS), 0, stderr=stderr)
        try:
            address = worker.wait_listening(120)
            return fuzz(worker, address, bundle, frames, seed, workers, stderr, log or sys.stderr)
        finally:
            worker.stop()


def fuzz(worker: WorkerProcess, address: str, bundle: Path, frames: int, seed: int, workers: int,
         worker_log: IO[str], log: IO[str]) -> dict:
    from ovshard.bundle.manifest import read_manifest

    manifest = read_manifest(bundle)
    host, port = address.rsplit(":", 1)
    spec = Spec((host, int(port)), bundle_fingerprint(bundle), manifest.architecture.vocab_size,
                manifest.runtime_hints.max_positions, manifest.architecture.hidden_size)
    reference = generate(bundle, address)
    warm_shapes(spec)
    warmup = run_client(spec, min(5000, max(frames // 20, 200)), seed ^ 0x5EED)  # every path once, before RSS
    try:
        settled_capacity(spec, attempts=1)  # and every cap filled once
    except (Mismatch, OSError, OvshardError) as e:
        warmup.failures.append({"what": f"capacity check after warm-up: {e}"})
    rss_before = rss_mb(worker.process.pid)
    counts, staller = Counts(), Staller(spec, worker.process.pid)
    staller.start()
    start = time.monotonic()
    if workers == 1:
        counts.add(run_client(spec, frames, seed))
    else:
        shares = [frames // workers + (i < frames % workers) for i in range(workers)]
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for part in pool.map(run_client, [spec] * workers, shares, [seed * 1000 + i for i in range(workers)]):
                counts.add(part)
    seconds = time.monotonic() - start
    staller.stop.set()
    staller.join()
    alive = worker.process.poll() is None
    missing = dict.fromkeys(("leaked_connections", "leaked_sessions", "leaked_streams"), -1)
    if alive:
        try:
            missing = settled_capacity(spec)
        except (Mismatch, OSError, OvshardError) as e:
            counts.failures.append({"what": f"capacity check: {e}"})
    same = alive and generate(bundle, address) == reference
    growth = rss_mb(worker.process.pid) - rss_before if alive else float("nan")
    worker_log.flush()
    worker_log.seek(0)
    internal = sum("internal error" in line or "Traceback" in line for line in worker_log)
    failures = warmup.failures + counts.failures + staller.counts.failures
    for failure in failures:
        print(json.dumps(failure), file=log)
    report = {"frames": counts.frames, "seconds": round(seconds, 2), "frames_per_s": round(counts.frames / seconds),
              "connections": counts.connections, "sessions": counts.sessions, "replies": counts.replies,
              "results": counts.results, "errors": dict(sorted(counts.errors.items())),
              "stalls": staller.counts.sessions, "workers": workers, "worker_crashes": int(not alive),
              "same_generation": same, "rss_growth_mb": round(growth, 1),
              "rss_mb": [round(rss_before, 1), *staller.rss[::max(1, len(staller.rss) // 8)]], "internal_errors": internal,
              "failures": len(failures), **missing}
    report["ok"] = bool(alive and same and growth <= RSS_BOUND_MB and not internal and not failures
                        and not any(missing.values()))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--frames", type=int, required=True, help="frames to send in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)),
                        help="client processes (default: one per core but one, at most 16)")
    parser.add_argument("--bundle", type=Path, help="a one-stage bundle (default: stories260K fp32, compiled "
                        "once into the temp folder)")
    args = parser.parse_args(argv)
    os.environ.setdefault("CI", "true")  # no OpenVINO telemetry forks in the worker
    report = run_fuzz(args.frames, args.seed, args.workers, args.bundle)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
