"""Graphviz DOT of an ``openvino.Model``, in the printer's order and with its stable node names."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import openvino
from openvino import Node

from ovshard.errors import OvshardError
from ovshard.ir.printer import PrintOrder, constant_payload, type_shape, variable_id, walk


def graph_dot(model: openvino.Model) -> str:
    """Return Graphviz DOT for ``model``, using the same stable node names as ``graph_text``."""
    graph = walk(model)
    lines = [
        "digraph model {",
        '  node [shape=box, style=rounded, fontname="monospace", fontsize=10];',
        '  edge [fontname="monospace", fontsize=8];',
    ]
    lines.extend(_dot_node(node, graph) for node in graph.order)
    for node in graph.order:
        lines.extend(_dot_edges(node, graph))
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_svg(dot_text: str, path: Path) -> bool:
    """Render ``dot_text`` to ``path`` with ``dot -Tsvg``; return False (writing nothing) if no ``dot``."""
    dot = shutil.which("dot")
    if dot is None:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(
            [dot, "-Tsvg", "-o", str(path)], input=dot_text, text=True, capture_output=True, check=True
        )
    except subprocess.CalledProcessError as e:
        raise OvshardError(
            f"expected `dot -Tsvg` to render {path}, but it exited with {e.returncode}: "
            f"{e.stderr.strip()}; check the DOT text or the Graphviz install"
        ) from e
    return True


def _dot_node(node: Node, graph: PrintOrder) -> str:
    """Return one DOT node statement; large constants are small filled boxes."""
    name = graph.names[node.get_instance_id()]
    op = node.get_type_name()
    shapes = ", ".join(type_shape(out) for out in node.outputs())
    parts = [op, shapes]
    if variable_id(node):
        parts.append(variable_id(node))
    style = ""
    if op == "Parameter":
        parts.insert(1, name[1:])
        style = ", shape=ellipse, style=bold"
    elif op == "Result":
        style = ", shape=ellipse"
    elif op == "Constant":
        payload = constant_payload(node)
        if payload.startswith("sha256:"):
            parts = [f"Constant {shapes}"]
            style = ", style=filled, fillcolor=gray90, fontsize=7, height=0.2, margin=0.02"
        else:
            parts.append(payload)
    label = "\\n".join(_dot_escape(part) for part in parts)
    return f'  "{_dot_escape(name)}" [label="{label}"{style}];'


def _dot_edges(node: Node, graph: PrintOrder) -> list[str]:
    """Return the DOT edges into ``node``: type+shape label, source output and input port if several."""
    edges = []
    for port, source in enumerate(node.input_values()):
        producer = source.get_node()
        attributes = [f'label="{_dot_escape(type_shape(source))}"']
        if producer.get_output_size() > 1:
            attributes.append(f'taillabel="#{source.get_index()}"')
        if node.get_input_size() > 1:
            attributes.append(f'headlabel="{port}"')
        tail = _dot_escape(graph.names[producer.get_instance_id()])
        head = _dot_escape(graph.names[node.get_instance_id()])
        edges.append(f'  "{tail}" -> "{head}" [{", ".join(attributes)}];')
    return edges


def _dot_escape(text: str) -> str:
    """Escape a string for use inside a double-quoted DOT label."""
    return text.replace("\\", "\\\\").replace('"', '\\"')
