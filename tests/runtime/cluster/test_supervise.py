"""The supervisor's rule for moving onto a node that joined by itself: a predicted speed-up of --rebalance-at."""

from __future__ import annotations

import pytest

from ovshard.runtime.cluster.supervise import worth_moving


@pytest.mark.parametrize(("current_s", "planned_s", "threshold", "moves"), [
    (0.012, 0.010, 1.2, True),  # exactly 1.2x
    (0.012, 0.0101, 1.2, False),  # just short of it
    (0.030, 0.010, 1.2, True),
    (0.030, 0.010, 0.0, False),  # 0: only `ovshard rebalance` moves them
    (0.030, 0.0, 1.2, False),  # no prediction (--placement bundle)
])
def test_the_stages_move_by_themselves_from_the_threshold_speed_up(current_s: float, planned_s: float,
                                                                   threshold: float, moves: bool) -> None:
    """current / planned slowest step >= threshold moves; below it, or threshold 0, or no prediction, does not."""
    assert worth_moving(current_s, planned_s, threshold) is moves


def test_the_clusters_error_messages_go_to_stderr_and_leave_stdout_to_the_json_lines(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Ray's driver prints a raylet's message (a node that missed its heartbeats) to stdout whatever
    ``log_to_driver`` says; once joined, ``up`` and ``status`` keep stdout for their JSON lines."""
    from ray._private import worker

    from ovshard.runtime.cluster.up import _raylet_messages_to_stderr

    printed = worker.print_to_stdstream
    try:
        _raylet_messages_to_stderr()
        _raylet_messages_to_stderr()  # joining twice wraps once
        worker.print_to_stdstream({"lines": ["the node missed too many heartbeats"], "pid": "raylet",
                                   "is_err": False}, ignore_prefix=False)
        worker.print_to_stdstream({"lines": ["a task's own print"], "pid": 4242, "is_err": False},
                                  ignore_prefix=False)
    finally:
        worker.print_to_stdstream = printed
    out, err = capsys.readouterr()
    assert "heartbeats" in err and "heartbeats" not in out
    assert "a task's own print" in out


def test_a_stage_actors_name_tells_its_stage_while_its_node_cannot_answer() -> None:
    """`ovshard status` names an actor's stage from its name (its info() fails while its node is gone): the
    index of every generation's name, and nothing for a name of another form."""
    from pathlib import Path

    from ovshard.runtime.cluster.up import _actor_name, stage_of

    assert [stage_of(_actor_name(Path("/b"), k, g)) for k, g in ((0, 0), (3, 1), (12, 7))] == [0, 3, 12]
    assert stage_of("ovshard-stage-x-1234-0") is None and stage_of("other-actor") is None
