"""A paged stage's one-row step (one sequence, one new token: a decode step) compiled again with static shapes.

Why: the CPU plugin runs a graph with any dynamic input on its dynamic path, which before every inference
infers each node's shapes and prepares its parameters (on two TBB tasks, with a wait at each node whose shapes
depend on data), even when no shape changed since the last one; a graph whose every input shape is static runs
its nodes and nothing else. A decode step of one sequence has the same shapes step after step once the block
table is padded to the pool's size, so it gets a copy of the paged model reshaped to them:

    input_ids [1] | inputs_embeds [1, H]    position_ids [1]    past_lens [1]    subsequence_begins [2]
    block_indices [num_blocks]              block_indices_begins [2]             max_context_len []
    sampled_tokens_indices [1] (a sliced last stage)

The table's first ``ceil((p + 1) / block_size)`` entries are the sequence's blocks and ``block_indices_begins``
is [0, that count]: the kernel reads only those, the rest of the array is padding it never reads. The copy
binds the paged stage's own cache tensors, so both compiled models read and write the same KV blocks, and its
input arrays are bound once and written in place each step. The cost: a second compile at load and the plugin's
own copy of the weights it packs, about the stage's weight file again (docs/results/2026-12-one-node.md), so the
copy is made only where it pays (``why_no_copy``): the saving is about fixed a step (the dynamic path's work
per node, 2-3 ms for a small model's ~470 nodes on 2 cores), so it counts for a short step and not for a long
one, a stage of at most ``COPY_MAX_BYTES`` of weights (a step there reads them in ~40 ms at 25 GB/s: the 1B shape
gained 6-16%, SmolLM2 17-25%); and only where the memory available holds twice the weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import openvino as ov

from ovshard import memory
from ovshard.bundle import names
from ovshard.errors import PagedUnsupportedError

__all__ = ["DecodeStep", "WIDEN_POSITIONS", "why_no_copy", "static_decode_model"]

log = logging.getLogger(__name__)

CACHE_PREFIXES = ("key_cache.", "value_cache.")
COPY_MAX_BYTES = 1 << 30  # above this a step is long enough that its fixed saving no longer pays for the weights twice
# positions DecodeStep.widen tells the plugin of at load: short chats never pay its score kernels' remaking, while
# the scratch rows sized for them (threads x heads x 32 x this x 4 bytes a layer, written only as far as a step
# reaches) stay small
WIDEN_POSITIONS = 1024


def _shapes(primary: str, hidden: int | None, num_blocks: int) -> dict[str, tuple[list[int], type]]:
    """Each non-cache input of a one-row step: its static shape and numpy type."""
    return {primary: ([1] if hidden is None else [1, hidden], np.int64 if hidden is None else np.float32),
            names.POSITION_IDS: ([1], np.int64), names.PAST_LENS: ([1], np.int32),
            names.SUBSEQUENCE_BEGINS: ([2], np.int32), names.BLOCK_INDICES: ([num_blocks], np.int32),
            names.BLOCK_INDICES_BEGINS: ([2], np.int32), names.MAX_CONTEXT_LEN: ([], np.int32),
            names.SAMPLED_ROWS: ([1], np.int64)}


def why_no_copy(weight_bytes: int) -> str | None:
    """Why a stage with ``weight_bytes`` of weights gets no static copy, or None where it gets one: it must be small
    enough that the copy's fixed saving a step counts (``COPY_MAX_BYTES``), and the memory available now must hold
    the copy with as much again to spare (unknown: assumed so)."""
    if weight_bytes > COPY_MAX_BYTES:
        return f"its {weight_bytes // 10**6} MB of weights make a step long enough that a copy would not pay"
    available = memory.available_bytes()
    if available is not None and available < 2 * weight_bytes:
        return f"too little memory available for a static copy of {weight_bytes // 10**6} MB of weights"
    return None


def static_decode_model(model: ov.Model, primary: str, hidden: int | None, num_blocks: int) -> ov.Model:
    """A copy of paged ``model`` with every non-cache input static at a one-row step's shape (the module's
    docstring; ``hidden``: a later stage's row width, None on stage 0). The caches keep the shapes the plugin
    gives them. PagedUnsupportedError on an input a one-row step does not know."""
    shapes = _shapes(primary, hidden, num_blocks)
    found = {port.get_any_name(): port for port in model.inputs}
    unknown = sorted(n for n in found if n not in shapes and not n.startswith(CACHE_PREFIXES))
    if unknown:
        raise PagedUnsupportedError(f"the paged model has inputs {unknown} that a one-row static step does not "
                                    f"fill (expected {sorted(shapes)} and the caches); its decode runs dynamic")
    static = model.clone()
    static.reshape({port: ov.PartialShape(shapes[port.get_any_name()][0]) for port in static.inputs
                    if port.get_any_name() in shapes})
    return static


class DecodeStep:
    """The static copy's request: the paged stage's ``caches`` bound, its input arrays bound once and written
    in place. ``steps`` counts the steps it ran (a paged stage takes this path for one sequence and one row);
    ``inferences`` those and ``widen``'s."""

    def __init__(self, compiled: ov.CompiledModel, primary: str, hidden: int | None, num_blocks: int,
                 caches: Mapping[str, ov.Tensor]) -> None:
        self.compiled, self.request = compiled, compiled.create_infer_request()
        self.primary, self.num_blocks, self.steps, self.inferences = primary, num_blocks, 0, 0
        for name, tensor in caches.items():
            self.request.set_tensor(name, tensor)
        inputs = {port.get_any_name() for port in compiled.inputs}
        self.arrays: dict[str, np.ndarray] = {name: np.zeros(shape, kind) for name, (shape, kind)
                                              in _shapes(primary, hidden, num_blocks).items() if name in inputs}
        for name, array in self.arrays.items():
            self.request.set_tensor(name, ov.Tensor(array, shared_memory=True))
        self.arrays[names.SUBSEQUENCE_BEGINS][:] = (0, 1)
        self.arrays[names.BLOCK_INDICES_BEGINS][0] = 0

    def widen(self, positions: int) -> None:
        """One step at position 0 of block 0 that tells the plugin's attention the context reaches ``positions``:
        it sizes its score rows for the longest context it has been told of and, each time that grows past another
        block, makes its score kernels again (an extra 4-7 ms a step at each 32nd position on SmolLM2's 30 layers,
        ~0.2 ms a step over a long answer; docs/results/2026-12-one-node.md). Told once here, later steps within
        ``positions`` run as fast; each step still passes its own length, so none loops over the rest. Writes
        position 0 of block 0 (PagedStage.warm's garbage, which every sequence overwrites before reading)."""
        self._infer(0, 0, [0], positions)

    def run(self, x: np.ndarray, position: int, table: Sequence[int]) -> np.ndarray:
        """One row ``x`` (ids [1] or rows [1, H]) at ``position`` with the sequence's ``table`` (the blocks
        covering [0, position + 1), already checked); returns its output row [1, H|V]."""
        self._infer(x, position, table, position + 1)
        self.steps += 1
        out = self.request.get_output_tensor(0).data
        return out.reshape(1, -1).copy()  # [1, 1, H|V] -> [1, H|V]

    def _infer(self, x: np.ndarray | int, position: int, table: Sequence[int], reach: int) -> None:
        """One inference of row ``x`` at ``position`` over ``table``, the plugin told the context reaches ``reach``."""
        arrays = self.arrays
        arrays[self.primary][:] = x
        arrays[names.POSITION_IDS][0] = arrays[names.PAST_LENS][0] = position
        arrays[names.MAX_CONTEXT_LEN][()] = reach
        count = len(table)
        arrays[names.BLOCK_INDICES][:count] = table
        arrays[names.BLOCK_INDICES_BEGINS][1] = count
        self.request.infer()
        self.inferences += 1
