"""Joining graphs: pieces into one stage graph, and row chunks of a compressed weight into one weight.

A streamed compile never holds a stage's weights, or one whole embedding, as f32 in memory: it compresses
pieces and row chunks on their own and joins the results here. Joining changes no number: a Parameter
is replaced by the Output of the same name produced upstream, and a chunked weight's constants are
concatenated row by row into file-backed buffers (NNCF's weight formats are per row: per channel, or
per group along a row), keeping the decompression subgraph of the first chunk.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ovshard.errors import OvshardError


def tensor_name(port: ov.Output) -> str:
    found = sorted(port.get_names())
    if not found:
        raise OvshardError(f"a {port.get_node().get_type_name()} output has no tensor name; pieces meet by name")
    return found[0]


class Assembler:
    """Collects pieces in order; each piece's Parameters read the Outputs earlier pieces produced."""

    def __init__(self) -> None:
        self.produced: dict[str, ov.Output] = {}
        self.parameters: dict[str, ov.Node] = {}  # stage inputs: Parameters no earlier piece feeds
        self.results: dict[str, ov.Node] = {}  # every piece's Results, by tensor name
        self.keep: list[ov.Model] = []  # the pieces stay alive until the stage graph is built

    def add(self, piece: ov.Model) -> None:
        self.keep.append(piece)
        for param in piece.get_parameters():
            name = tensor_name(param.output(0))
            if name in self.produced:
                param.output(0).replace(self.produced[name])
            elif name in self.parameters:
                param.output(0).replace(self.parameters[name].output(0))
            else:
                self.parameters[name] = param
        for result in piece.get_results():
            self.results[tensor_name(result.output(0))] = result
            self.produced[tensor_name(result.output(0))] = result.input_value(0)

    def provide(self, name: str, output: ov.Output) -> None:
        """Make ``output`` what later pieces read as ``name`` (e.g. a weight built from chunks)."""
        self.produced[name] = output

    def model(self, inputs: Iterable[str], outputs: Iterable[tuple[str, str]], name: str) -> ov.Model:
        """The stage graph: these inputs in order, and for each (produced name, contract name) one output.

        The pieces' other Results are cut off their producers: a pattern (the plugins' KV-cache fusion)
        counts every reader of a tensor, and a dangling Result is one.
        """
        params = [self.parameters[n] for n in inputs]
        for param, n in zip(params, inputs, strict=True):
            param.output(0).get_tensor().set_names({n})  # Output.replace moved the piece names onto it
        results = []
        for produced, contract in outputs:
            result = self.results.get(produced)
            if result is None or result.input_value(0) != self.produced[produced]:
                result = ops.result(self.produced[produced])
            result.input_value(0).get_tensor().set_names({contract})
            result.output(0).get_tensor().set_names({contract})
            results.append(result)
        kept = {r.get_instance_id() for r in results}
        for result in self.results.values():
            if result.get_instance_id() not in kept:
                result.input(0).replace_source_output(ops.constant(np.float32(0)).output(0))
        model = ov.Model(results, params, name)
        model.validate_nodes_and_infer_types()
        # Let go of every piece: a Result a later pass removes (MakeStatefulKVPass) must die with the graph,
        # or it stays a reader of its tensor
        self.keep, self.results, self.produced, self.parameters = [], {}, {}, {}
        return model


def _upstream_constants(weight: ov.Output) -> list[tuple[ov.Node, bool]]:
    """Constants of the subgraph computing ``weight``, in DFS order; True for a Reshape's target shape."""
    found, seen, stack = [], set(), [(weight.get_node(), False)]
    while stack:
        node, is_shape = stack.pop()
        if node.get_instance_id() in seen:
            continue
        seen.add(node.get_instance_id())
        if node.get_type_name() == "Constant":
            found.append((node, is_shape))
            continue
        for port, source in reversed(list(enumerate(node.input_values()))):
            stack.append((source.get_node(), node.get_type_name() == "Reshape" and port == 1))
    return found


class RowSplicer:
    """Rebuilds one weight of ``rows`` rows from compressed row chunks, in file-backed buffers under ``scratch``.

    ``add`` takes each chunk's weight Output (the decompressed weight its Gather or MatMul reads) in row
    order; ``finish`` returns the first chunk's decompression subgraph with every per-row constant
    replaced by the whole one. Chunks but the last must have an even number of rows (packed 4-bit rows
    then start on a byte).
    """

    def __init__(self, rows: int, scratch: Path, name: str) -> None:
        self.rows, self.scratch, self.name = rows, scratch, name
        self.first: ov.Output | None = None
        self.template: list[tuple[ov.Node, bool]] = []
        self.buffers: list[np.ndarray | None] = []
        self.filled = 0

    def add(self, start: int, weight: ov.Output) -> None:
        constants = _upstream_constants(weight)
        if self.first is None:
            self.first, self.template = weight, constants
            self.buffers = [None if is_shape or not _per_row(c) else self._buffer(k, c)
                            for k, (c, is_shape) in enumerate(constants)]
        elif [c.get_output_element_type(0) for c, _ in constants] != [
                c.get_output_element_type(0) for c, _ in self.template]:
            raise OvshardError(f"{self.name}: rows from {start} were compressed to another format than the first")
        if start != self.filled:
            raise OvshardError(f"{self.name}: chunk starts at row {start}, expected {self.filled}")
        per_row = [(c, b) for (c, _), b in zip(constants, self.buffers, strict=True) if b is not None]
        if not per_row:
            raise OvshardError(f"{self.name}: the compressed weight has no per-row constant to splice")
        for const, buffer in per_row:
            _copy_rows(const, buffer, start)
        self.filled = start + per_row[0][0].get_output_shape(0)[0]

    def _buffer(self, k: int, const: ov.Node) -> np.ndarray:
        shape = [self.rows, *const.get_output_shape(0)[1:]]
        et = const.get_output_element_type(0)
        nbytes = math.ceil(math.prod(shape) * et.bitwidth / 8)
        path = self.scratch / f"{self.name}.{k}.buffer"
        self.scratch.mkdir(parents=True, exist_ok=True)
        _allocate(path, nbytes)  # a full disk is an OSError here, not a SIGBUS when a mapped page is first written
        return np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,))

    def finish(self) -> ov.Output:
        if self.first is None or self.filled != self.rows:
            raise OvshardError(f"{self.name}: {self.filled} of {self.rows} rows were added")
        for (const, is_shape), buffer in zip(self.template, self.buffers, strict=True):
            if buffer is not None:
                const.output(0).replace(_whole(const, buffer, self.rows).output(0))
            elif is_shape:
                shape = const.get_data().copy()
                shape[0] = self.rows
                const.output(0).replace(ops.constant(shape).output(0))
        return self.first


def _allocate(path: Path, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` of disk space reserved (a sparse file where the OS cannot reserve)."""
    with open(path, "wb") as f:
        if hasattr(os, "posix_fallocate") and nbytes > 0:
            try:
                os.posix_fallocate(f.fileno(), 0, nbytes)
            except OSError as e:
                raise OSError(e.errno, e.strerror, str(path)) from e
        else:
            f.truncate(nbytes)


def _per_row(const: ov.Node) -> bool:
    return len(const.get_output_shape(0)) >= 2


def _row_bytes(const: ov.Node) -> float:
    shape = const.get_output_shape(0)
    return math.prod(shape[1:]) * const.get_output_element_type(0).bitwidth / 8


def _copy_rows(const: ov.Node, buffer: np.ndarray, start: int) -> None:
    offset = start * _row_bytes(const)
    if offset != int(offset):
        raise OvshardError("a chunk of packed rows does not start on a byte; use an even number of rows a chunk")
    data = np.frombuffer(const.get_data().tobytes() if const.get_output_element_type(0).bitwidth >= 8
                         else const.data.tobytes(), dtype=np.uint8)
    buffer[int(offset):int(offset) + data.size] = data


def _whole(const: ov.Node, buffer: np.ndarray, rows: int) -> ov.Node:
    et = const.get_output_element_type(0)
    shape = ov.Shape([rows, *const.get_output_shape(0)[1:]])
    return ov.op.Constant(ov.Tensor(buffer, shape, et), shared_memory=True)
