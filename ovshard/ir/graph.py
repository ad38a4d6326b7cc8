"""Small read-only helpers over an openvino.Model that passes and checks share."""

from __future__ import annotations

from collections.abc import Iterable

import openvino as ov


def parameter(model: ov.Model, name: str) -> ov.Node | None:
    """The Parameter whose tensor carries ``name``, or None."""
    for p in model.get_parameters():
        if name in p.output(0).get_names():
            return p
    return None


def result(model: ov.Model, name: str) -> ov.Node | None:
    for r in model.get_results():
        if name in r.output(0).get_names() or name in r.input_value(0).get_names():
            return r
    return None


def ops_of_type(model: ov.Model, *types: str) -> list[ov.Node]:
    return [op for op in model.get_ordered_ops() if op.get_type_name() in types]


def consumers(node: ov.Node, port: int = 0) -> list[ov.Node]:
    return [i.get_node() for i in node.output(port).get_target_inputs()]


def redirect(old: ov.Output, new: ov.Output, keep: Iterable[ov.Node] = ()) -> None:
    """Make every consumer of ``old`` read ``new`` instead, except the nodes in ``keep``."""
    kept = {n.get_instance_id() for n in keep}
    for target in list(old.get_target_inputs()):
        if target.get_node().get_instance_id() not in kept:
            target.replace_source_output(new)


def variable_id(node: ov.Node) -> str:
    return node.get_attributes()["variable_id"]
