"""Where each KV variable's ReadValue flows in a stage graph: the facts the fusion predictor checks."""

from __future__ import annotations

from dataclasses import dataclass

import openvino as ov

from ovshard.bundle import names
from ovshard.ir import graph

PASSTHROUGH = {"Unsqueeze", "Broadcast", "Reshape", "Multiply", "Transpose"}  # between Concat and attention


@dataclass(frozen=True)
class KVVar:
    """Where one KV variable's ReadValue flows, seen through Converts that keep the type."""

    vid: str
    read: ov.Node
    others: tuple[str, ...]  # readers of the ReadValue the CPU pattern does not allow
    convert: ov.Node | None  # a type-changing Convert between the ReadValue and its Gather/Concat
    gather: ov.Node | None
    concat: ov.Node | None
    assign: ov.Node | None  # reached from the Concat, directly or through one Convert
    chain: tuple[ov.Node, ...]  # nodes between the Concat and the attention op
    attention: ov.Input | None  # the SDPA/MatMul input the cache reaches


def readers(out: ov.Output) -> list[ov.Input]:
    """Consumers of ``out``, looking through Converts that keep the type (NopElimination drops them)."""
    found = []
    for target in out.get_target_inputs():
        node = target.get_node()
        if node.get_type_name() == "Convert" and node.get_input_element_type(0) == node.get_output_element_type(0):
            found += readers(node.output(0))
        else:
            found.append(target)
    return found


def first_of(inputs: list[ov.Input], *types: str) -> ov.Node | None:
    return next((i.get_node() for i in inputs if i.get_node().get_type_name() in types), None)


def assign_of(concat: ov.Node) -> ov.Node | None:
    for target in readers(concat.output(0)):
        node = target.get_node()
        if node.get_type_name() == "Convert" and len(node.output(0).get_target_inputs()) == 1:
            node = next(iter(node.output(0).get_target_inputs())).get_node()
        if node.get_type_name() == "Assign":
            return node
    return None


def attention_path(concat: ov.Node) -> tuple[tuple[ov.Node, ...], ov.Input | None]:
    """Follow the Concat's one data reader through reshapes to the first SDPA/MatMul input."""
    skip = {"ShapeOf", "Assign"} | ({"Convert"} if assign_of(concat) is not None else set())
    data = [t for t in readers(concat.output(0)) if t.get_node().get_type_name() not in skip]
    chain: list[ov.Node] = []
    while len(data) == 1 and len(chain) < 6:
        node = data[0].get_node()
        if node.get_type_name() in ("ScaledDotProductAttention", "MatMul"):
            return tuple(chain), data[0]
        if node.get_type_name() not in PASSTHROUGH:
            break
        chain.append(node)
        data = readers(node.output(0))
    return tuple(chain), None


def trace_variable(read: ov.Node) -> KVVar:
    found = readers(read.output(0))
    allowed = {"ScaledDotProductAttention", "ShapeOf", "Convert", "Gather"}
    others = tuple(sorted({r.get_node().get_type_name() for r in found} - allowed))
    data = [r for r in found if r.get_node().get_type_name() != "ShapeOf"]
    convert = first_of(data, "Convert")
    if convert is not None:
        data = readers(convert.output(0))
    gather, concat = first_of(data, "Gather"), first_of(data, "Concat")
    if gather is not None:
        concat = first_of(readers(gather.output(0)), "Concat")
    assign = assign_of(concat) if concat is not None else None
    chain, attention = attention_path(concat) if concat is not None else ((), None)
    return KVVar(graph.variable_id(read), read, others, convert, gather, concat, assign, chain, attention)


def layer_of(vid: str) -> tuple[int, bool] | None:
    """(layer, is_key) for ovshard's variable names, read through ``names``; None otherwise."""
    sentinel = "987654321"
    for make, is_key in ((names.past_key, True), (names.past_value, False)):
        head, _, tail = make(int(sentinel)).partition(sentinel)
        middle = vid[len(head):len(vid) - len(tail)]
        if vid.startswith(head) and vid.endswith(tail) and middle.isdigit():
            return int(middle), is_key
    return None


def pair_variables(kvs: list[KVVar]) -> list[tuple[str, list[KVVar]]]:
    """Group variables into layers: by ovshard names, else by the SDPA they feed (K input 1, V input 2)."""
    by_layer: dict[int, dict[bool, KVVar]] = {}
    by_sdpa: dict[tuple[str, object], dict[int, KVVar]] = {}
    for kv in kvs:
        where, att = layer_of(kv.vid), kv.attention
        if where is not None:
            by_layer.setdefault(where[0], {})[where[1]] = kv
        elif att is not None and att.get_index() in (1, 2):
            by_sdpa.setdefault(("sdpa", att.get_node().get_instance_id()), {})[att.get_index()] = kv
        else:
            by_sdpa[("var", kv.vid)] = {1: kv}
    groups = []
    for layer in sorted(by_layer):
        pair = [by_layer[layer][k] for k in (True, False) if k in by_layer[layer]]
        prefix, kinds = pair[0].vid.rsplit(".", 1)[0], "/".join(kv.vid.rsplit(".", 1)[-1] for kv in pair)
        groups.append((f"layer {layer} ({prefix}.{kinds})", pair))
    for n, ports in enumerate(by_sdpa.values()):
        pair = [ports[p] for p in sorted(ports)]
        groups.append((f"KV pair {n} ({', '.join(kv.vid for kv in pair)})", pair))
    return groups
