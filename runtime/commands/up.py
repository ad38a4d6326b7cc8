"""``ovshard up | status | rebalance | down``: a pipeline on a Ray cluster."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ovshard.errors import OvshardError
from ovshard.runtime.cluster.supervise import Replan, Supervisor, Timeouts, ask_rebalance, published_states
from ovshard.runtime.cluster.up import Cluster, Planner, UpConfig, actor_states, join_ray, stage_of
from ovshard.runtime.commands.options import add_http, add_security

log = logging.getLogger(__name__)


def add_up_parser(sub: argparse._SubParsersAction, planner: Planner | None = None) -> None:
    """`up`; ``planner`` places by measurement (the compiler's ovshard.plan, handed in by the CLI)."""
    p = sub.add_parser("up", help="bring a pipeline up on a Ray cluster: placed by measurement, supervised",
                       description="Probe each node (speed, free memory, round trips), place runs of the bundle's "
                       "stages on them, pull stage files to nodes that lack them, and run one Ray actor per placed "
                       "stage, binding a port on its node, mutual TLS off --ray local; Ray restarts an actor that "
                       "dies and the head replays its streams. Prints the stage table and a JSON line with the "
                       "--stages list, then serves the API (--api) or waits until Ctrl-C / SIGTERM, which stops "
                       "every stage. Needs the cluster extra: pip install 'ovshard[cluster]'.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--ray", required=True, metavar="local|auto|ADDRESS",
                   help="local: a private Ray instance on this machine, owned by this command; auto or host:port: "
                   "a cluster started with `ray start --head` (and `ray start --address=...` on the others)")
    p.add_argument("--api", metavar="HOST:PORT", help="serve the OpenAI-compatible API there (default: print the "
                   "--stages list for `ovshard generate` and wait)")
    p.add_argument("--port-base", type=int, default=7000,
                   help="stage k listens on this port + k on its node (default 7000; --ray local picks free "
                   "loopback ports)")
    p.add_argument("--placement", choices=("measured", "even", "bundle"), default="measured",
                   help="measured (default): probe each node's speed and memory and give faster nodes more layers; "
                   "even: equal runs of the bundle's stages; bundle: one actor per bundle stage, nodes in turn")
    p.add_argument("--stages", type=int, metavar="N", help="placed stages (default: as many nodes as help); the "
                   "bundle's stages are the units, so compile with more stages than nodes (e.g. one per layer)")
    p.add_argument("--context-tokens", type=int, default=4096,
                   help="the context each stage's KV cache must fit in its node's memory (default 4096)")
    p.add_argument("--pull", choices=("missing", "always"), default="missing",
                   help="missing (default): a node without the bundle's folder pulls its stages' files; always: "
                   "every node pulls into its cache ($OVSHARD_CACHE_DIR or ~/.cache/ovshard)")
    p.add_argument("--exact", action="store_true", help="f32 inference and KV cache")
    p.add_argument("--threads", type=int, help="CPU threads per stage worker ($OVSHARD_THREADS on a node wins)")
    p.add_argument("--grace-s", type=float, default=Timeouts.grace_s,
                   help="a node whose stage has not answered for this long is lost and its stages move to the "
                   f"others (default {Timeouts.grace_s:.0f}; a node Ray reports dead is lost at once); keep it below "
                   "--retry-s")
    p.add_argument("--rebalance-at", type=float, default=Timeouts.rebalance_at, metavar="X",
                   help="move the stages onto a node that joins by itself when the plan with it predicts a step "
                   f"X times faster (default {Timeouts.rebalance_at}; 0: only on `ovshard rebalance`)")
    add_http(p)
    add_security(p)
    p.set_defaults(func=functools.partial(main_up, planner=planner))


def add_status_down_parsers(sub: argparse._SubParsersAction) -> None:
    commands = {"status": ("each stage actor's state, restarts, node, address, layers and memory; each node's state "
                           "(serving, lost, joined, unused) and the last re-plan", main_status),
                "rebalance": ("place the stages of a running `ovshard up` anew over every node alive now (nodes "
                              "that joined included) and wait for it", main_rebalance),
                "down": ("stop every ovshard stage actor on the cluster (a waiting `ovshard up` then leaves)",
                         main_down)}
    for name, (what, func) in commands.items():
        p = sub.add_parser(name, help=what, description=f"On a Ray cluster: {what}.")
        p.add_argument("--ray", default="auto", metavar="auto|ADDRESS",
                       help="the cluster (default auto); for `up --ray local`, the \"ray\" address it printed")
        p.set_defaults(func=func)


def up_config(args: Any) -> UpConfig:
    """The command line of `ovshard up` as an :class:`UpConfig`, its values checked."""
    if args.credentials is not None:
        raise OvshardError("ovshard up: leave --credentials out: up makes a CA of its own for each run and hands "
                           "every stage its certificate (pass --insecure for plain TCP on a trusted network)")
    if args.stages is not None and args.stages < 1:
        raise OvshardError(f"--stages {args.stages}: expected at least 1 placed stage, or leave it out")
    if args.context_tokens < 1:
        raise OvshardError(f"--context-tokens {args.context_tokens}: expected a positive number of tokens")
    if args.grace_s <= 0 or (args.api and args.grace_s >= args.retry_s):
        raise OvshardError(f"--grace-s {args.grace_s}: expected seconds > 0 and below --retry-s {args.retry_s} (the "
                           "streams wait --retry-s for a lost stage; past --grace-s its stages move): lower "
                           "--grace-s or raise --retry-s")
    if args.rebalance_at < 0:
        raise OvshardError(f"--rebalance-at {args.rebalance_at}: expected a speed-up >= 1, or 0 for never by itself")
    return UpConfig(Path(args.bundle), args.ray, 0 if args.ray == "local" else args.port_base, args.exact,
                    args.threads, args.insecure, args.placement, args.stages, args.context_tokens,
                    args.pull == "always")


def _announce(cluster: Cluster, replan: Replan) -> None:
    """A JSON line for each move of the stages (``up`` without ``--api``: heads started by hand follow it)."""
    print(json.dumps({"event": "replan", "stages": ",".join(cluster.addresses), "bundle": str(cluster.head_bundle),
                      "nodes": [s["node"] for s in cluster.stages], "layers": [s["layers"] for s in cluster.stages],
                      "cause": replan.cause, "seconds": replan.seconds}), flush=True)


def main_up(args: Any, planner: Planner | None = None) -> int:
    """``ovshard up``: measure, place, ship, start; the stage table on stdout, then the API or a wait; the
    supervisor moves the stages when a node leaves or joins."""

    started = time.perf_counter()
    config = up_config(args)
    timeouts = Timeouts(grace_s=args.grace_s, rebalance_at=args.rebalance_at)
    cluster = Cluster(config, planner)
    try:
        if cluster.plan_table:
            print(cluster.plan_table, file=sys.stderr, flush=True)
        for message in cluster.left_out:
            log.warning("%s", message)
        print(cluster.table(), flush=True)
        creds = str(cluster.head_credentials) if cluster.head_credentials else None
        print(json.dumps({"event": "up", "stages": ",".join(cluster.addresses), "bundle": str(cluster.head_bundle),
                          "credentials": creds, "pids": [s["pid"] for s in cluster.stages],
                          "layers": [s["layers"] for s in cluster.stages],
                          "threads": [s["threads"] for s in cluster.stages],
                          "nodes": [s["node"] for s in cluster.stages], "probes": cluster.probes,
                          "ray": cluster.ray_address,
                          "up_s": round(time.perf_counter() - started, 2)}), flush=True)
        if args.api:
            from ovshard.runtime.commands import api

            args.listen, args.local, args.stages = args.api, False, ",".join(cluster.addresses)
            args.model = args.model or Path(args.bundle).name
            args.bundle, args.credentials = cluster.head_bundle, cluster.head_credentials
            return api.run(args, lambda head: Supervisor(cluster, timeouts, head).start().close)
        supervisor = Supervisor(cluster, timeouts, announce=_announce).start()
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        log.info("pipeline up: `ovshard generate %s --stages %s%s`; Ctrl-C (or `ovshard down --ray %s`) stops it",
                 cluster.head_bundle, ",".join(cluster.addresses), f" --credentials {creds}" if creds else "",
                 cluster.ray_address)
        while not stop.wait(2.0):
            if cluster.stopped():
                log.info("the stage actors were stopped (`ovshard down`); leaving")
                break
        supervisor.close()
        return 0
    finally:
        cluster.close()


def main_status(args: Any) -> int:
    """``ovshard status --ray ADDRESS``: each stage actor's state, restarts, node, address, layers and memory."""

    import ray

    join_ray(args.ray)
    try:
        rows = []
        for state in sorted(actor_states(), key=lambda s: s["name"]):
            if state["state"] == "DEAD":
                continue
            row = dict(state)
            if (stage := stage_of(state["name"])) is not None:  # named even while its node is gone
                row["stage"] = stage
            try:
                row.update(ray.get(ray.get_actor(state["name"]).info.remote(), timeout=10))
            except Exception as e:  # restarting, or gone: the state says which
                row["error"] = f"{type(e).__name__}"
            rows.append(row)
        for row in rows:
            print(json.dumps(row))
        states = published_states()
        for state in states:
            for node in state["nodes"]:
                print(json.dumps(node))
            print(json.dumps({"bundle": state["bundle"], "serving": state["serving"], "refused": state["refused"],
                              "last_replan": state["last_replan"]}))
        if not rows and not states:
            print(f"no ovshard stage is running on the Ray cluster at {args.ray}", file=sys.stderr)
        return 0 if rows or states else 1
    finally:
        ray.shutdown()


def main_rebalance(args: Any, timeout_s: float = 600.0) -> int:
    """``ovshard rebalance --ray ADDRESS``: ask each running ``up`` to re-plan over the nodes alive now, wait for
    its answer and print its re-plan (exit 1 when one was refused: the nodes cannot hold the model)."""
    import secrets

    import ray

    join_ray(args.ray)
    try:
        asked = {state["key"]: secrets.token_hex(8) for state in published_states()}
        if not asked:
            print(f"no `ovshard up` is running on the Ray cluster at {args.ray}", file=sys.stderr)
            return 1
        for tag, request in asked.items():
            ask_rebalance(tag, request)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = [s for s in published_states() if asked.get(s["key"]) == s["answered"]]
            if len(done) == len(asked):
                for state in done:
                    print(json.dumps({"bundle": state["bundle"], "nodes": state["nodes"],
                                      "last_replan": state["last_replan"]}))
                return 0 if all(s["serving"] for s in done) else 1
            time.sleep(0.5)
        raise OvshardError(f"no answer to the rebalance within {timeout_s:.0f} s: is `ovshard up` still running?")
    finally:
        ray.shutdown()


def main_down(args: Any) -> int:
    """``ovshard down --ray ADDRESS``: stop every ovshard stage actor (no restart); a waiting `up` then leaves."""
    import ray

    join_ray(args.ray)
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
