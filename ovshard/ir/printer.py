"""One deterministic printer of an ``openvino.Model``: the text form of dumps and golden files.

``ovshard.ir.dot`` draws the same order and names as Graphviz DOT.

The text is byte-identical for the same graph whatever its friendly names, internal node ids or
construction order. Nodes are ordered by a DFS post-order from the Results (sorted by output tensor
name), then the sinks (sorted by variable id), then any unused Parameters, visiting inputs in port
order. Each node is named ``%N`` by its position in that order (Parameters by their tensor name).
Weights print as a sha256 prefix of their raw bytes; constants of at most 8 elements print values.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import openvino
from openvino import Node, Output

__all__ = ["PrintOrder", "constant_payload", "graph_text", "op_histogram", "text_diff", "type_shape", "variable_id", "walk"]

SMALL_CONSTANT = 8  # constants with at most this many elements print their values
HASH_CHARS = 12  # hex digits of sha256 kept in the text
HUGE_ATTRIBUTE = 160  # rendered attributes longer than this print as a hash
# Element types whose Constant.get_vector() returns exact values (bf16, i4, nf4, f8 do not).
_VECTOR_TYPES = frozenset(
    {"boolean", "f16", "f32", "f64", "i8", "i16", "i32", "i64", "u1", "u4", "u8", "u16", "u32", "u64"}
)
_BARE_STRING = re.compile(r"[A-Za-z0-9_.\-]+")
_SKIPPED_ATTRIBUTES = {"Parameter", "Constant"}  # their attributes repeat the output type and shape


@dataclass(frozen=True)
class PrintOrder:
    """A model's nodes in printing order and the stable name of each (keyed by instance id)."""

    order: tuple[Node, ...]
    names: dict[int, str]


# ---------------------------------------------------------------------------------------------
# Public API


def graph_text(model: openvino.Model) -> str:
    """Return the deterministic text form of ``model``: header, one line a node, op summary."""
    graph = walk(model)
    lines = _header_lines(model)
    lines.append("")
    lines.extend(_node_line(node, graph) for node in graph.order)
    lines.append("")
    lines.append(_histogram_line(model))
    return "\n".join(lines) + "\n"


def text_diff(before: str, after: str, before_name: str, after_name: str, context: int = 3) -> str:
    """Unified diff of two texts (empty when equal), graph texts aligned first so renumbering is no noise.

    Inserting one node renumbers every ``%N`` after it. Before diffing, lines are matched on their
    text with the numbers blanked out, each matched ``after`` node takes its ``before`` number, and
    nodes without a match are renamed ``%new.N``: the diff then shows only what the change did.
    """
    after_lines = _renumber_like(before.splitlines(), after.splitlines())
    diff = difflib.unified_diff(before.splitlines(), after_lines, before_name, after_name, n=context, lineterm="")
    text = "\n".join(diff)
    return text + "\n" if text else ""


_NUMBERED = re.compile(r"%(\d+)")
_DEFINED = re.compile(r"^%(\d+) = ")


def _renumber_like(before: list[str], after: list[str]) -> list[str]:
    """Rename the ``%N`` of ``after`` to the numbers of the matching ``before`` lines."""
    blank = [_NUMBERED.sub("%_", line) for line in before], [_NUMBERED.sub("%_", line) for line in after]
    matcher = difflib.SequenceMatcher(None, blank[0], blank[1], autojunk=False)
    mapping: dict[str, str] = {}
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            for b_line, a_line in zip(before[i1:i2], after[j1:j2], strict=True):
                b_def, a_def = _DEFINED.match(b_line), _DEFINED.match(a_line)
                if b_def and a_def:
                    mapping[a_def.group(1)] = b_def.group(1)
    return [_NUMBERED.sub(lambda m: "%" + mapping.get(m.group(1), "new." + m.group(1)), line) for line in after]


def op_histogram(model: openvino.Model) -> dict[str, int]:
    """Return op type -> number of nodes of that type, sorted by type name."""
    counts = Counter(node.get_type_name() for node in model.get_ops())
    return dict(sorted(counts.items()))


# ---------------------------------------------------------------------------------------------
# Ordering and naming


def walk(model: openvino.Model) -> PrintOrder:
    """Order the nodes by DFS post-order from the sorted roots and give each a stable name."""
    params = _sorted_parameters(model)
    roots: list[Node] = [*_sorted_results(model), *_sorted_sinks(model), *params]
    order = _post_order(roots)
    param_names = {p.get_instance_id(): _parameter_name(model, p) for p in params}
    names: dict[int, str] = {}
    counter = 0
    for node in order:
        key = node.get_instance_id()
        if key in param_names:
            names[key] = param_names[key]
        else:
            names[key] = f"%{counter}"
            counter += 1
    return PrintOrder(order=tuple(order), names=names)


def _post_order(roots: list[Node]) -> list[Node]:
    """Iterative DFS post-order over producers, inputs in port order (graphs can be deep)."""
    order: list[Node] = []
    seen: set[int] = set()
    for root in roots:
        if root.get_instance_id() in seen:
            continue
        seen.add(root.get_instance_id())
        stack = [(root, iter(_producers(root)))]
        while stack:
            node, pending = stack[-1]
            child = next((c for c in pending if c.get_instance_id() not in seen), None)
            if child is None:
                stack.pop()
                order.append(node)
            else:
                seen.add(child.get_instance_id())
                stack.append((child, iter(_producers(child))))
    return order


def _producers(node: Node) -> list[Node]:
    """Return the nodes feeding ``node``, in input port order."""
    return [value.get_node() for value in node.input_values()]


def _sorted_parameters(model: openvino.Model) -> list[Node]:
    """Return the Parameters sorted by tensor name (unnamed ones last, by index)."""
    return _sorted_by_name(list(model.get_parameters()))


def _sorted_results(model: openvino.Model) -> list[Node]:
    """Return the Results sorted by output tensor name (unnamed ones last, by index)."""
    return _sorted_by_name(list(model.get_results()))


def _sorted_by_name(nodes: list[Node]) -> list[Node]:
    """Sort single-output nodes by tensor name; unnamed ones go last in their given order."""
    names = [_tensor_name(node.output(0)) for node in nodes]
    order = sorted(range(len(nodes)), key=lambda i: (names[i] is None, names[i] or "", i))
    return [nodes[i] for i in order]


def _sorted_sinks(model: openvino.Model) -> list[Node]:
    """Return the sinks sorted by variable id (then type, for sinks without one)."""
    return sorted(model.get_sinks(), key=lambda s: (variable_id(s), s.get_type_name()))


def _parameter_name(model: openvino.Model, param: Node) -> str:
    """Return a Parameter's stable name: ``%<tensor name>``, or ``%arg<index>`` if unnamed."""
    name = _tensor_name(param.output(0))
    return f"%{name}" if name is not None else f"%arg{model.get_parameter_index(param)}"


def _tensor_name(output: Output) -> str | None:
    """Return the smallest tensor name of ``output``, or None if it has none."""
    names = output.get_names()
    return min(names) if names else None


def variable_id(node: Node) -> str:
    """Return the variable id of a ReadValue/Assign-like node, or '' if it has none."""
    getter = getattr(node, "get_variable_id", None)
    return str(getter()) if getter is not None else ""


def _ref(output: Output, graph: PrintOrder) -> str:
    """Return how an output is referenced: ``%N``, or ``%N#i`` for a multi-output node."""
    node = output.get_node()
    name = graph.names[node.get_instance_id()]
    return f"{name}#{output.get_index()}" if node.get_output_size() > 1 else name


# ---------------------------------------------------------------------------------------------
# Text lines


def _header_lines(model: openvino.Model) -> list[str]:
    """Return the ``input``, ``output`` and ``variable`` header lines."""
    lines = [
        f"input {_parameter_name(model, p)[1:]}: {type_shape(p.output(0))}"
        for p in _sorted_parameters(model)
    ]
    for index, result in enumerate(_sorted_results(model)):
        name = _tensor_name(result.output(0)) or f"<unnamed {index}>"
        lines.append(f"output {name}: {type_shape(result.output(0))}")
    infos = sorted((v.get_info() for v in model.get_variables()), key=lambda info: info.variable_id)
    for info in infos:
        shape = str(info.data_shape).replace(" ", "")
        lines.append(f"variable {info.variable_id}: {info.data_type.get_type_name()}{shape}")
    return lines


def _node_line(node: Node, graph: PrintOrder) -> str:
    """Return one node's line, e.g. ``%3 = MatMul(%x, %2) {transpose_b=true} -> f32[?,64]``."""
    name = graph.names[node.get_instance_id()]
    op = node.get_type_name()
    if op == "Constant":
        return f"{name} = Constant {type_shape(node.output(0))} {constant_payload(node)}"
    args = ", ".join(_ref(value, graph) for value in node.input_values())
    text = f"{name} = {op}({args})" if args else f"{name} = {op}"
    attributes = _attributes_text(node)
    if attributes:
        text += f" {{{attributes}}}"
    text += " -> " + ", ".join(type_shape(out) for out in node.outputs())
    if op in ("Parameter", "Result"):
        names = sorted(node.output(0).get_names())
        if names:
            text += "  # names: " + ", ".join(names)
    return text


def _histogram_line(model: openvino.Model) -> str:
    """Return the ``# ops:`` summary line."""
    return "# ops: " + ", ".join(f"{op}={count}" for op, count in op_histogram(model).items())


def type_shape(output: Output) -> str:
    """Return ``<element type><partial shape>`` of an output, e.g. ``f32[?,?,64]``."""
    shape = str(output.get_partial_shape()).replace(" ", "")
    return f"{output.get_element_type().get_type_name()}{shape}"


def _attributes_text(node: Node) -> str:
    """Return ``key=value`` pairs sorted by key; huge values print as a hash."""
    if node.get_type_name() in _SKIPPED_ATTRIBUTES:
        return ""
    pairs = []
    for key, value in sorted(node.get_attributes().items()):
        rendered = _render_value(value)
        if len(rendered) > HUGE_ATTRIBUTE:
            rendered = f"<{len(rendered)} chars sha256:{_sha(rendered.encode())}>"
        pairs.append(f"{key}={rendered}")
    return ", ".join(pairs)


def _render_value(value: Any) -> str:
    """Render an attribute value compactly and deterministically."""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    if isinstance(value, str):
        return value if _BARE_STRING.fullmatch(value) else json.dumps(value)
    if isinstance(value, np.ndarray):
        return _render_value(value.tolist())
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_render_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={_render_value(v)}" for k, v in sorted(value.items())) + "}"
    return str(value).replace(" ", "")


# ---------------------------------------------------------------------------------------------
# Constants


def constant_payload(node: Node) -> str:
    """Return the values of a small constant, else ``sha256:<prefix>`` of its raw bytes."""
    type_name = node.get_output_element_type(0).get_type_name()
    size = int(np.prod(node.get_output_shape(0), dtype=np.int64))
    if type_name == "string":
        strings = list(node.get_value_strings())
        if size <= SMALL_CONSTANT:
            return "[" + ", ".join(json.dumps(s) for s in strings) + "]"
        return "sha256:" + _sha(json.dumps(strings).encode())
    if size <= SMALL_CONSTANT:
        values = _small_values(node, type_name)
        if values is not None:
            return values
    return "sha256:" + _sha(_raw_bytes(node))


def _small_values(node: Node, type_name: str) -> str | None:
    """Return ``[v0, v1, ...]`` (or a bare scalar), or None if the type cannot be read exactly."""
    if type_name in _VECTOR_TYPES:
        flat = np.asarray(node.get_vector()).reshape(-1)
    elif type_name == "bf16":  # get_data() reinterprets bf16 bits as f16: widen the bits by hand
        bits = np.frombuffer(_raw_bytes(node), dtype=np.uint16).astype(np.uint32) << 16
        flat = bits.view(np.float32)
    else:
        return None
    if type_name == "boolean":  # get_vector() returns u8 0/1
        flat = flat.astype(np.bool_)
    items = [_render_scalar(item) for item in flat]
    return items[0] if len(node.get_output_shape(0)) == 0 else "[" + ", ".join(items) + "]"


def _render_scalar(item: np.generic) -> str:
    """Render one element: shortest round-trip text for its own precision."""
    if isinstance(item, np.bool_):
        return "true" if item else "false"
    return str(item)


def _raw_bytes(node: Node) -> memoryview:
    """Return the constant's raw (packed) bytes without copying when possible."""
    return np.ascontiguousarray(node.get_data()).data.cast("B")


def _sha(data: bytes | memoryview) -> str:
    """Return the first ``HASH_CHARS`` hex digits of sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()[:HASH_CHARS]
