"""Tests of the deterministic graph printer (text, DOT, SVG, diff, histogram)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
from openvino.op.util import Variable, VariableInfo

from ovshard.errors import OvshardError
from ovshard.ir.dot import graph_dot, write_svg
from ovshard.ir.printer import graph_text, op_histogram, text_diff

HIDDEN = 8


def _weight(seed: int = 0) -> np.ndarray:
    """Return a deterministic [HIDDEN, HIDDEN] f32 weight."""
    return np.random.default_rng(seed).standard_normal((HIDDEN, HIDDEN)).astype(np.float32)


def _name(node: ov.Node, tensor: str, friendly: str) -> ov.Node:
    """Give a single-output node a tensor name and a friendly name; return it."""
    node.output(0).get_tensor().set_names({tensor})
    node.set_friendly_name(friendly)
    return node


def _mlp(weight: np.ndarray, *, reverse: bool = False, tag: str = "a") -> ov.Model:
    """Build x -> MatMul(W^T) -> Relu -> Add(mask) -> 'logits', plus Relu -> 'hidden_states'."""
    if reverse:  # constants first, then parameters: different internal ids and creation order
        w = ops.constant(weight, name=f"{tag}_w")
        offset = ops.constant(np.array([0, 1], np.int64), name=f"{tag}_offset")
        mask = _name(ops.parameter([-1, 2], ov.Type.i64), "attention_mask", f"{tag}_mask")
        x = _name(ops.parameter([-1, -1, HIDDEN], ov.Type.f32), "input_ids", f"{tag}_x")
    else:
        x = _name(ops.parameter([-1, -1, HIDDEN], ov.Type.f32), "input_ids", f"{tag}_x")
        mask = _name(ops.parameter([-1, 2], ov.Type.i64), "attention_mask", f"{tag}_mask")
        offset = ops.constant(np.array([0, 1], np.int64), name=f"{tag}_offset")
        w = ops.constant(weight, name=f"{tag}_w")
    relu = ops.relu(ops.matmul(x, w, False, True, name=f"{tag}_mm"), name=f"{tag}_relu")
    shifted = ops.convert(ops.add(mask, offset), ov.Type.f32)
    logits = ops.add(relu, ops.reduce_sum(shifted, np.int64(1), keep_dims=False))
    results = [
        _name(ops.result(logits), "logits", f"{tag}_out"),
        _name(ops.result(relu), "hidden_states", f"{tag}_hidden"),
    ]
    params = [x, mask]
    if reverse:
        results.reverse()
        params.reverse()
    return ov.Model(results, params, f"mlp_{tag}")


def _variable(variable_id: str) -> Variable:
    """Return a f32 [?, HIDDEN] state variable."""
    info = VariableInfo()
    info.variable_id = variable_id
    info.data_type = ov.Type.f32
    info.data_shape = ov.PartialShape([-1, HIDDEN])
    return Variable(info)


def _stateful(*, reverse: bool = False) -> ov.Model:
    """Build two KV-like states: ReadValue(zeros) -> Concat(hidden) -> Assign, summed into 'logits'."""
    ids = ["past.1.key", "past.0.key"] if reverse else ["past.0.key", "past.1.key"]
    hidden = _name(ops.parameter([-1, HIDDEN], ov.Type.f32), "hidden_states", f"h{reverse}")
    sinks, concats = [], {}
    for variable_id in ids:
        variable = _variable(variable_id)
        init = ops.broadcast(ops.constant(np.float32(0)), ops.constant(np.array([0, HIDDEN], np.int64)))
        concat = ops.concat([ops.read_value(init, variable), hidden], 0)
        sinks.append(ops.assign(concat, variable))
        concats[variable_id] = concat
    logits = ops.add(concats["past.0.key"], concats["past.1.key"])
    result = _name(ops.result(logits), "logits", f"out{reverse}")
    return ov.Model([result], sinks, [hidden], "stateful")


def _changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    """Return the (before, after) pairs of lines that differ between two equally long texts."""
    pairs = zip(before.splitlines(), after.splitlines(), strict=True)
    return [(b, a) for b, a in pairs if b != a]


def test_text_ignores_friendly_names_and_creation_order() -> None:
    """The same graph built in another order with other friendly names prints byte-identical text."""
    assert graph_text(_mlp(_weight(), tag="a")) == graph_text(_mlp(_weight(), reverse=True, tag="b"))


def test_stateful_text_ignores_variable_and_sink_order() -> None:
    """Variables and sinks created and registered in another order print identical text."""
    assert graph_text(_stateful()) == graph_text(_stateful(reverse=True))


def test_text_of_small_graph_is_exact() -> None:
    """The full text of a small graph: header, topological body, stable names, op summary."""
    expected = """\
input attention_mask: i64[?,2]
input input_ids: f32[?,?,8]
output hidden_states: f32[?,?,8]
output logits: f32[?,?,8]

%input_ids = Parameter -> f32[?,?,8]  # names: input_ids
%0 = Constant f32[8,8] sha256:{hash}
%1 = MatMul(%input_ids, %0) {transpose_a=false, transpose_b=true} -> f32[?,?,8]
%2 = Relu(%1) -> f32[?,?,8]
%3 = Result(%2) -> f32[?,?,8]  # names: hidden_states
%attention_mask = Parameter -> i64[?,2]  # names: attention_mask
%4 = Constant i64[2] [0, 1]
%5 = Add(%attention_mask, %4) {auto_broadcast=numpy} -> i64[?,2]
%6 = Convert(%5) {destination_type=f32} -> f32[?,2]
%7 = Constant i64[] 1
%8 = ReduceSum(%6, %7) {keep_dims=false} -> f32[?]
%9 = Add(%2, %8) {auto_broadcast=numpy} -> f32[?,?,8]
%10 = Result(%9) -> f32[?,?,8]  # names: logits

# ops: Add=2, Constant=3, Convert=1, MatMul=1, Parameter=2, ReduceSum=1, Relu=1, Result=2
"""
    text = graph_text(_mlp(_weight()))
    digest = re.search(r"sha256:([0-9a-f]{12})", text)
    assert digest is not None
    assert text == expected.replace("{hash}", digest.group(1))


def test_changing_one_constant_changes_only_its_hash_line() -> None:
    """Editing one weight value changes exactly the line of that Constant, and only its hash."""
    weight = _weight()
    edited = weight.copy()
    edited[3, 5] += 1.0
    changed = _changed_lines(graph_text(_mlp(weight)), graph_text(_mlp(edited)))
    assert len(changed) == 1
    before, after = changed[0]
    assert before.startswith("%0 = Constant f32[8,8] sha256:")
    assert after.startswith("%0 = Constant f32[8,8] sha256:")


def test_small_constants_print_values() -> None:
    """Constants of at most 8 elements print their values (ints, floats, bools, bf16, scalars)."""
    x = _name(ops.parameter([3], ov.Type.f32), "x", "x")
    bf16 = ops.convert(ops.constant(np.array([1.5, 2, -3], np.float32), dtype=ov.Type.bf16), ov.Type.f32)
    flags = ops.convert(ops.constant(np.array([True, False, True])), ov.Type.f32)
    floats = ops.constant(np.array([0.1, 1e-5, -2.0], np.float32))
    total = ops.add(ops.add(ops.add(x, bf16), flags), ops.multiply(floats, ops.constant(np.float32(0.5))))
    text = graph_text(ov.Model([_name(ops.result(total), "y", "y")], [x]))
    assert "= Constant bf16[3] [1.5, 2.0, -3.0]" in text
    assert "= Constant boolean[3] [true, false, true]" in text
    assert "= Constant f32[3] [0.1, 1e-05, -2.0]" in text
    assert "= Constant f32[] 0.5" in text


def test_header_lists_inputs_outputs_and_variables_sorted() -> None:
    """Parameters, Results and variables head the text, each sorted by name."""
    header = graph_text(_stateful()).split("\n\n")[0].splitlines()
    assert header == [
        "input hidden_states: f32[?,8]",
        "output logits: f32[?,8]",
        "variable past.0.key: f32[?,8]",
        "variable past.1.key: f32[?,8]",
    ]


def test_read_value_and_assign_print_variable_ids_and_sinks_come_last() -> None:
    """ReadValue/Assign lines carry their variable id; sinks follow the Results, sorted by id."""
    body = graph_text(_stateful()).split("\n\n")[1].splitlines()
    assigns = [line for line in body if "= Assign(" in line]
    reads = [line for line in body if "= ReadValue(" in line]
    assert re.findall(r"variable_id=([^,}]+)", "\n".join(assigns)) == ["past.0.key", "past.1.key"]
    assert len(reads) == 2 and all("variable_id=past." in line for line in reads)
    assert body[-2:] == assigns
    assert "= Result(" in body[-3]


def test_multi_output_nodes_are_referenced_by_output_index() -> None:
    """Consumers of a Split name each output as %N#i and the Split lists both output types."""
    x = _name(ops.parameter([4, 6], ov.Type.f32), "x", "x")
    parts = ops.split(x, ops.constant(np.int64(1)), 2)
    total = ops.subtract(parts.output(1), parts.output(0))
    text = graph_text(ov.Model([_name(ops.result(total), "y", "y")], [x]))
    assert "%1 = Split(%x, %0) {num_splits=2} -> f32[4,3], f32[4,3]" in text
    assert "%2 = Subtract(%1#1, %1#0) {auto_broadcast=numpy} -> f32[4,3]" in text


def test_graph_dot_has_one_node_per_op_and_stable_names() -> None:
    """The DOT text is a digraph with one node statement per op, named as in the text form."""
    model = _mlp(_weight())
    dot = graph_dot(model)
    nodes = re.findall(r'^  "([^"]+)" \[label=', dot, flags=re.MULTILINE)
    assert dot.startswith("digraph ") and dot.rstrip().endswith("}")
    assert len(nodes) == len(model.get_ops()) == len(set(nodes))
    assert set(nodes) == set(re.findall(r"^(%\S+) = ", graph_text(model), flags=re.MULTILINE))
    assert '"%input_ids" -> "%1" [label="f32[?,?,8]", headlabel="0"];' in dot
    assert graph_dot(model) == graph_dot(_mlp(_weight(), reverse=True, tag="b"))


def test_write_svg_returns_false_without_dot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no `dot` on PATH, write_svg returns False and writes no file."""
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    target = tmp_path / "graph.svg"
    assert write_svg(graph_dot(_mlp(_weight())), target) is False
    assert not target.exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_write_svg_renders_with_dot(tmp_path: Path) -> None:
    """With `dot` on PATH, write_svg writes an SVG file and returns True."""
    target = tmp_path / "dumps" / "graph.svg"
    assert write_svg(graph_dot(_mlp(_weight())), target) is True
    assert "<svg" in target.read_text()


def _fake_dot(bin_dir: Path, script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put an executable shell script named `dot` alone on PATH."""
    bin_dir.mkdir()
    dot = bin_dir / "dot"
    dot.write_text("#!/bin/sh\n" + script)
    dot.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_write_svg_passes_dot_text_and_output_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """write_svg runs `dot -Tsvg -o <path>` with the DOT text on stdin, creating parent folders."""
    _fake_dot(tmp_path / "bin", 'test "$1" = -Tsvg && test "$2" = -o && /bin/cat > "$3"\n', monkeypatch)
    target = tmp_path / "stage0" / "graph.svg"
    dot_text = graph_dot(_mlp(_weight()))
    assert write_svg(dot_text, target) is True
    assert target.read_text() == dot_text


def test_write_svg_failure_raises_with_dot_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing `dot` raises OvshardError quoting its stderr instead of returning silently."""
    _fake_dot(tmp_path / "bin", "echo 'syntax error in line 1' >&2\nexit 3\n", monkeypatch)
    with pytest.raises(OvshardError, match="exited with 3: syntax error in line 1"):
        write_svg("digraph {", tmp_path / "graph.svg")


def test_text_diff_shows_only_changed_lines() -> None:
    """The unified diff of two dumps removes and adds exactly the changed Constant line."""
    weight = _weight()
    edited = weight.copy()
    edited[0, 0] = 42.0
    before, after = graph_text(_mlp(weight)), graph_text(_mlp(edited))
    diff = text_diff(before, after, "00_before.txt", "01_after.txt")
    assert diff.startswith("--- 00_before.txt\n+++ 01_after.txt\n@@ ")
    body = diff.splitlines()[2:]
    removed = [line for line in body if line.startswith("-")]
    added = [line for line in body if line.startswith("+")]
    assert [(r[1:], a[1:]) for r, a in zip(removed, added, strict=True)] == _changed_lines(before, after)
    assert text_diff(before, before, "a", "b") == ""


def test_saved_and_read_back_model_prints_the_same(tmp_path: Path) -> None:
    """A model saved as IR (no fp16 compression) and read back prints the same text as in memory."""
    core = ov.Core()
    for index, model in enumerate([_mlp(_weight()), _stateful()]):
        path = tmp_path / f"model{index}.xml"
        ov.save_model(model, path, compress_to_fp16=False)
        assert graph_text(core.read_model(path)) == graph_text(model)


def test_op_histogram_counts_ops_sorted_by_type() -> None:
    """op_histogram counts every node by type, keys in sorted order."""
    histogram = op_histogram(_stateful())
    assert list(histogram) == sorted(histogram)
    assert histogram["ReadValue"] == histogram["Assign"] == 2
    assert histogram["Constant"] == 4 and histogram["Parameter"] == 1 and histogram["Result"] == 1


def test_deep_chain_prints_without_recursion_limit() -> None:
    """A 3000-node chain (deeper than Python's recursion limit) prints in order."""
    node = x = _name(ops.parameter([2], ov.Type.f32), "x", "x")
    for _ in range(3000):
        node = ops.relu(node)
    lines = graph_text(ov.Model([_name(ops.result(node), "y", "y")], [x])).splitlines()
    assert lines[3] == "%x = Parameter -> f32[2]  # names: x"
    assert lines[4] == "%0 = Relu(%x) -> f32[2]" and lines[3003] == "%2999 = Relu(%2998) -> f32[2]"


def test_text_diff_ignores_renumbering_from_an_insertion() -> None:
    """A node inserted early shows as its own lines plus the one changed reader, not as a renumbered tail."""
    before = "%0 = Constant f32[] 1.0\n%1 = Relu(%0) -> f32[]\n%2 = Exp(%1) -> f32[]\n%3 = Result(%2) -> f32[]\n"
    after = ("%0 = Constant f32[] 1.0\n%1 = Relu(%0) -> f32[]\n%2 = Abs(%1) -> f32[]\n%3 = Exp(%2) -> f32[]\n"
             "%4 = Result(%3) -> f32[]\n")
    changed = [line for line in text_diff(before, after, "a", "b").splitlines()
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed == ["-%2 = Exp(%1) -> f32[]", "+%new.2 = Abs(%1) -> f32[]", "+%2 = Exp(%new.2) -> f32[]"]
