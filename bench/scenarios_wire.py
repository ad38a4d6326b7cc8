"""Wire scenarios: f (bytes each hop carries per decode step), and the relay they measure through.

``FrameRelay`` sits in front of one stage worker, passes every frame on unchanged and records it
(connection role, direction, message kind, prefix/header/body bytes, tokens of a Step). A WAN scenario
can chain it with ``ovshard.runtime.tools.wanproxy.DelayProxy`` (relay -> delaying proxy -> worker).
"""

from __future__ import annotations

import itertools
import socket
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from scenarios_base import Bench, ModelSpec, TcpDecoder, median, progress, scenario

from ovshard.runtime.client.launch import local_workers
from ovshard.runtime.wire import framing
from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.address import parse_address

HOP_STAGE_COUNTS = (2, 4)


@dataclass(frozen=True)
class Frame:
    connection: int
    role: str  # "head" or "upstream": who opened the connection (from its Hello)
    direction: str  # "in" toward the stage, "out" from it
    kind: str  # message class name
    header_bytes: int
    body_bytes: int
    tokens: int | None  # the T of a Step's tensor [B, T(, H)], else None

    @property
    def size(self) -> int:
        return framing.PREFIX_SIZE + self.header_bytes + self.body_bytes


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class FrameRelay:
    """A loopback TCP relay in front of one stage that records every protocol frame it passes on."""

    def __init__(self, target: str) -> None:
        self.target = parse_address(target)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.frames: list[Frame] = []
        self.lock = threading.Lock()
        self.ids = itertools.count()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = {"id": next(self.ids), "role": "?"}
            threading.Thread(target=self._pump, args=(client, upstream, conn, "in"), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, conn, "out"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, conn: dict[str, Any], direction: str) -> None:
        try:
            while (prefix := _recv_exactly(src, framing.PREFIX_SIZE)) is not None:
                _, header_len, body_len = framing.parse_prefix(prefix)
                rest = _recv_exactly(src, header_len + body_len)
                if rest is None:
                    break
                self._pass(prefix, rest, header_len, conn, direction)
                dst.sendall(prefix + rest)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _pass(self, prefix: bytes, rest: bytes, header_len: int, conn: dict[str, Any], direction: str) -> None:
        msg = framing.decode(prefix, rest[:header_len], rest[header_len:])
        if isinstance(msg, p.Hello):
            conn["role"] = msg.role  # recorded before the frame goes on, so the answer sees it
        tokens = msg.tensor.shape[1] if isinstance(msg, p.Step) else None
        with self.lock:
            self.frames.append(Frame(conn["id"], conn["role"], direction, type(msg).__name__, header_len,
                                     len(rest) - header_len, tokens))


def _hop_frames(relays: list[FrameRelay]) -> dict[str, list[Frame]]:
    """Decode-step frames per hop: head -> s0, s(i-1) -> s(i), s(N-1) -> head."""
    n = len(relays)
    hops: dict[str, list[Frame]] = {}
    for i, relay in enumerate(relays):
        steps = [f for f in relay.frames if f.kind == "Step" and f.direction == "in" and f.tokens == 1]
        hops[f"s{i - 1} -> s{i}" if i else "head -> s0"] = steps
    results = [f for f in relays[-1].frames if f.kind == "Result" and f.direction == "out"]
    hops[f"s{n - 1} -> head"] = results[1:]  # the first Result answers the prefill
    return hops


def _measure_hops(bench: Bench, model: ModelSpec, stages: int) -> list[dict[str, Any]]:
    bundle = bench.bundle(model, stages)
    with local_workers(bundle) as addresses:
        relays = [FrameRelay(a) for a in addresses]
        decoder = TcpDecoder(bundle, [r.address for r in relays])
        try:
            sample = decoder.greedy(list(model.prompt), bench.settings.tokens(model))
        finally:
            decoder.close()
            for r in relays:
                r.close()
    progress(f"f {model.name} {stages} stages: {sample.decode_steps} decode steps over TCP")
    rows = []
    for hop, frames in _hop_frames(relays).items():
        sizes = [f.size for f in frames]
        kinds = Counter(f.kind for f in frames)
        rows.append({"model": model.name, "hidden": model.hidden_size, "stages": stages, "hop": hop,
                     "frames": f"{len(frames)} {'/'.join(kinds)}",
                     "bytes/step (median)": int(median(sizes)), "min": min(sizes), "max": max(sizes),
                     "prefix": framing.PREFIX_SIZE, "header (median)": int(median([f.header_bytes for f in frames])),
                     "body": int(median([f.body_bytes for f in frames]))})
    total = sum(r["bytes/step (median)"] for r in rows)
    rows.append({"model": model.name, "hidden": model.hidden_size, "stages": stages, "hop": "all hops",
                 "frames": f"{sample.decode_steps} steps", "bytes/step (median)": total, "min": "", "max": "",
                 "prefix": "", "header (median)": "", "body": ""})
    return rows


@scenario("f", "bytes on the wire per decode step, per hop (loopback TCP, frames counted by a relay)")
def wire_bytes(bench: Bench) -> dict[str, Any]:
    rows, summary = [], []
    for model in bench.models:
        for stages in HOP_STAGE_COUNTS:
            hop_rows = _measure_hops(bench, model, stages)
            rows += hop_rows
            act = next(r for r in hop_rows if r["hop"] == "s0 -> s1")
            summary.append({"measure": f"bytes per activation hop per decode step ({stages} stages)",
                            "model": model.name,
                            "value": f"{act['bytes/step (median)']} B (body {act['body']} = f16 x {model.hidden_size})",
                            "target": f"~ 2 x hidden + < 200 B header = {2 * model.hidden_size + 216} B"})
    return {
        "target": "an activation hop carries one token's f16 activations (2 x hidden bytes) + 16 B prefix + "
                  "a JSON header < 200 B; the head sends i64 ids + the 1-entry mask delta, the last stage "
                  "returns one i64 argmax id",
        "settings": {"what": "one greedy generation over loopback TCP with a FrameRelay in front of every stage "
                             "worker; each relay parses every protocol frame it forwards. Decode-step frames: "
                             "Steps with one new token; the last stage's Results after the first. Bytes are the "
                             "protocol frames (16 B prefix + header + body); TCP/IP headers are not counted "
                             "(about 52-66 B a segment on a LAN). Deterministic up to a few header digits",
                     "wire dtype": p.ACTIVATION_WIRE_DTYPE,
                     "per_model": {m.name: {"prompt_ids": list(m.prompt), "new_tokens": bench.settings.tokens(m)}
                                   for m in bench.models}},
        "rows": rows, "summary": summary,
        "notes": ["the header holds the stream, seq, position, mask delta, want, tensor spec and the timings "
                  "of the stages the step passed, so it grows by one timing entry per hop"],
        "plot": {"ylabel": "bytes per decode step", "group_by": "model", "label": "{stages} stages: {hop}",
                 "value": "bytes/step (median)", "skip": {"hop": "all hops"}},
    }

