"""Keep ``ovshard up`` serving while nodes leave and join: a thread in the ``up`` process that watches the
Ray nodes and the stage actors, and places the stages anew when the cluster changes.

Every ``poll_s`` it looks at each node that runs a stage:

- **lost**: Ray reports the node dead, or its stage actor has not answered for ``grace_s`` (a restart by Ray
  on the same node takes far less). The head is held (its streams' retry windows stop), the stages are
  placed anew over the nodes left with ``up``'s own rules (:meth:`Cluster.replan`: probes, memory, pulled
  or regrouped files), the head is moved onto the new chain and every stream replays its tokens there. When
  the nodes left cannot hold the model, the head is refused with the planner's reason (the lost node, the
  memory missing): the API answers 503 with it until a node joins.
- **joined**: a node Ray reports alive that runs no stage is probed once and shown as "joined, unused". The
  stages move onto it when the pipeline is refused (recovery), on ``ovshard rebalance``, or by themselves
  when the plan with it predicts a step at least ``rebalance_at`` times faster (streams are replayed, none is
  lost).

What ``ovshard status`` shows (each node's state, the last re-plan) and the requests of ``ovshard
rebalance`` pass through Ray's internal key-value store in the GCS, never the head's disk: a restarted
``up`` needs none of it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ovshard.errors import OvshardError
from ovshard.runtime.client.head import Head
from ovshard.runtime.cluster.up import Cluster, alive_nodes

log = logging.getLogger(__name__)

STATE_KEY = "ovshard:state:"  # + the bundle's actor-name hash: what `status` prints
REBALANCE_KEY = "ovshard:rebalance:"  # + the same: a request id `rebalance` waits for


@dataclass(frozen=True)
class Timeouts:
    """How ``up`` reacts to nodes leaving and joining (``--grace-s``, ``--rebalance-at``)."""

    grace_s: float = 20.0  # a stage silent this long has lost its node
    poll_s: float = 1.0  # how often the nodes and stages are looked at
    rebalance_at: float = 1.2  # move onto joined nodes by itself from this predicted speed-up (0: only asked)


@dataclass(frozen=True)
class Replan:
    """One re-plan: why, when (Unix time), how long it took, and what came of it."""

    cause: str
    at: float
    seconds: float
    outcome: str  # "moved" | "refused"
    stages: int  # placed stages after it (0: refused)
    detail: str  # the plan's nodes, or why it was refused


def worth_moving(current_s: float, planned_s: float, threshold: float) -> bool:
    """Whether a plan whose slowest stage takes ``planned_s`` beats the current ``current_s`` by ``threshold``x
    (``threshold`` 0: never by itself)."""
    return threshold > 0 and planned_s > 0 and current_s / planned_s >= threshold


def kv_key(prefix: str, cluster: Cluster) -> bytes:
    return f"{prefix}{cluster.names_tag}".encode()


class Supervisor:
    """The watch over one :class:`Cluster`; ``head`` (``up --api``) is moved with the stages, ``announce``
    gets each new chain's addresses (``up`` without ``--api`` prints them)."""

    def __init__(self, cluster: Cluster, timeouts: Timeouts, head: Head | None = None,
                 announce: Callable[[Cluster, Replan], None] | None = None) -> None:
        self.cluster, self.timeouts, self.head, self.announce = cluster, timeouts, head, announce
        self.lost: dict[str, str] = {}  # node -> why it was given up
        self.joined: set[str] = set()  # probed, holding no stage
        self.silent_since: dict[str, float] = {}  # node -> when its stage first failed to answer
        self.hosts: dict[str, str] = {}
        self.refused: str | None = None
        self.last: Replan | None = None
        self.answered = ""  # the last rebalance request served
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._publish()
        self.thread.start()
        return self

    def close(self) -> None:
        """Stop watching, and take this ``up``'s state out of the GCS (`status` then no longer shows it)."""
        from ray.experimental import internal_kv

        self.stop.set()
        self.thread.join(10)
        try:
            internal_kv._internal_kv_del(kv_key(STATE_KEY, self.cluster))
        except Exception as e:  # Ray already gone: so is the state
            log.debug("could not remove the published state: %s", e)

    def _run(self) -> None:
        while not self.stop.wait(self.timeouts.poll_s):
            try:
                if not self.cluster.stopped():
                    self.tick()
            except Exception as e:  # a hiccup talking to Ray must not end the watch
                log.warning("supervisor: %s: %s", type(e).__name__, e)

    def tick(self) -> None:
        """One look at the cluster: losses first, then joins, then a rebalance asked for."""
        import ray

        self.hosts.update({n["NodeID"]: n["NodeManagerHostname"] for n in ray.nodes()})
        alive = alive_nodes()
        gone = self._gone(alive)
        usable = [n for n in alive if n not in self.lost]
        if gone:
            self._move(usable, "node " + ", ".join(f"{n[:12]} ({self.hosts.get(n, '?')}) lost: {self.lost[n]}"
                                                   for n in gone))
        elif self._joins(usable):
            pass  # _joins moved the stages, or recorded the nodes as joined
        elif (asked := self._asked()) is not None:
            self._move(usable, "ovshard rebalance")
            self.answered = asked
            from ray.experimental import internal_kv

            internal_kv._internal_kv_del(kv_key(REBALANCE_KEY, self.cluster))
        self._publish()

    def _gone(self, alive: list[str]) -> list[str]:
        """Nodes of the current plan that are lost now: dead to Ray, or their stage silent past the grace."""
        now, gone = time.monotonic(), []
        answers = self._answers()
        for node in dict.fromkeys(self.cluster.nodes):
            if node in self.lost:
                continue
            if node not in alive:
                self.lost[node] = "Ray reports the node dead"
            elif answers.get(node, True):
                self.silent_since.pop(node, None)
                continue
            elif now - self.silent_since.setdefault(node, now) >= self.timeouts.grace_s:
                self.lost[node] = f"its stage has not answered for {self.timeouts.grace_s:.0f} s (--grace-s)"
            else:
                continue
            gone.append(node)
        return gone

    def _answers(self) -> dict[str, bool]:
        """Whether each stage's node answered a call to its actor within 2 s (False for a node any of whose
        stages did not)."""
        import ray

        if self.refused is not None:
            return {}  # nothing serves; the nodes left are watched by Ray alone
        calls = [(node, actor.info.remote()) for node, actor in zip(self.cluster.nodes, self.cluster.actors,
                                                                   strict=False)]
        ready, _ = ray.wait([ref for _, ref in calls], num_returns=len(calls), timeout=2.0)
        done = set(ready)
        answers: dict[str, bool] = {}
        for node, ref in calls:
            ok = ref in done
            if ok:
                try:
                    ray.get(ref, timeout=0)
                except Exception:
                    ok = False
            answers[node] = answers.get(node, True) and ok
        return answers

    def _joins(self, usable: list[str]) -> bool:
        """Probe nodes seen for the first time; move onto them when refused or when it pays. Whether it moved."""
        serving = set(self.cluster.nodes)  # while refused: the nodes of the last plan that ran
        new = [n for n in usable if n not in serving and n not in self.joined]
        for node in [n for n in new if n in self.lost]:  # back after it was given up: a node like any other
            del self.lost[node]
        if new:
            self.cluster.measure([n for n in new if n not in self.cluster.measured])
            self.joined.update(new)
            log.info("node %s joined", ", ".join(n[:12] for n in new))
        if self.refused is not None and new:
            self._move(usable, "node " + ", ".join(n[:12] for n in new) + " joined while the pipeline was refused")
            return True
        if not new or self.timeouts.rebalance_at <= 0:
            return False
        try:
            planned = self.cluster.plan(usable)
        except OvshardError:
            return False
        if set(planned.nodes) <= serving or not worth_moving(self.cluster.slowest_s, planned.slowest_s,
                                                              self.timeouts.rebalance_at):
            return False
        speedup = self.cluster.slowest_s / planned.slowest_s
        self._move(usable, f"node {', '.join(n[:12] for n in new)} joined: predicted {speedup:.2f}x faster "
                   f"(--rebalance-at {self.timeouts.rebalance_at})")
        return True

    def _move(self, usable: list[str], cause: str) -> None:
        """Place the stages anew on ``usable``, the head held meanwhile; refuse it when they do not fit."""
        log.warning("re-plan: %s", cause)
        started, at = time.monotonic(), time.time()
        if self.head is not None:
            self.head.hold()
        try:
            choice = self.cluster.replan(usable)
        except Exception as e:  # PlanError (no room), or the new actors failed to start
            self.refused = f"{cause}; the nodes left cannot serve: {e}"
            self.last = Replan(cause, at, round(time.monotonic() - started, 2), "refused", 0, self.refused)
            log.error("%s", self.refused)
            if self.head is not None:
                self.head.refuse(self.refused)
            return
        self.refused = None
        self.silent_since.clear()
        self.joined -= set(choice.nodes)
        if self.head is not None:
            self.head.retarget(self.cluster.head_bundle, self.cluster.addresses)
        where = ", ".join(f"stage {i} on {n[:12]}" for i, n in enumerate(choice.nodes))
        self.last = Replan(cause, at, round(time.monotonic() - started, 2), "moved", len(choice.nodes), where)
        log.warning("re-plan done in %.1f s: %s", self.last.seconds, where)
        if self.announce is not None:
            self.announce(self.cluster, self.last)

    def _asked(self) -> str | None:
        """The id of a rebalance asked for (`ovshard rebalance`) and not served yet."""
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(kv_key(REBALANCE_KEY, self.cluster))
        return value.decode() if value else None

    def state(self) -> dict[str, Any]:
        """What `ovshard status` prints: each node's state, the last re-plan, whether the pipeline serves."""
        serving = set(self.cluster.nodes) if self.refused is None else set()
        nodes = []
        for node in dict.fromkeys([*self.cluster.nodes, *self.lost, *sorted(self.joined)]):
            state = "lost" if node in self.lost else "serving" if node in serving else "joined, unused"
            if node not in self.lost and node not in serving and node not in self.joined:
                state = "idle"  # held a stage of a refused pipeline
            nodes.append({"node": node[:12], "host": self.hosts.get(node, "?"), "state": state,
                          **({"why": self.lost[node]} if node in self.lost else {})})
        return {"bundle": str(self.cluster.bundle), "generation": self.cluster.generation, "nodes": nodes,
                "serving": self.refused is None, "refused": self.refused,
                "last_replan": asdict(self.last) if self.last else None, "answered": self.answered}

    def _publish(self) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(kv_key(STATE_KEY, self.cluster), json.dumps(self.state()).encode(),
                                     overwrite=True)


def published_states() -> list[dict[str, Any]]:
    """Every running ``up``'s published state (``ovshard status``)."""
    from ray.experimental import internal_kv

    states = []
    for key in internal_kv._internal_kv_list(STATE_KEY.encode()):
        value = internal_kv._internal_kv_get(key)
        if value:
            states.append({**json.loads(value), "key": key.decode().removeprefix(STATE_KEY)})
    return states


def ask_rebalance(tag: str, request: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(f"{REBALANCE_KEY}{tag}".encode(), request.encode(), overwrite=True)


__all__ = ["Replan", "Supervisor", "Timeouts", "ask_rebalance", "published_states", "worth_moving"]
