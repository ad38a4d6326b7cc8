"""A stage worker: serves one stage of a bundle over TCP in the chain head -> 0 -> ... -> N-1 -> head.

Connections start with Hello. A *head* connection carries Open/Reset/Close/Ping (and, at stage 0,
Step); the last stage answers every Step on the head connection that opened the stream. An
*upstream* connection (from the previous stage) carries Step. A stage before the last connects to
the ``next_hop`` the head names and forwards each Step, its input replaced by the activations. One
network traversal per decode step. A malformed frame gets an Error and closes that connection only.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from ovshard.bundle import names
from ovshard.bundle.manifest import read_manifest, verify_files
from ovshard.errors import BundleError, OvshardError
from ovshard.runtime import protocol as p
from ovshard.runtime.kv import KVCache, StepInputs
from ovshard.runtime.scores import Scores
from ovshard.runtime.transport import Connection, bundle_fingerprint, connect

log = logging.getLogger(__name__)

OPEN_WAIT_S = 5.0  # how long a Step waits for its stream's Open to arrive on the head connection


@dataclass
class StreamSlot:
    """One user stream at this stage: its KV cache (stateful request + mask) and its head."""

    cache: KVCache
    head: Connection | None  # where the last stage sends this stream's results


class StageWorker:
    def __init__(self, bundle: Path, stage: int, device: str = "CPU", config: dict | None = None,
                 cache_dir: Path | None = None, wire_dtype: str = p.ACTIVATION_WIRE_DTYPE) -> None:
        self.bundle = Path(bundle)
        self.manifest = read_manifest(self.bundle)
        if not 0 <= stage < self.manifest.num_stages:
            raise BundleError(f"--stage {stage}: the bundle has stages 0..{self.manifest.num_stages - 1}")
        verify_files(self.bundle, self.manifest, stages=[stage])
        self.stage, self.entry = stage, self.manifest.stages[stage]
        self.last = stage == self.manifest.num_stages - 1
        self.fingerprint = bundle_fingerprint(self.bundle)
        self.max_positions = self.manifest.runtime_hints.max_positions
        self.wire_dtype = wire_dtype
        core = ov.Core()
        core.set_property({"CACHE_DIR": str(cache_dir or self.bundle / ".ov_cache")})
        log.info("stage %d: compiling %s on %s", stage, self.entry.model_xml, device)
        self.compiled = core.compile_model(str(self.bundle / self.entry.model_xml), device, config or {})
        self.streams: dict[int, StreamSlot] = {}
        self.downstream: Connection | None = None
        self.lock = threading.Lock()
        self.opened = threading.Condition()
        self.server: socket.socket | None = None

    # ----- serving -----
    def listen(self, host: str, port: int) -> str:
        """Bind ``host:port`` (port 0: a free port the system picks); returns the address bound."""
        try:
            self.server = socket.create_server((host, port))
        except OSError as e:
            raise OvshardError(f"stage {self.stage} cannot listen on {host}:{port}: {e.strerror or e}; "
                               "choose another --listen port, or port 0 for a free one") from e
        address = self._where()
        log.info("stage %d: listening on %s", self.stage, address)
        return address

    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop`, one thread each; call :meth:`listen` first."""
        if self.server is None:
            raise OvshardError(f"stage {self.stage} is not listening: call listen(host, port) first")
        while True:
            try:
                sock, addr = self.server.accept()
            except OSError:
                return  # closed by stop()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._handle, args=(Connection(sock, f"{addr[0]}:{addr[1]}"),),
                             daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    def _handle(self, conn: Connection) -> None:
        try:
            role = self._handshake(conn)
            while True:
                msg = conn.receive()
                try:
                    self._dispatch(conn, role, msg)
                except p.ProtocolError:
                    raise
                except (OvshardError, RuntimeError, ValueError) as e:  # a bad request, not a bad frame
                    self._report(conn, msg, e)
        except p.ConnectionClosed:
            pass
        except p.ProtocolError as e:
            log.warning("stage %d: malformed frame from %s: %s", self.stage, conn.peer, e)
            self._try_send(conn, p.Error(e.code, f"stage {self.stage}: {e}"))
        except OvshardError as e:
            log.warning("stage %d: %s", self.stage, e)
            self._try_send(conn, p.Error("failed", f"stage {self.stage}: {e}"))
        finally:
            conn.close()

    def _report(self, conn: Connection, msg: p.Message, error: Exception) -> None:
        """Tell the head of the stream (or the sender) that a request failed; keep the connection."""
        stream = getattr(msg, "stream", None)
        slot = self.streams.get(stream) if stream is not None else None
        log.warning("stage %d: %s of stream %s failed: %s", self.stage, type(msg).__name__, stream, error)
        self._try_send(slot.head if slot and slot.head else conn,
                       p.Error("failed", f"stage {self.stage}: {error}", stream))

    def _try_send(self, conn: Connection, msg: p.Message) -> None:
        try:
            conn.send(msg)
        except OSError:
            pass

    def _handshake(self, conn: Connection) -> str:
        hello = conn.receive()
        if not isinstance(hello, p.Hello):
            raise p.ProtocolError("bad_header", f"expected Hello first, got {type(hello).__name__}")
        problem = None
        if hello.stage != self.stage:
            problem = f"this node serves stage {self.stage}, the peer expected stage {hello.stage}"
        elif hello.bundle_fingerprint != self.fingerprint:
            problem = (f"bundle mismatch: this node serves {self.fingerprint[:19]}..., the peer has "
                       f"{hello.bundle_fingerprint[:19]}...; copy the same bundle to every node")
        if problem:
            log.warning("stage %d: refused %s: %s", self.stage, conn.peer, problem)
            conn.send(p.Error("refused", f"stage {self.stage} at {self._where()}: {problem}"))
            raise p.ConnectionClosed(problem, clean=True)
        if hello.role == "head" and hello.next_hop and not self.last:
            self._connect_downstream(hello.next_hop)
        conn.send(p.HelloOk(self.stage, self.fingerprint, self.manifest.num_stages))
        return hello.role

    def _where(self) -> str:
        if self.server is None:
            return "?"
        host, port = self.server.getsockname()[:2]
        return f"{host}:{port}"

    def _connect_downstream(self, address: str) -> None:
        with self.lock:
            if self.downstream is not None and self.downstream.peer == address:
                return
            self.downstream = connect(address, self.stage + 1, self.fingerprint, "upstream")
            threading.Thread(target=self._drain_downstream, args=(self.downstream,), daemon=True).start()

    def _drain_downstream(self, conn: Connection) -> None:
        """Errors the next stage reports about our Steps are logged (the head hears them too)."""
        try:
            while True:
                msg = conn.receive()
                if isinstance(msg, p.Error):
                    log.warning("stage %d: next stage reported: %s", self.stage, msg.message)
        except (p.ConnectionClosed, p.ProtocolError, OSError):
            pass

    # ----- messages -----
    def _dispatch(self, conn: Connection, role: str, msg: p.Message) -> None:
        if isinstance(msg, p.Ping):
            conn.send(p.Pong(msg.nonce))
        elif isinstance(msg, p.Open):
            with self.opened:
                self.streams[msg.stream] = StreamSlot(KVCache(self.compiled.create_infer_request()),
                                                      conn if role == "head" else None)
                self.opened.notify_all()
        elif isinstance(msg, p.Reset):
            self._slot(msg.stream).cache.reset()
        elif isinstance(msg, p.Close):
            self.streams.pop(msg.stream, None)
        elif isinstance(msg, p.Step):
            self._step(conn, msg)
        else:
            raise p.ProtocolError("unknown_kind", f"stage {self.stage} does not take {type(msg).__name__}")

    def _slot(self, stream: int) -> StreamSlot:
        """The open stream; waits briefly, as a Step forwarded by the previous stage can overtake the
        head's Open to this stage (they travel on different connections)."""
        with self.opened:
            self.opened.wait_for(lambda: stream in self.streams, timeout=OPEN_WAIT_S)
            slot = self.streams.get(stream)
        if slot is None:
            raise OvshardError(f"stream {stream} is not open at stage {self.stage}; send Open first")
        return slot

    def _step(self, conn: Connection, msg: p.Step) -> None:
        slot = self._slot(msg.stream)
        x = msg.tensor.to_array()
        seq = x.shape[1]
        if len(msg.mask_delta) != seq:
            raise OvshardError(f"Step of stream {msg.stream}: {seq} new tokens but {len(msg.mask_delta)} "
                               "mask entries")
        start = time.perf_counter()
        primary = names.INPUT_IDS if self.stage == 0 else names.HIDDEN_STATES
        inputs = StepInputs(primary, x if self.stage == 0 else x.astype(np.float32), msg.position,
                            msg.mask_delta, self.max_positions)
        try:
            out = slot.cache.step(inputs, self.compiled.output(0), msg.rewind, msg.compact)
        except ValueError as e:  # a rewind past the start of the cache
            raise OvshardError(f"Step of stream {msg.stream}: {e}") from e
        timings = {**msg.timings, f"stage{self.stage}": time.perf_counter() - start}
        if not self.last:
            if self.downstream is None:
                raise OvshardError(f"stage {self.stage} has no next stage: the head did not name one")
            self.downstream.send(p.Step(msg.stream, msg.seq, msg.position, msg.mask_delta, msg.want,
                                        p.Tensor.from_array(out, self.wire_dtype), timings, msg.rewind,
                                        msg.compact))
            return
        (slot.head or conn).send(self._answer(msg, out, timings))

    @staticmethod
    def _answer(msg: p.Step, logits: np.ndarray, timings: dict[str, float]) -> p.Result:
        """What the head's sampler needs, and no more: argmax ids, top-k, or rows of logits."""
        scores = Scores.from_logits(logits[0], msg.want)
        indices = None if scores.indices is None else p.Tensor.from_array(scores.indices[None])
        values = scores.values[None]
        return p.Result(msg.stream, msg.seq, p.Tensor.from_array(values, None if values.dtype == np.int64 else "f32"),
                        timings, indices)

