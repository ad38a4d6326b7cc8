"""``ovshard up``: a pipeline on a Ray cluster. Ray places, starts and supervises; the data plane stays the TCP
chain between consecutive stages.

One Ray actor per stage (``StageActor``) runs a :class:`StageWorker` in its own process on its node and binds
a fixed port there (``--port-base`` + stage, or ports the command picks on loopback for ``--ray local``), so
an actor that Ray restarts after a crash (``max_restarts``) listens where it did and the head's reconnect and
replay (runtime/head.py) carry every stream across. The chain is wired with the address each actor reports
(its node's IP and port), which every stage reaches, since Ray nodes reach each other.

First slice of the cluster issue: stages go to the alive nodes in turn, not yet by measured speed, and
each node must hold the bundle at the same path (no distribution yet); every stage listens on loopback (a
``--ray local`` instance) or beyond it only with ``--insecure`` (credentials are not distributed yet).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ovshard.bundle.manifest import read_manifest
from ovshard.errors import OvshardError

log = logging.getLogger(__name__)

NAMESPACE = "ovshard"
START_TIMEOUT_S = 300.0


PREFIX = "ovshard-stage-"


def _actor_name(bundle: Path, stage: int) -> str:
    """``ovshard-stage-<k>-<8 hex of the bundle's path>``: the same in every process (``status``, ``down``)."""
    import hashlib

    return f"{PREFIX}{stage}-{hashlib.sha256(str(bundle).encode()).hexdigest()[:8]}"


class StageActor:
    """A stage worker in a Ray actor's process: built, bound and serving when the constructor returns."""

    def __init__(self, bundle: str, stage: int, host: str, port: int, exact: bool, threads: int | None) -> None:
        from ovshard.runtime.cli import limit_malloc_arenas, stage_config
        from ovshard.runtime.worker import StageWorker

        limit_malloc_arenas()
        self.stage, self.bundle = stage, Path(bundle)
        self.worker = StageWorker(self.bundle, stage, "CPU", stage_config(exact, threads))
        self.address = self.worker.listen(host, port)
        self.thread = threading.Thread(target=self.worker.serve_forever, name=f"stage-{stage}", daemon=True)
        self.thread.start()
        self.started = time.time()

    def info(self) -> dict[str, Any]:
        """Where this stage runs and what it holds."""
        import ray

        entry = self.worker.entry.stage
        host, port = self.address.rsplit(":", 1)
        if host in ("0.0.0.0", "::"):  # bound to every interface: reach it at this node's IP
            host = ray.util.get_node_ip_address()
        return {"stage": self.stage, "address": f"{host}:{port}", "node": ray.get_runtime_context().get_node_id()[:12],
                "host": socket.gethostname(), "layers": [entry.start, entry.end], "device": "CPU",
                "pid": os.getpid(), "rss_mb": _rss_mb(), "up_s": round(time.time() - self.started, 1)}


def _rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


def place(stages: int) -> list[str]:
    """The node id of each stage: the cluster's alive nodes in turn, this command's node first, so consecutive
    stages sit on different nodes while there are nodes (placement by measured speed is still to come)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    alive = sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda node: node != here)
    return [alive[i % len(alive)] for i in range(stages)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """The stage actors of one bundle on a Ray cluster (``ray_address`` "local": a private instance)."""

    def __init__(self, bundle: Path, ray_address: str, port_base: int = 0, exact: bool = False,
                 threads: int | None = None, max_restarts: int = -1, insecure: bool = False) -> None:
        import ray

        self.bundle, self.manifest = Path(bundle).resolve(), read_manifest(bundle)
        self.owned = ray_address == "local"
        if not self.owned and not insecure:
            raise OvshardError(f"--ray {ray_address}: stages on other machines listen beyond loopback, and this "
                               "version does not distribute credentials to them yet; pass --insecure on a trusted "
                               "network, or use --ray local")
        _join(ray_address)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        remote: Any = ray.remote(max_restarts=max_restarts, max_task_retries=0)(StageActor)
        host = "127.0.0.1" if self.owned else "0.0.0.0"
        stages = range(self.manifest.num_stages)
        ports = [_free_port() if self.owned and not port_base else port_base + i for i in stages]
        nodes = place(len(stages))
        # an actor reserves no Ray CPU (the stage's threads are set by --threads): more stages than nodes still start
        self.actors: list[Any] = [
            remote.options(name=_actor_name(self.bundle, i), num_cpus=0,
                           scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i], soft=False))
            .remote(str(self.bundle), i, host, ports[i], exact, threads) for i in stages]
        try:
            self.stages = ray.get([a.info.remote() for a in self.actors], timeout=START_TIMEOUT_S)
        except Exception as e:
            self.close()
            raise OvshardError(f"the stage actors did not start within {START_TIMEOUT_S:.0f} s: {e}") from e

    @property
    def ray_address(self) -> str:
        import ray

        return str(ray.get_runtime_context().gcs_address)

    def stopped(self) -> bool:
        """Whether every stage actor is gone for good (killed without restart, as `ovshard down` does)."""
        try:
            states = {s["state"] for s in actor_states() if s["name"] in self.names}
        except Exception as e:  # a hiccup reading the actor table must not end the pipeline
            log.debug("could not read Ray's actor table: %s", e)
            return False
        return not states or states <= {"DEAD"}

    @property
    def names(self) -> set[str]:
        return {_actor_name(self.bundle, i) for i in range(len(self.actors))}

    @property
    def addresses(self) -> list[str]:
        return [str(s["address"]) for s in self.stages]

    def table(self) -> str:
        """The stage table: stage, node, host, address, layers, device, memory."""
        rows = [("stage", "node", "host", "address", "layers", "device", "RSS MB")]
        rows += [(str(s["stage"]), str(s["node"]), str(s["host"]), str(s["address"]),
                  f"[{s['layers'][0]}, {s['layers'][1]})", str(s["device"]), str(s["rss_mb"])) for s in self.stages]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)

    def close(self) -> None:
        import ray

        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        ray.shutdown()


def main_up(args: Any) -> int:
    """``ovshard up``: the stage actors, their table on stdout, then the API (``--api``) or a wait for a signal."""
    import json
    import signal

    if args.credentials is not None:
        raise OvshardError("ovshard up: --credentials are not distributed to the stage actors yet; leave it out "
                           "(--ray local needs none) or pass --insecure on a trusted network")
    started = time.perf_counter()
    cluster = Cluster(args.bundle, args.ray, 0 if args.ray == "local" else args.port_base, args.exact, args.threads,
                      insecure=args.insecure)
    try:
        print(cluster.table(), flush=True)
        print(json.dumps({"event": "up", "stages": ",".join(cluster.addresses), "pids": [s["pid"] for s in cluster.stages],
                          "ray": cluster.ray_address,
                          "up_s": round(time.perf_counter() - started, 2)}), flush=True)
        if args.api:
            from ovshard.runtime.api import main_api

            args.listen, args.local, args.stages = args.api, False, ",".join(cluster.addresses)
            return main_api(args)
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        log.info("pipeline up: `ovshard generate %s --stages %s`; Ctrl-C (or `ovshard down --ray %s`) stops it",
                 args.bundle, ",".join(cluster.addresses), cluster.ray_address)
        while not stop.wait(2.0):
            if cluster.stopped():
                log.info("the stage actors were stopped (`ovshard down`); leaving")
                break
        return 0
    finally:
        cluster.close()


def actor_states() -> list[dict[str, Any]]:
    """Every ovshard stage actor in Ray's actor table: name, state (ALIVE, RESTARTING, DEAD, ...), restarts.
    Read from the GCS (``ray._private.state``, which ``ray list actors`` also reads) rather than the state API,
    which needs the dashboard and ``ray[default]``."""
    from ray._private import state

    return [{"name": a["Name"], "state": a["State"], "restarts": int(a["NumRestarts"])}
            for a in state.actors().values() if str(a.get("Name") or "").startswith(PREFIX)]


def _join(address: str) -> None:
    """Join the Ray cluster at ``address`` ("local": start a private instance owned by this process)."""
    import ray

    try:
        ray.init(address=None if address == "local" else address, namespace=NAMESPACE, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise OvshardError(f"--ray {address}: cannot join the Ray cluster ({e}); start one with `ray start --head`, "
                           "pass the address `ovshard up` printed (its \"ray\" field), or --ray local") from e


def main_status(args: Any) -> int:
    """``ovshard status --ray ADDRESS``: each stage actor's state, restarts, node, address, layers and memory."""
    import json

    import ray

    _join(args.ray)
    try:
        rows = []
        for state in sorted(actor_states(), key=lambda s: s["name"]):
            if state["state"] == "DEAD":
                continue
            row = dict(state)
            try:
                row.update(ray.get(ray.get_actor(state["name"]).info.remote(), timeout=10))
            except Exception as e:  # restarting, or gone: the state says which
                row["error"] = f"{type(e).__name__}"
            rows.append(row)
        for row in rows:
            print(json.dumps(row))
        if not rows:
            print(f"no ovshard stage is running on the Ray cluster at {args.ray}", file=sys.stderr)
        return 0 if rows else 1
    finally:
        ray.shutdown()


def main_down(args: Any) -> int:
    """``ovshard down --ray ADDRESS``: stop every ovshard stage actor (no restart); a waiting `up` then leaves."""
    import ray

    _join(args.ray)
    try:
        stopped = 0
        for state in actor_states():
            if state["state"] != "DEAD":
                try:
                    ray.kill(ray.get_actor(state["name"]), no_restart=True)
                    stopped += 1
                except ValueError:  # gone meanwhile
                    pass
        log.info("stopped %d stage actors", stopped)
        return 0
    finally:
        ray.shutdown()
