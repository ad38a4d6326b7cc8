"""``ovshard up``: a pipeline on a Ray cluster. Ray places, ships, starts and supervises; the data plane stays
the TCP chain between consecutive stages.

1. **Measure** (``--placement measured``, the default): a probe actor on each alive node reports free memory,
   a timed decode step of one synthetic layer of the bundle's shape (runtime/cluster/probe.py) and the round trips to
   the other nodes; the planner (ovshard.plan.placement, handed in by the CLI: the runtime does not import the
   compiler's layers) cuts the bundle's stages into contiguous runs, one a node, minimising the slowest
   stage's step within each node's memory. ``even`` cuts equal runs; ``bundle`` runs each bundle stage as it
   is, on the nodes in turn. A bundle compiled with many stages (``ovshard compile --stages <layers>``) gives
   the planner the most freedom.
2. **Ship**: a node that lacks the bundle's folder pulls only its stages' files from the command's node
   (runtime/cluster/distribute.py: chunked, resumable, sha256-checked) into its cache.
3. **Start**: one Ray actor per placed stage (runtime/cluster/actors.py) joins its run of stages into one model
   and serves it on a fixed port (``--port-base`` + stage, or free loopback ports for ``--ray local``), over
   mutual TLS with a certificate from a CA this command makes for the run (beyond loopback, unless
   ``--insecure``).
4. **Supervise**: Ray restarts an actor that dies (``max_restarts``) with the order it was given; it listens
   where it did and the head's reconnect and replay (runtime/client/head.py) carry every stream across.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ovshard.bundle.manifest import bundle_fingerprint, read_manifest
from ovshard.errors import OvshardError
from ovshard.runtime.wire.address import free_port
from ovshard.runtime.wire.tls import CA_FILE, CERT_FILE, KEY_FILE

log = logging.getLogger(__name__)

NAMESPACE = "ovshard"
START_TIMEOUT_S = 300.0


PREFIX = "ovshard-stage-"


def _actor_name(bundle: Path, stage: int) -> str:
    """``ovshard-stage-<k>-<8 hex of the bundle's path>``: the same in every process (``status``, ``down``)."""
    import hashlib

    return f"{PREFIX}{stage}-{hashlib.sha256(str(bundle).encode()).hexdigest()[:8]}"


def place(stages: int, alive: list[str]) -> list[str]:
    """The node id of each stage for ``--placement bundle``: the alive nodes in turn (this command's first),
    so consecutive stages sit on different nodes while there are nodes."""
    return [alive[i % len(alive)] for i in range(stages)]


def _alive_nodes() -> list[str]:
    """The cluster's alive node ids, this command's node first."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    return sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda node: node != here)


def _pinned(cls: Any, node: str, **options: Any) -> Any:
    """``cls`` as a Ray actor class bound to ``node``; it reserves no Ray CPU (threads are set per stage)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(cls).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                                   **options)


@dataclass(frozen=True)
class UpConfig:
    """What `ovshard up` was asked for."""

    bundle: Path
    ray: str  # "local" | "auto" | ADDRESS
    port_base: int = 0
    exact: bool = False
    threads: int | None = None
    insecure: bool = False
    placement: str = "measured"  # "measured" | "even" | "bundle"
    stages: int | None = None  # placed stages (None: as many nodes as help)
    context_tokens: int = 4096
    pull: bool = False  # pull stage files into every node's cache even where the bundle's folder is there
    max_restarts: int = -1


# (manifest, probes, head node, round trips, stages, context tokens, strategy) -> (nodes, groups, table, left out)
Planner = Callable[..., tuple[list[str], list[tuple[int, ...]], str, list[str]]]


class Cluster:
    """The stage actors of one bundle on a Ray cluster (``ray`` "local": a private instance)."""

    def __init__(self, config: UpConfig, planner: Planner | None = None) -> None:
        import ray

        self.config = config
        self.bundle = Path(config.bundle).resolve()
        self.manifest = read_manifest(self.bundle)
        self.owned = config.ray == "local"
        self.host = "127.0.0.1" if self.owned else "0.0.0.0"  # what probes and stages bind
        join_ray(config.ray)
        self.alive = _alive_nodes()  # this command's node first
        self.actors: list[Any] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="ovshard-up-"))
        self.head_credentials: Path | None = None
        self.probes: dict[str, Any] = {}  # what placement by measurement measured: its planner's inputs
        try:
            self.nodes, self.groups, self.plan_table, self.left_out = self._place(planner)
            tls = None if self.owned or config.insecure else self._credentials()
            self._start(tls)
            self.head_bundle = self._pipeline_bundle()
            self.stages = ray.get([a.info.remote() for a in self.actors], timeout=START_TIMEOUT_S)
        except Exception:
            self.close()
            raise

    def _place(self, planner: Planner | None) -> tuple[list[str], list[tuple[int, ...]], str, list[str]]:
        fine = self.manifest.num_stages
        if self.config.placement == "bundle":
            if self.config.stages not in (None, fine):
                raise OvshardError(f"--stages {self.config.stages} with --placement bundle: the bundle has {fine} "
                                   f"stages, one actor each; leave --stages out or use --placement measured")
            return place(fine, self.alive), [(i,) for i in range(fine)], "", []
        if planner is None:
            raise OvshardError("placement by measurement needs the planner (ovshard.plan): run `ovshard up`")
        probes, rtt = self._probe(self.alive)
        self.probes = {"nodes": [{k: p[k] for k in ("node", "host", "seconds_per_byte", "free_bytes")} for p in probes],
                       "rtt_s": [[a, b, s] for (a, b), s in rtt.items()], "head": self.alive[0]}
        return planner(self.manifest, probes, self.alive[0], rtt, self.config.stages, self.config.context_tokens,
                       self.config.placement)

    def _probe(self, nodes: list[str]) -> tuple[list[dict[str, Any]], dict[tuple[str, str], float]]:
        """Each node's probe, one node at a time (nodes may share a machine), and the round trips between them."""
        import ray

        from ovshard.runtime.cluster.actors import ProbeActor

        actors = [_pinned(ProbeActor, node).remote(self.host) for node in nodes]
        try:
            probes = []
            for node, actor in zip(nodes, actors, strict=True):
                probes.append(ray.get(actor.probe.remote(self.manifest, self.config.threads), timeout=START_TIMEOUT_S))
                log.info("probe of node %s (%s): %.3f ms a layer step, %.1f GB free", node[:12], probes[-1]["host"],
                         1e3 * probes[-1]["step_s"], probes[-1]["free_bytes"] / 1e9)
            echoes = [p["echo"] for p in probes]
            rtt = {}
            for node, actor in zip(nodes, actors, strict=True):
                for other, seconds in zip(nodes, ray.get(actor.round_trips.remote(echoes), timeout=60), strict=True):
                    rtt[(node, other)] = seconds
            return probes, rtt
        finally:
            for actor in actors:
                ray.kill(actor)

    def _credentials(self) -> list[dict[str, bytes]]:
        """A CA of this command's own and a certificate per stage and for the head (``head_credentials``):
        every link is mutual TLS. Returns each stage's ca.pem, cert.pem and key.pem."""
        from ovshard.runtime.wire.keygen import keygen

        stages = [f"stage{i}" for i in range(len(self.groups))]
        keygen(self.tmp / "tls", stages, ["head"])
        self.head_credentials = self.tmp / "tls" / "head"
        return [{n: (self.tmp / "tls" / s / n).read_bytes() for n in (CA_FILE, CERT_FILE, KEY_FILE)} for s in stages]

    def _start(self, tls: list[dict[str, bytes]] | None) -> None:

        from ovshard.runtime.cluster.actors import StageActor, StageOrder
        from ovshard.runtime.cluster.distribute import BundleSource

        config, count = self.config, len(self.groups)
        here = self.alive[0]
        need_source = config.pull or any(node != here for node in self.nodes)
        self.source = _pinned(BundleSource, here, max_restarts=-1).remote(str(self.bundle)) if need_source else None
        ports = [free_port() if self.owned and not config.port_base else config.port_base + i for i in range(count)]
        fingerprint = bundle_fingerprint(self.bundle)
        self.orders = [StageOrder(str(self.bundle), fingerprint, tuple(self.groups), i, self.host, ports[i],
                                  config.exact, config.threads, tls[i] if tls else None, self.source, config.pull)
                       for i in range(count)]
        self.actors = [_pinned(StageActor, self.nodes[i], name=_actor_name(self.bundle, i),
                               max_restarts=config.max_restarts, max_task_retries=0).remote(order)
                       for i, order in enumerate(self.orders)]

    def _pipeline_bundle(self) -> Path:
        """The bundle the head reads: this one, or the regrouped one whose manifest every stage now serves."""
        if not self.orders[0].regrouped:
            return self.bundle
        import ray

        from ovshard.runtime.cluster.regroup import write_group_bundle

        entries = ray.get([a.entry_of.remote() for a in self.actors], timeout=START_TIMEOUT_S)  # files in place
        out = self.tmp / "pipeline"
        manifest = write_group_bundle(self.bundle, self.manifest, self.groups, entries, out)
        ray.get([a.serve.remote(manifest.to_json()) for a in self.actors], timeout=START_TIMEOUT_S)
        return out

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
        """The stage table: stage, node, host, address, layers, threads, files, memory."""
        rows = [("stage", "node", "host", "address", "layers", "device", "threads", "files", "RSS MB")]
        rows += [(str(s["stage"]), str(s["node"]), str(s["host"]), str(s["address"]),
                  f"[{s['layers'][0]}, {s['layers'][1]})", str(s["device"]), str(s["threads"] or "all"),
                  s["files"] + (f" {s['pulled_mb']} MB" if s["pulled_mb"] else ""), str(s["rss_mb"]))
                 for s in self.stages]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)

    def close(self) -> None:
        import ray

        for actor in [*self.actors, *([self.source] if getattr(self, "source", None) else [])]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        ray.shutdown()
        shutil.rmtree(self.tmp, ignore_errors=True)


def actor_states() -> list[dict[str, Any]]:
    """Every ovshard stage actor in Ray's actor table: name, state (ALIVE, RESTARTING, DEAD, ...), restarts.
    Read from the GCS (``ray._private.state``, which ``ray list actors`` also reads) rather than the state API,
    which needs the dashboard and ``ray[default]``."""
    from ray._private import state

    return [{"name": a["Name"], "state": a["State"], "restarts": int(a["NumRestarts"])}
            for a in state.actors().values() if str(a.get("Name") or "").startswith(PREFIX)]


def join_ray(address: str) -> None:
    """Join the Ray cluster at ``address`` ("local": start a private instance owned by this process)."""
    import ray

    try:
        ray.init(address=None if address == "local" else address, namespace=NAMESPACE, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise OvshardError(f"--ray {address}: cannot join the Ray cluster ({e}); start one with `ray start --head`, "
                           "pass the address `ovshard up` printed (its \"ray\" field), or --ray local") from e


