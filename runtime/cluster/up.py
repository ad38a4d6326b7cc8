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
   where it did and the head's reconnect and replay (runtime/client/head.py) carry every stream across. A node
   that leaves for good, or joins, is runtime/cluster/supervise.py's: :meth:`Cluster.replan` places the stages
   anew and starts them as the next generation of actors.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
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


def bundle_tag(bundle: Path) -> str:
    """8 hex of the bundle's path: names its actors and its state in the GCS, the same in every process."""
    import hashlib

    return hashlib.sha256(str(bundle).encode()).hexdigest()[:8]


def _actor_name(bundle: Path, stage: int, generation: int) -> str:
    """``ovshard-stage-<k>-<bundle_tag>-<generation>`` (``status``, ``down``); a re-plan starts the next
    generation."""
    return f"{PREFIX}{stage}-{bundle_tag(bundle)}-{generation}"


def stage_of(name: str) -> int | None:
    """The stage index in an actor's name (``_actor_name``), None for a name of another form."""
    index = name[len(PREFIX):].split("-", 1)[0] if name.startswith(PREFIX) else ""
    return int(index) if index.isdigit() else None


def place(stages: int, alive: list[str]) -> list[str]:
    """The node id of each stage for ``--placement bundle``: the alive nodes in turn (this command's first),
    so consecutive stages sit on different nodes while there are nodes."""
    return [alive[i % len(alive)] for i in range(stages)]


def alive_nodes() -> list[str]:
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


@dataclass(frozen=True)
class PlanChoice:
    """The planner's answer: placed stage i runs the bundle's stages ``groups[i]`` on node ``nodes[i]``."""

    nodes: list[str]
    groups: list[tuple[int, ...]]
    table: str  # the plan table (predicted ms and memory per stage), for stderr
    left_out: list[str]  # why each node that holds no stage holds none
    slowest_s: float  # the predicted slowest stage's step (0: not predicted, as for --placement bundle)


# (manifest, probes, head node, round trips, stages, context tokens, strategy) -> PlanChoice; raises PlanError
Planner = Callable[..., PlanChoice]


class Cluster:
    """The stage actors of one bundle on a Ray cluster (``ray`` "local": a private instance). Each placement is
    a generation of actors; :meth:`replan` places the stages anew over the nodes it is given and starts the
    next generation (the supervisor's answer to a node that left or joined)."""

    def __init__(self, config: UpConfig, planner: Planner | None = None) -> None:
        self.config, self.planner = config, planner
        self.bundle = Path(config.bundle).resolve()
        self.manifest = read_manifest(self.bundle)
        self.owned = config.ray == "local"
        self.host = "127.0.0.1" if self.owned else "0.0.0.0"  # what probes and stages bind
        join_ray(config.ray)
        self.alive = alive_nodes()  # this command's node first
        self.actors: list[Any] = []
        self.generation = 0
        self.moving = False  # a re-plan is replacing the actors
        self.tmp = Path(tempfile.mkdtemp(prefix="ovshard-up-"))
        self.head_credentials: Path | None = None
        self.measured: dict[str, dict[str, Any]] = {}  # node -> its probe (measured once, when first seen)
        self.rtt: dict[tuple[str, str], float] = {}
        self.probes: dict[str, Any] = {}  # what placement by measurement measured: its planner's inputs
        try:
            self.tls = None if self.owned or config.insecure else self._credentials()
            self.source: Any = None
            choice = self.plan(self.alive)
            self.plan_table, self.left_out = choice.table, choice.left_out
            self._launch(choice)
        except Exception:
            self.close()
            raise

    def plan(self, alive: list[str]) -> PlanChoice:
        """Where the stages go on ``alive`` (this command's node first): the rules ``up`` was given, over the
        nodes' probes (each node is probed when first seen). Raises PlanError when they cannot hold the model."""
        fine = self.manifest.num_stages
        if self.config.placement == "bundle":
            if self.config.stages not in (None, fine):
                raise OvshardError(f"--stages {self.config.stages} with --placement bundle: the bundle has {fine} "
                                   f"stages, one actor each; leave --stages out or use --placement measured")
            return PlanChoice(place(fine, alive), [(i,) for i in range(fine)], "", [], 0.0)
        if self.planner is None:
            raise OvshardError("placement by measurement needs the planner (ovshard.plan): run `ovshard up`")
        self.measure([n for n in alive if n not in self.measured])
        probes = [self.measured[n] for n in alive]
        self.probes = {"nodes": [{k: p[k] for k in ("node", "host", "seconds_per_byte", "free_bytes")} for p in probes],
                       "rtt_s": [[a, b, s] for (a, b), s in self.rtt.items() if a in alive and b in alive],
                       "head": alive[0]}
        stages = None if self.config.stages is None else min(self.config.stages, len(alive))
        return self.planner(self.manifest, probes, alive[0], self.rtt, stages, self.config.context_tokens,
                            self.config.placement)

    def measure(self, nodes: list[str]) -> None:
        """Probe each of ``nodes``, one at a time (nodes may share a machine), and the round trips between them."""
        import ray

        from ovshard.runtime.cluster.actors import ProbeActor

        if not nodes:
            return
        actors = [_pinned(ProbeActor, node).remote(self.host) for node in nodes]
        try:
            probes = []
            for node, actor in zip(nodes, actors, strict=True):
                probes.append(ray.get(actor.probe.remote(self.manifest, self.config.threads), timeout=START_TIMEOUT_S))
                log.info("probe of node %s (%s): %.3f ms a layer step, %.1f GB free", node[:12], probes[-1]["host"],
                         1e3 * probes[-1]["step_s"], probes[-1]["free_bytes"] / 1e9)
                self.measured[node] = probes[-1]
            echoes = [p["echo"] for p in probes]
            for node, actor in zip(nodes, actors, strict=True):
                for other, seconds in zip(nodes, ray.get(actor.round_trips.remote(echoes), timeout=60), strict=True):
                    self.rtt[(node, other)] = seconds
        finally:
            for actor in actors:
                ray.kill(actor)

    def _credentials(self) -> list[dict[str, bytes]]:
        """A CA of this command's own and a certificate per possible placed stage (at most one per bundle stage)
        and for the head (``head_credentials``): every link is mutual TLS. Returns each stage's ca.pem,
        cert.pem and key.pem."""
        from ovshard.runtime.tools.keygen import keygen

        stages = [f"stage{i}" for i in range(self.manifest.num_stages)]
        keygen(self.tmp / "tls", stages, ["head"])
        self.head_credentials = self.tmp / "tls" / "head"
        return [{n: (self.tmp / "tls" / s / n).read_bytes() for n in (CA_FILE, CERT_FILE, KEY_FILE)} for s in stages]

    def _launch(self, choice: PlanChoice) -> None:
        """Start this generation's actors for ``choice`` and wait until each serves."""
        import ray

        self.nodes, self.groups, self.slowest_s = choice.nodes, choice.groups, choice.slowest_s
        self._start(self.tls)
        self.head_bundle = self._pipeline_bundle()
        self.stages = ray.get([a.info.remote() for a in self.actors], timeout=START_TIMEOUT_S)

    def replan(self, alive: list[str]) -> PlanChoice:
        """Place the stages anew on ``alive`` and start them there as the next generation (the old one is
        stopped first: its ports are reused). Raises PlanError, with nothing stopped, when the nodes cannot
        hold the model."""
        choice = self.plan(alive)
        self.moving = True
        try:
            self.stop_actors(alive)
            self.generation += 1
            self.alive = alive
            self._launch(choice)
        finally:
            self.moving = False
        return choice

    def stop_actors(self, alive: list[str] | None = None) -> None:
        """Stop this generation's stage actors for good; with fixed ports, wait until those on ``alive`` nodes
        are gone (a lost node's ports are not this node's to reuse)."""
        import ray

        waited = {_actor_name(self.bundle, i, self.generation) for i, node in enumerate(self.nodes)
                  if alive is None or node in alive}
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []
        deadline = time.monotonic() + 30.0
        while self.config.port_base and time.monotonic() < deadline:
            if all(s["state"] == "DEAD" for s in actor_states() if s["name"] in waited):
                return
            time.sleep(0.2)

    def _start(self, tls: list[dict[str, bytes]] | None) -> None:

        from ovshard.runtime.cluster.actors import StageActor, StageOrder
        from ovshard.runtime.cluster.distribute import BundleSource

        config, count = self.config, len(self.groups)
        here = self.alive[0]
        need_source = config.pull or any(node != here for node in self.nodes)
        if need_source and self.source is None:
            self.source = _pinned(BundleSource, here, max_restarts=-1).remote(str(self.bundle))
        ports = [free_port() if self.owned and not config.port_base else config.port_base + i for i in range(count)]
        fingerprint = bundle_fingerprint(self.bundle)
        self.orders = [StageOrder(str(self.bundle), fingerprint, tuple(self.groups), i, self.host, ports[i],
                                  config.exact, config.threads, tls[i] if tls else None, self.source, config.pull)
                       for i in range(count)]
        self.actors = [_pinned(StageActor, self.nodes[i], name=_actor_name(self.bundle, i, self.generation),
                               max_restarts=config.max_restarts, max_task_retries=0).remote(order)
                       for i, order in enumerate(self.orders)]

    def _pipeline_bundle(self) -> Path:
        """The bundle the head reads: this one, or the regrouped one whose manifest every stage now serves."""
        if not self.orders[0].regrouped:
            return self.bundle
        import ray

        from ovshard.runtime.cluster.regroup import write_group_bundle

        entries = ray.get([a.entry_of.remote() for a in self.actors], timeout=START_TIMEOUT_S)  # files in place
        out = self.tmp / f"pipeline-{self.generation}"
        manifest = write_group_bundle(self.bundle, self.manifest, self.groups, entries, out)
        ray.get([a.serve.remote(manifest.to_json()) for a in self.actors], timeout=START_TIMEOUT_S)
        return out

    @property
    def ray_address(self) -> str:
        import ray

        return str(ray.get_runtime_context().gcs_address)

    def stopped(self) -> bool:
        """Whether every stage actor is gone for good (killed without restart, as `ovshard down` does); never
        while a re-plan replaces them."""
        if self.moving:
            return False
        try:
            states = {s["state"] for s in actor_states() if s["name"] in self.names}
        except Exception as e:  # a hiccup reading the actor table must not end the pipeline
            log.debug("could not read Ray's actor table: %s", e)
            return False
        return not states or states <= {"DEAD"}

    @property
    def names_tag(self) -> str:
        return bundle_tag(self.bundle)

    @property
    def names(self) -> set[str]:
        return {_actor_name(self.bundle, i, self.generation) for i in range(len(self.actors))}

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
    _raylet_messages_to_stderr()


def _raylet_messages_to_stderr() -> None:
    """Ray's driver prints the cluster's error messages ("(raylet) The node ... missed too many heartbeats") to
    stdout whatever ``log_to_driver`` says; ``up`` and ``status`` print their results there as JSON lines, so
    send those messages to stderr, with the rest of the progress."""
    from ray._private import worker

    printed = getattr(worker, "print_to_stdstream", None)
    if printed is None or getattr(printed, "ovshard", False):  # a Ray without it, or wrapped by an earlier join
        return

    def to_stderr(data: dict, ignore_prefix: bool) -> None:
        printed({**data, "is_err": True} if data.get("pid") == "raylet" else data, ignore_prefix)

    to_stderr.ovshard = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = to_stderr


