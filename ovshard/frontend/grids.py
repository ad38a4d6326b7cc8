"""Whether a float checkpoint's decoder matrices already lie on one of llama.cpp's 4-bit grids, in blocks of 32.

A GGUF file dequantized and saved as safetensors (transformers' ``from_pretrained(gguf_file=...)`` then
``save_pretrained``, the usual way to fine-tune or share one) is a float checkpoint whose decoder weights are, block
by block along the inputs, ``m + d k`` (Q4_1: ``k`` in 0..15, the block's minimum at 0 and its maximum at 15) or
``d k`` (Q4_0: ``k`` in -8..7, the block's largest magnitude at one end). A format that holds such blocks as they
are (``compile_config.SOURCE_GROUPS``) keeps all of it; any other rounds every weight a second time.

The test reads the first rows of each decoder matrix: a trained float weight is off every grid at the first matrix,
so a float checkpoint costs one small read. A bfloat16 copy of a grid is kept within a few hundredths of a step (the
rounding of values up to ~10 steps from zero), so the test allows ``TOLERANCE`` of a step; a float weight has about
``2 * TOLERANCE`` of its values that close to any grid by chance, and ``SHARE`` of them are asked for.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ovshard.frontend.tensors import layer_tensors

if TYPE_CHECKING:
    from ovshard.frontend.checkpoint import Checkpoint

log = logging.getLogger(__name__)

BLOCK = 32
ROWS = 8  # rows read from each decoder matrix
TOLERANCE = 0.05  # of a step
SHARE = 0.99  # of the values read within TOLERANCE of the grid


def grids_of(rows: torch.Tensor) -> set[str]:
    """The grids (``"Q4_0"``, ``"Q4_1"``) that ``rows`` [n, in] lie on in blocks of ``BLOCK`` along the inputs."""
    if rows.ndim != 2 or rows.shape[1] % BLOCK or rows.numel() == 0:
        return set()
    blocks = rows.double().reshape(-1, BLOCK)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # the largest magnitude, signed: code -8
    steps = {"Q4_0": blocks / (peak / -8), "Q4_1": (blocks - low) / ((high - low) / 15)}
    found = set()
    for name, k in steps.items():
        off = (k - k.round()).abs().nan_to_num(0.0)  # a constant block (0 / 0) lies on every grid
        if name == "Q4_0":
            off = torch.where(k.round() > 7, 1.0, off)  # codes -8..7: the other sign stops at 7 steps
        if float((off <= TOLERANCE).double().mean()) >= SHARE:
            found.add(name)
    return found


def on_grid(ckpt: Checkpoint) -> str | None:
    """The grid every decoder matrix of float checkpoint ``ckpt`` lies on (Q4_0 where both fit: its signed groups
    are the smaller form), or None: a matrix off both, stacked experts, inputs not a multiple of 32 wide, or no
    matrix read holding two different values (rows of zeros lie on every grid and say nothing)."""
    common, seen = {"Q4_0", "Q4_1"}, False
    for i in range(ckpt.dims.num_layers):
        for name, shape in layer_tensors(ckpt.spec, ckpt.dims, i).items():
            if len(shape) > 2:
                return None  # experts [experts, out, in]: NNCF's groups, not these
            if len(shape) < 2:
                continue
            rows = ckpt.load_rows(name, 0, min(ROWS, shape[0]))
            common &= grids_of(rows)
            seen = seen or bool(rows.amax() > rows.amin())
            if not common:
                return None
    if not seen:
        return None
    found = "Q4_0" if "Q4_0" in common else "Q4_1"
    log.debug("grids: every decoder matrix of %s lies on %s's grid", ckpt.path, found)
    return found
