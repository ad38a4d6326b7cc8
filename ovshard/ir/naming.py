"""Deterministic names for a graph about to be saved, so a saved model's XML is reproducible.

OpenVINO names a node nobody named ``<Type>_<id>``, with ``id`` drawn from a process-wide counter, and
such names spread: a streamed stage saves each piece and reads it back (the default names become set
names), NNCF names what it adds after the weight it compresses (``Constant_49406/fq_weights_1``), and
openvino-tokenizers gives its Parameter and a Result such a name as a tensor name too. So the same model
built in two processes (a one-shot compile, where stage 1 follows stage 0, and a ``--only-stage 1``
compile, where it comes first) serializes to XML that differs in those names alone.

``stable_names`` renames such nodes to ``<Type>_<position>``, with the position in
``model.get_ordered_ops()``, which follows the graph's structure, not the counter: every node whose
name holds ``_<digit>`` (the mark of a counter), and a Parameter only when its whole name is of the
default form (Parameters carry the contract's input names). Names without the mark are set on purpose,
are deterministic, and stay: the front end's ``aten::mul/Multiply``, weights
(``self.layer.q_weight/scale``), ``rotary_table``, the ``past_key_values.{i}.key`` ReadValues and their
``.beam_gather``. A tensor name equal to a renamed node's old name gets its new name; every other tensor
name (the contract's ``input_ids``, ``logits``, ``string_output`` ...) and every variable id is left
alone. A model with its default name ``Model<n>`` (another counter) becomes ``Model``. A deterministic
name that happens to hold ``_<digit>`` (a front end's ``MatMul_2``) is renamed too: harmless, the
result is still a function of the graph.
"""

from __future__ import annotations

import re

import openvino as ov

_COUNTED = re.compile(r"_\d")  # "<Type>_<counter>", OpenVINO's default name, and every name built on one
_DEFAULT = re.compile(r"[A-Za-z][A-Za-z0-9]*_\d+")  # a whole default name, as a Parameter may carry
_DEFAULT_MODEL = re.compile(r"Model\d+")  # a model's default name, from another counter


def stable_names(model: ov.Model) -> int:
    """Rename every node whose name may hold a process-wide counter to ``<Type>_<position>``; return how many."""
    renamed: dict[str, str] = {}
    if _DEFAULT_MODEL.fullmatch(model.get_friendly_name()):
        model.set_friendly_name("Model")
    for position, node in enumerate(model.get_ordered_ops()):
        name = node.get_friendly_name()
        counted = _DEFAULT.fullmatch(name) if node.get_type_name() == "Parameter" else _COUNTED.search(name)
        stable = f"{node.get_type_name()}_{position}"
        if counted and stable != name:
            node.set_friendly_name(stable)
            renamed[name] = stable
    for node in model.get_ordered_ops():
        for port in node.outputs():
            tensor_names = port.get_names()
            if tensor_names & renamed.keys():
                port.get_tensor().set_names({renamed.get(n, n) for n in tensor_names})
    return len(renamed)
