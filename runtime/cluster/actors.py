"""The Ray actors of ``ovshard up``: a probe per node, and one stage worker per placed stage.

:class:`ProbeActor` measures its node (free memory, a timed decode step of one synthetic layer of the
bundle's shape, round trips to the other nodes) before anything is placed. :class:`StageActor` runs a
:class:`StageWorker` for one placed stage: it finds the bundle's files on its node or pulls the ones its
stage needs (runtime/cluster/distribute.py), joins its run of the bundle's stages into one model when the placement
groups several (runtime/cluster/regroup.py), and serves on a fixed port, with TLS when the command handed it
credentials. Ray restarts a stage actor that dies with the arguments it was created with; the restarted
actor finds its files, its joined stage and the pipeline's manifest on its node and serves at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ovshard.bundle import names
from ovshard.bundle.manifest import Manifest, StageEntry, read_manifest
from ovshard.bundle.places import cache_root
from ovshard.bundle.staging import write_text
from ovshard.memory import read_status
from ovshard.runtime.cluster import distribute
from ovshard.runtime.wire.tls import CA_FILE, CERT_FILE, KEY_FILE

log = logging.getLogger(__name__)

THREADS_ENV = "OVSHARD_THREADS"  # a node's own cap on a stage's CPU threads (set in `ray start`'s environment)
# the port of the stage actor a new one replaces, stopped by Ray but its process not gone yet (seen under
# load): binding it is tried again this long
PORT_WAIT_S = 30.0


def node_threads(default: int | None) -> int | None:
    """The threads a stage uses on this node: $OVSHARD_THREADS there, else the command's --threads."""
    value = os.environ.get(THREADS_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else default


def _node_address(host: str, port: int) -> str:
    """``host:port`` as another node reaches it (a wildcard bind is reached at this node's IP)."""
    if host in ("0.0.0.0", "::"):
        import ray

        host = ray.util.get_node_ip_address()
    return f"{host}:{port}"


class ProbeActor:
    """One node's measurements: free memory, one layer's decode step, round trips to the other nodes."""

    def __init__(self, host: str) -> None:
        from ovshard.runtime.cluster.probe import EchoServer

        self.echo = EchoServer(host)
        self.address = _node_address(host, self.echo.port)

    def where(self) -> dict[str, Any]:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
                "echo": self.address}

    def probe(self, manifest: Manifest, threads: int | None) -> dict[str, Any]:
        """The probe's figures; free memory no more than the node's Ray ``memory`` resource (``ray start
        --memory BYTES`` caps what ovshard places there)."""
        import ray

        from ovshard.runtime.cluster.probe import probe_layer

        measured = probe_layer(manifest, node_threads(threads))
        here = ray.get_runtime_context().get_node_id()
        declared = next((n["Resources"].get("memory") for n in ray.nodes() if n["NodeID"] == here), None)
        if declared:
            measured["free_bytes"] = min(measured["free_bytes"], int(declared))
        return {**measured, **self.where()}

    def round_trips(self, addresses: list[str]) -> list[float]:
        from ovshard.runtime.cluster.probe import round_trip_s

        return [round_trip_s(a) for a in addresses]


@dataclass(frozen=True)
class StageOrder:
    """What a stage actor is asked to run; Ray keeps it and hands it back to a restarted actor."""

    bundle: str  # the bundle's folder on the node that runs `ovshard up`
    fingerprint: str  # "sha256:..." of that bundle's manifest
    groups: tuple[tuple[int, ...], ...]  # the bundle's stages each placed stage runs, in order
    index: int  # the placed stage this actor runs
    host: str
    port: int
    exact: bool
    threads: int | None
    tls: dict[str, bytes] | None  # ca.pem, cert.pem, key.pem of this stage's certificate; None: plain TCP
    source: Any  # a BundleSource actor handle, for files this node lacks
    pull: bool  # pull into the node's cache even where the bundle's folder is there

    @property
    def digest(self) -> str:
        """The manifest's sha256, hex."""
        return self.fingerprint.removeprefix("sha256:")

    @property
    def regrouped(self) -> bool:
        return any(len(g) != 1 for g in self.groups)

    @property
    def tag(self) -> str:
        """The folder name of this placement's joined stages in a node's cache."""
        import hashlib

        layout = ";".join(",".join(map(str, g)) for g in self.groups)
        return f"{self.digest[:16]}-{hashlib.sha256(layout.encode()).hexdigest()[:8]}"


class StageActor:
    """A placed stage on its node: files found or pulled, stages joined, then a worker serving its port."""

    def __init__(self, order: StageOrder) -> None:
        from ovshard.runtime.node.config import limit_malloc_arenas

        limit_malloc_arenas()
        self.order, self.started = order, time.time()
        self.pulled = 0
        self.fine = self._fine_bundle()
        self.worker: Any = None
        if not order.regrouped:
            self._serve(self.fine, order.groups[order.index][0])
            return
        from ovshard.runtime.cluster.regroup import write_group

        self.out = cache_root() / "stages" / order.tag
        self.entry = write_group(self.fine, read_manifest(self.fine), order.groups, order.index, self.out)
        if (self.out / names.MANIFEST_FILE).is_file():  # restarted: the pipeline's manifest is here already
            self._serve(self.out, order.index)

    def _fine_bundle(self) -> Path:
        """The bundle's folder on this node, or this node's cache after pulling this stage's files into it."""
        order = self.order
        here = distribute.local_copy(Path(order.bundle), order.fingerprint, order.pull)
        if here is not None:
            return here
        import ray

        def read(name: str, offset: int, size: int) -> bytes:
            return bytes(ray.get(order.source.read.remote(name, offset, size)))

        dest = cache_root() / "bundles" / order.digest[:16]
        self.pulled += distribute.pull(read, {names.MANIFEST_FILE: order.digest}, dest)
        files = distribute.files_of(read_manifest(dest), order.groups[order.index], shared=False)
        self.pulled += distribute.pull(read, files, dest)
        return dest

    def entry_of(self) -> StageEntry:
        """The joined stage's manifest entry (files and their sha256), for the pipeline's manifest."""
        return self.entry

    def serve(self, manifest_json: str) -> None:
        """Keep the pipeline's manifest beside the joined stage, then serve it (once; later calls: no-op)."""
        if self.worker is not None:
            return
        write_text(self.out / names.MANIFEST_FILE, manifest_json)
        self._serve(self.out, self.order.index)

    def _serve(self, bundle: Path, stage: int) -> None:
        from ovshard.runtime.node.config import stage_config
        from ovshard.runtime.node.worker import StageWorker

        server_tls, client_tls = self._tls()
        order = self.order
        self.worker = StageWorker(bundle, stage, "CPU", stage_config(order.exact, node_threads(order.threads)),
                                  cache_dir=cache_root() / "ov_cache", server_tls=server_tls,
                                  client_tls=client_tls)
        self.address = self.worker.listen(order.host, order.port, wait_s=PORT_WAIT_S)
        threading.Thread(target=self.worker.serve_forever, name=f"stage-{order.index}", daemon=True).start()

    def _tls(self) -> tuple[Any, Any]:
        """TLS contexts from the certificate the command handed over, written to a private folder here."""
        if self.order.tls is None:
            return None, None
        from ovshard.runtime.wire.tls import client_context, load_credentials, server_context

        folder = Path(tempfile.mkdtemp(prefix="ovshard-tls-"))  # 0700; gone once the contexts hold the key
        try:
            for name in (CA_FILE, CERT_FILE, KEY_FILE):
                fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(self.order.tls[name])
            creds = load_credentials(folder)
            return server_context(creds), client_context(creds)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def info(self) -> dict[str, Any]:
        """Where this stage runs and what it holds."""
        import ray

        if self.worker is None:
            return {"stage": self.order.index, "state": "waiting for the pipeline's manifest"}
        entry, worker = self.worker.backend.entry.stage, self.worker
        with worker.lock:
            steps, compute_s = worker.steps, worker.compute_s
        sessions, streams = worker.heads.counts()
        _, port = self.address.rsplit(":", 1)
        return {"stage": self.order.index, "address": _node_address(self.order.host, int(port)),
                "node": ray.get_runtime_context().get_node_id()[:12], "host": socket.gethostname(),
                "layers": [entry.start, entry.end], "bundle_stages": list(self.order.groups[self.order.index]),
                "device": "CPU", "threads": node_threads(self.order.threads) or 0, "pid": os.getpid(),
                "rss_mb": round(read_status().get("rss", 0) / 2**20, 1), "files": "pulled" if self.fine != Path(self.order.bundle) else "local",
                "pulled_mb": round(self.pulled / 1e6, 1), "up_s": round(time.time() - self.started, 1),
                "steps": steps, "step_ms": round(1e3 * compute_s / steps, 3) if steps else None,
                "sessions": sessions, "streams": streams}


__all__ = ["THREADS_ENV", "ProbeActor", "StageActor", "StageOrder", "node_threads"]
