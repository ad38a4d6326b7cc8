"""A stage worker: serves one stage of a bundle over TCP in the chain head -> 0 -> ... -> N-1 -> head.

Connections start with Hello (over TLS when the worker has credentials). A *head* connection opens a
session (128 random bits the head chose) and carries Open/Reset/Close/Ping for that session's streams
(and, at stage 0, its Steps); the last stage answers every Step on the head connection of the step's
session. An *upstream* connection (from the previous stage) is one session's link and carries its Steps.
A stage before the last links to the ``next_hop`` the head names, for that session only, so a head can
steer only its own activations. A session's streams live exactly as long as its head connection: a
client that disconnects (or dies) frees its streams on every stage, since every stage sees its own head
connection close.

Hostile input is bounded (``Limits``): a few KiB per frame until the handshake is done, a deadline on
every frame that has begun, a cap on connections, sessions and streams, accept errors (EMFILE) survived.
A malformed frame is answered with an Error and closes that connection only; a bad request is answered
with an Error and the connection stays.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
import threading
import time
from pathlib import Path

import numpy as np

from ovshard.errors import OvshardError
from ovshard.runtime.node.backend import StageBackend
from ovshard.runtime.node.batches import batch_answers, forward_batch
from ovshard.runtime.node.config import Limits
from ovshard.runtime.node.heads import HeadTable, RequestError, SessionState
from ovshard.runtime.node.steps import answer
from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.framing import MAX_HEADER_BYTES
from ovshard.runtime.wire.transport import Connection, StageUnreachable, connect

log = logging.getLogger(__name__)

_ACCEPT_BACKOFF_S = (0.05, 1.0)  # first and longest pause after accept() fails (EMFILE and co.)
# accept() wakes this often: a SIGTERM the kernel hands to another thread (OpenVINO's, a connection's) only
# sets a flag, and Python runs its handler when the main thread next runs bytecode, never inside a blocked accept()
_ACCEPT_POLL_S = 0.5
_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class StageWorker:
    """One stage of a bundle served over TCP: the server, its connections and sessions, over a
    :class:`~ovshard.runtime.node.backend.StageBackend` that loads the stage and runs it (the arguments it
    takes, ``kv`` and ``slice_logits`` among them, are described there)."""

    def __init__(self, bundle: Path, stage: int, device: str = "CPU", config: dict | None = None,
                 cache_dir: Path | None = None, wire_dtype: str = p.ACTIVATION_WIRE_DTYPE,
                 limits: Limits | None = None, server_tls: ssl.SSLContext | None = None,
                 client_tls: ssl.SSLContext | None = None, slice_logits: bool = True, kv: str = "auto",
                 kv_blocks: int | None = None, static_decode: bool = True) -> None:
        self.backend = StageBackend(bundle, stage, device, config, cache_dir, slice_logits, kv, kv_blocks,
                                    static_decode)
        self.stage, self.manifest = stage, self.backend.manifest
        self.wire_dtype, self.limits = wire_dtype, limits or Limits()
        # the largest frame this stage can need: a Step of every position, ids (stage 0) or f32 activations
        per_token = 8 if stage == 0 else 4 * self.manifest.architecture.hidden_size
        self.max_frame = min(self.limits.max_frame_bytes, MAX_HEADER_BYTES + self.backend.max_positions * per_token)
        self.server_tls, self.client_tls = server_tls, client_tls
        self.heads = HeadTable(stage, self.limits)
        self.connections: set[Connection] = set()
        self.lock = threading.Lock()  # guards connections and counters
        self.in_flight = 0
        self.steps, self.compute_s = 0, 0.0  # Steps run and their compute time, for `ovshard status`
        self.idle = threading.Condition(self.lock)  # notified when in_flight drops
        self.server: socket.socket | None = None
        self._stopping = False

    # ----- serving -----
    def listen(self, host: str, port: int, wait_s: float = 0.0) -> str:
        """Bind ``host:port`` (port 0: a free port the system picks); returns the address bound. A port still in
        use is tried again for ``wait_s`` seconds (a stage moved onto its node by ``up`` takes the port of one that
        Ray has stopped and whose process may not have exited yet)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.server = socket.create_server((host, port),
                                                   family=socket.AF_INET6 if ":" in host else socket.AF_INET)
                break
            except OSError as e:
                if e.errno == errno.EADDRINUSE and port and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                raise OvshardError(f"stage {self.stage} cannot listen on {host}:{port}: {e.strerror or e}; "
                                   "choose another --listen port, or port 0 for a free one") from e
        self.server.settimeout(_ACCEPT_POLL_S)  # accepted sockets still block: the default timeout is None
        address = self._where()
        log.info("stage %d: listening on %s%s", self.stage, address, " (TLS)" if self.server_tls else "")
        return address

    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop`, one thread each; call :meth:`listen` first."""
        if self.server is None:
            raise OvshardError(f"stage {self.stage} is not listening: call listen(host, port) first")
        pause = _ACCEPT_BACKOFF_S[0]
        while not self._stopping:
            try:
                sock, addr = self.server.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stopping:
                    return
                if e.errno in _RESOURCE_ERRNOS:  # out of descriptors or memory: back off, keep serving
                    log.warning("stage %d: accept failed (%s); pausing %.2f s", self.stage, e.strerror, pause)
                    time.sleep(pause)
                    pause = min(2 * pause, _ACCEPT_BACKOFF_S[1])
                else:
                    log.warning("stage %d: accept failed: %s", self.stage, e)
                continue
            pause = _ACCEPT_BACKOFF_S[0]
            self._admit(sock, f"{addr[0]}:{addr[1]}")

    def _admit(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # replies go out at once, not after an ACK
        except OSError:
            pass  # the peer is gone already; the handshake will find out
        with self.lock:
            full = len(self.connections) >= self.limits.max_connections
            if not full:
                conn = Connection(sock, peer)
                self.connections.add(conn)
        if full:
            log.warning("stage %d: refused %s: %d connections open (--max-connections)", self.stage, peer,
                        self.limits.max_connections)
            sock.close()
            return
        try:
            threading.Thread(target=self._handle, args=(conn,), name=f"conn-{peer}", daemon=True).start()
        except RuntimeError:  # no thread to be had
            self._forget(conn)

    def stop(self) -> None:
        """Stop accepting; serve_forever returns."""
        self._stopping = True
        if self.server is not None:
            try:
                self.server.shutdown(socket.SHUT_RDWR)  # wakes an accept() blocked in another thread
            except OSError:
                pass
            self.server.close()

    def drain(self, timeout: float | None = None) -> int:
        """Refuse new sessions and streams, stop accepting, wait for in-flight steps (at most ``timeout``,
        default Limits.drain_s), then close every connection. Returns the steps still running at the end."""
        self.heads.drain()
        self.stop()
        with self.idle:
            self.idle.wait_for(lambda: self.in_flight == 0, timeout=self.limits.drain_s if timeout is None else timeout)
            left = self.in_flight
            conns = list(self.connections)
        for conn in conns:
            conn.close()
        return left

    def summary(self) -> str:
        """What the stage ran: its steps (Steps and Batches) and how many one-row steps took the static copy."""
        with self.lock:
            steps, compute_s = self.steps, self.compute_s
        static = self.backend.static_steps
        copy = "no static decode copy" if static is None else f"{static} one-row steps on the static decode copy"
        return f"ran {steps} steps ({compute_s:.2f} s of compute), {copy}"

    # ----- one connection -----
    def _handle(self, conn: Connection) -> None:
        session: SessionState | None = None
        role = "?"
        try:
            self._secure(conn)
            role, session = self._handshake(conn)
            self._serve(conn, role, session)
        except (p.ConnectionClosed, OSError):
            pass
        except p.ProtocolError as e:
            log.warning("stage %d: malformed frame from %s: %s", self.stage, conn.peer, e)
            self._try_send(conn, p.error(e.code, f"stage {self.stage}: {e}"))
        except RequestError as e:
            log.warning("stage %d: refused %s: %s", self.stage, conn.peer, e)
            self._try_send(conn, p.error(e.code, f"stage {self.stage} at {self._where()}: {e}"))
        except Exception as e:  # a bug here must not kill the worker or leak the connection
            log.error("stage %d: internal error on %s: %s: %s", self.stage, conn.peer, type(e).__name__, e)
            log.debug("internal error", exc_info=True)
            self._try_send(conn, p.error("internal", f"stage {self.stage}: internal error: {type(e).__name__}"))
        finally:
            if session is not None:
                self._end(session, conn, role)
            self._forget(conn)

    def _forget(self, conn: Connection) -> None:
        conn.close()
        with self.lock:
            self.connections.discard(conn)

    def _secure(self, conn: Connection) -> None:
        """The TLS handshake, within the handshake timeout; the peer's certificate names its role."""
        if self.server_tls is None:
            return
        try:
            conn.secure(self.server_tls, self.limits.handshake_timeout_s)
        except (ssl.SSLError, OvshardError) as e:
            log.warning("stage %d: TLS handshake with %s failed: %s", self.stage, conn.peer, e)
            raise p.ConnectionClosed(str(e), clean=False) from e

    def _serve(self, conn: Connection, role: str, session: SessionState) -> None:
        while True:
            msg = conn.receive(self.max_frame, deadline_s=self.limits.frame_timeout_s)
            try:
                self._dispatch(conn, role, session, msg)
            except RequestError as e:
                stream, number = getattr(msg, "stream", None), getattr(msg, "step", getattr(msg, "tick", None))
                what = f"stream {stream}" if stream is not None else f"tick {number}"
                log.warning("stage %d: %s of %s refused: %s", self.stage, type(msg).__name__, what, e)
                self._try_send(session.head, p.error(e.code, f"stage {self.stage}: {e}", stream, number))

    def _try_send(self, conn: Connection, msg: p.Message) -> bool:
        try:
            conn.send(msg)
            return True
        except (OSError, p.ProtocolError):
            return False

    def _handshake(self, conn: Connection) -> tuple[str, SessionState]:
        hello = conn.receive(self.limits.pre_auth_frame_bytes, deadline_s=self.limits.handshake_timeout_s,
                             idle_s=self.limits.handshake_timeout_s)
        if not isinstance(hello, p.Hello):
            raise p.ProtocolError("bad_header", f"expected Hello first, got {type(hello).__name__}")
        self._check_hello(conn, hello)
        if hello.role == "head":
            session = self._open_session(conn, hello)
        else:
            session = self._attach_upstream(conn, hello)
        granted = 0 if session.grant is None else len(session.grant)
        conn.send(p.HelloOk(self.stage, self.backend.fingerprint, self.manifest.num_stages, self.backend.block_size,
                            granted))
        conn.sock.settimeout(None)
        return hello.role, session

    def _check_hello(self, conn: Connection, hello: p.Hello) -> None:
        if hello.protocol != p.PROTOCOL_VERSION:
            raise RequestError("refused", f"the peer's Hello names protocol {hello.protocol}, this node speaks "
                                          f"{p.PROTOCOL_VERSION}: run the same ovshard on every node")
        if hello.role == "upstream" and self.stage == 0:
            raise RequestError("refused", "stage 0 takes Steps from the head only; no stage comes before it")
        if hello.stage != self.stage:
            raise RequestError("refused", f"this node serves stage {self.stage}, the peer expected stage {hello.stage}")
        ours = self.backend.fingerprint
        if hello.bundle_fingerprint != ours:
            raise RequestError("refused", f"bundle mismatch: this node serves {ours[:19]}..., the peer "
                                          f"has {hello.bundle_fingerprint[:19]}...; copy the same bundle to every node")
        if self.heads.draining:
            raise RequestError("draining", "this worker is shutting down")
        wanted = {"head": "head", "upstream": "stage"}[hello.role]
        if conn.identity is not None and conn.identity[0] != wanted:
            raise RequestError("unauthorized", f"a {hello.role} connection needs a {wanted!r} certificate; "
                                               f"{conn.identity[1]} holds a {conn.identity[0]!r} one")
        if hello.role == "upstream" and hello.next_hop is not None:
            raise RequestError("refused", "only a head names a next_hop")

    def _open_session(self, conn: Connection, hello: p.Hello) -> SessionState:
        session = self.heads.admit(hello.session, conn)
        pool = self.backend.pool
        if hello.kv_blocks is not None and pool is not None:
            try:
                session.grant = pool.grant(hello.kv_blocks)
            except RequestError:
                self._drop(session)
                raise
        if hello.next_hop is not None and not self.backend.last:
            try:
                self._link(session, hello.next_hop)
            except OvshardError as e:
                self._drop(session)
                raise RequestError("unavailable", f"cannot link to the next stage: {e}") from e
        return session

    def _link(self, session: SessionState, address: str) -> None:
        """This session's link to the next stage (whose head connection for it exists already)."""
        downstream = connect(address, self.stage + 1, self.backend.fingerprint, "upstream", session.id,
                             tls=self.client_tls)
        with session.lock:
            session.downstream, session.next_hop = downstream, address
        threading.Thread(target=self._drain_downstream, args=(session, downstream), daemon=True).start()

    def _attach_upstream(self, conn: Connection, hello: p.Hello) -> SessionState:
        session = self.heads.get(hello.session)
        with session.lock:
            if session.upstream:
                raise RequestError("refused", "this session has its upstream link already")
            session.upstream.append(conn)
        return session

    def _end(self, session: SessionState, conn: Connection, role: str) -> None:
        if role == "head":
            self._drop(session)
        else:
            with session.lock:
                if conn in session.upstream:
                    session.upstream.remove(conn)

    def _drop(self, session: SessionState) -> None:
        """The head is gone: free the session's streams and close its links."""
        freed = self.heads.drop(session)
        with session.lock:
            grant, session.grant = session.grant, None
        if grant is not None and self.backend.pool is not None:
            self.backend.pool.release(grant)
        log.info("stage %d: session %s... ended, %d streams freed", self.stage, session.id[:8], freed)

    def _where(self) -> str:
        if self.server is None:
            return "?"
        try:
            host, port = self.server.getsockname()[:2]
        except OSError:
            return "?"
        return f"{host}:{port}"

    def _drain_downstream(self, session: SessionState, conn: Connection) -> None:
        """Errors the next stage reports about our Steps are logged (the head hears them too)."""
        try:
            while True:
                msg = conn.receive(MAX_HEADER_BYTES, deadline_s=self.limits.frame_timeout_s)
                if isinstance(msg, p.Error):
                    log.warning("stage %d: next stage reported: %s", self.stage, msg.message)
        except (p.ConnectionClosed, p.ProtocolError, OSError):
            pass
        with session.lock:
            if session.downstream is conn:
                session.downstream = None

    # ----- messages -----
    def _dispatch(self, conn: Connection, role: str, session: SessionState, msg: p.Message) -> None:
        if isinstance(msg, p.Ping):
            conn.send(p.Pong(msg.nonce))
        elif isinstance(msg, p.Step) and (role == "upstream" or self.stage == 0):
            self._step(session, msg)
        elif isinstance(msg, p.Batch) and (role == "upstream" or self.stage == 0):
            self._batch(session, msg)
        elif role != "head":
            raise p.ProtocolError("unknown_kind", f"an upstream link carries Step and Ping, not {type(msg).__name__}")
        elif isinstance(msg, p.Open):
            if self.backend.paged is not None:
                raise RequestError("refused", f"stage {self.stage} keeps a paged KV cache: it runs Batches, not "
                                              "streams (start the worker with --kv stateful for streams)")
            self.heads.open_stream(session, msg.stream, self.backend.new_stream)
            conn.send(p.OpenOk(msg.stream))
        elif isinstance(msg, p.Reset):
            self.heads.stream(session, msg.stream).reset()
        elif isinstance(msg, p.Close):
            with session.lock:
                session.streams.pop(msg.stream, None)
        elif isinstance(msg, p.Step):
            raise RequestError("refused", f"stage {self.stage} takes Steps from stage {self.stage - 1}, not the head")
        else:
            raise p.ProtocolError("unknown_kind", f"stage {self.stage} does not take {type(msg).__name__}")

    def _begin(self) -> None:
        with self.lock:
            self.in_flight += 1

    def _done(self, compute_s: float | None) -> None:
        """A step ended; ``compute_s`` is its compute time when it ran (counted for `ovshard status`)."""
        with self.idle:
            self.in_flight -= 1
            if compute_s is not None:
                self.steps, self.compute_s = self.steps + 1, self.compute_s + compute_s
            self.idle.notify_all()

    def _step(self, session: SessionState, msg: p.Step) -> None:
        cache = self.heads.stream(session, msg.stream)
        x = self.backend.step_input(msg, cache)
        self._begin()
        compute: float | None = None
        try:
            out, compute = self.backend.run_step(msg, cache, x)
            timings = {**msg.timings, f"stage{self.stage}": compute}
            self._pass_on(session, msg, out, timings)
        finally:
            self._done(compute)

    def _batch(self, session: SessionState, msg: p.Batch) -> None:
        grant = session.grant
        x = self.backend.batch_input(msg, grant)
        assert grant is not None, "batch_input refuses a session without blocks"
        self._begin()
        compute: float | None = None
        try:
            run = self.backend.run_batch(msg, grant, x)
            compute = run.compute_s
            timings = {**msg.timings, f"stage{self.stage}": compute}
            if self.backend.last:
                answers: list[p.Message] = [*batch_answers(run, msg.tick), p.BatchDone(msg.tick, timings, run.refused)]
                for answer in answers:
                    if not self._try_send(session.head, answer):
                        log.info("stage %d: the head of session %s... went away", self.stage, session.id[:8])
                        session.head.close()  # its thread ends the session
                        return
                return
            self._send_downstream(session, forward_batch(run, msg, timings, self.manifest.architecture.hidden_size,
                                                         self.wire_dtype))
        finally:
            self._done(compute)

    def _send_downstream(self, session: SessionState, msg: p.Message) -> None:
        with session.lock:
            downstream, where = session.downstream, session.next_hop
        if downstream is None:
            raise RequestError("unavailable", f"no link to stage {self.stage + 1} ({where or 'not named'}); "
                                              "the head reconnects")
        if not self._try_send(downstream, msg):
            downstream.close()
            raise RequestError("unavailable", f"stage {self.stage + 1} at {where} went away")

    def _pass_on(self, session: SessionState, msg: p.Step, out: np.ndarray, timings: dict[str, float]) -> None:
        """Forward the activations to the next stage, or answer the session's head from the last."""
        if not self.backend.last:
            self._send_downstream(session, p.Step(msg.stream, msg.step, msg.position, msg.want,
                                                  p.Tensor.activations(out, self.wire_dtype), timings, msg.rewind,
                                                  msg.compact))
            return
        if not self._try_send(session.head, answer(msg, out, timings)):
            log.info("stage %d: the head of session %s... went away", self.stage, session.id[:8])
            session.head.close()  # its thread ends the session

__all__ = ["Limits", "RequestError", "StageUnreachable", "StageWorker"]
