"""A layer's calibration run ahead, on a thread of its own, while the compile converts, compresses and writes.

A calibrated layer costs two things a data-free one does not: the float32 run of the samples through it, which
catches each matmul's inputs, and the scale fit of each weight to them. Neither needs the layer's OpenVINO graph,
only its float32 weights. So :class:`FitAhead` does both on one thread of its own (whose torch work spreads over
torch's threads), a layer ahead of the compile's thread: once a dense layer is ready it loads the next one's
weights, runs it and fits them, while the compile's thread converts, compresses and writes the layer before. The
piece's trace then takes the weights loaded ahead (:meth:`weights`), so its graph's constants share their memory,
and the compression takes each weight's codes and scales as they were fitted (:meth:`fit_int4`). A layer nobody
prepared (the first, or a mixture-of-experts layer, whose float32 experts are too large to hold two of) is
prepared from the weights its trace lends (``Calibration.lend``) while the trace converts it. Memory: one dense
layer's float32 weights more, held ahead. Where layers are loaded ahead, each weight's fit also starts as soon as
its matmul has run, on a thread of its own with half of torch's threads, beside the rest of the float32 run: the
fit's small ops gain nothing from 8 threads to 16, the run's large matmuls do (16 cores, the 8B shape: a layer
1.41-1.51x a data-free one, against 1.61-1.67x fitting after the run).

Loading ahead pays where cores are spare. On a 16-core Xeon (the 8B shape, 4 and 8 layers, ``--budget 1.0``) a
calibrated layer cost 1.42-1.59x a data-free one with it (median 1.53x), at 1.40-1.48x the peak memory, against
1.69-1.77x (1.09x the memory) with the fits only beside the conversion; on 2 cores it cost more than fitting beside the conversion
alone (the two threads share the cores, and the memory is 1.35x). So a layer is loaded ahead only where torch has
``AHEAD_THREADS`` threads or more (docs/results/2026-12-int4-fit.md).

Which weights to fit is the weight format's choice, known before the graph exists: the decoder weights it keeps
INT4 (not its ``int8_weights``), in the group its ``group_for`` gives their width. A fit is handed over only for
the very weight it was fitted on, the same memory (the traced graph's constant shares the lent tensor's) and the
same group; any other weight the compression asks for is fitted then, as without this class. Each weight is fitted
alone on the same inputs in either case, so the bundle's bytes are the same.

Every other use of the activations (a piece's NNCF dataset, the lm_head's fit, the next lending) first waits for
the thread, which also re-raises what it raised.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ovshard.bundle.stage import StageSpec
from ovshard.errors import PassError
from ovshard.frontend.int4_fit import fit_inputs
from ovshard.frontend.trace import load_layer
from ovshard.ir.pass_manager import Piece

if TYPE_CHECKING:
    from ovshard.bundle.weights import WeightFormat
    from ovshard.frontend.calibration import Activations
    from ovshard.frontend.stage_module import Weights


AHEAD_THREADS = 8  # torch threads from which the next layer is loaded and prepared ahead (measured at 2 and 16)
FIT_SHARE = 2  # the fits beside a layer's float32 run get 1 / FIT_SHARE of torch's threads


class _Fitted(NamedTuple):
    address: int  # where the fitted weight's data starts
    shape: tuple[int, ...]
    group: int
    codes: np.ndarray
    scales: np.ndarray


class FitAhead:
    """:class:`~ovshard.frontend.calibration.Activations`, each layer's calibration done ahead of its compression."""

    def __init__(self, activations: Activations, fmt: WeightFormat) -> None:
        self.activations, self.fmt = activations, fmt
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ovshard-fit-ahead")
        self.pending: Future[None] | None = None
        self.fitted: dict[str, _Fitted] = {}  # "3.down" -> its fit, until the compression takes it
        self.loaded: dict[int, Weights] = {}  # layer -> its float32 weights, loaded ahead for its trace
        self.ready: set[int] = set()  # layers run and fitted
        self.ahead: int | None = None  # the layer the thread's work loads ahead, until it is taken
        self.handed = 0  # fits the compression took (``fit_int4``) rather than fitted itself
        self.load_ahead = torch.get_num_threads() >= AHEAD_THREADS
        self.early = 0  # weights fitted while their layer's float32 run went on
        self.fitter = ThreadPoolExecutor(1, thread_name_prefix="ovshard-fit", initializer=torch.set_num_threads,
                                         initargs=(torch.get_num_threads(),))
        # the fits beside the run on half the threads: the run's matmuls take every core (16 cores, the 8B shape: 16
        # fit threads gained nothing over 8, 4 were slower)
        self.workers = max(1, torch.get_num_threads() // FIT_SHARE)

    def weights(self, layer: int) -> Weights | None:
        """Layer ``layer``'s float32 weights if they were loaded ahead (once the thread is done with them), and the
        next layer's preparation begun; None: the trace loads them itself, and lends them."""
        if layer != self.ahead:
            return None
        self._settle()
        self.ahead = None
        held = self.loaded.pop(layer, None)
        if held is not None:
            self._submit([], layer + 1)
        return held

    def lend(self, first: int, weights: Sequence[Weights]) -> None:
        if all(first + n in self.ready for n in range(len(weights))):  # prepared ahead (or the piece is done)
            return
        self._settle()
        # what was prepared ahead and never taken (a piece the cache held): dropped, not held to the end
        self.loaded.clear()
        self.fitted = {key: fit for key, fit in self.fitted.items() if int(key.split(".")[0]) >= first}
        self._submit(list(weights), first)

    def fit_int4(self, key: str, weight: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
        found = self.fitted.pop(key, None)  # fitted before the piece's trace began, or waited for below
        if found is None and int(key.split(".")[0]) not in self.ready:
            self._settle()
            found = self.fitted.pop(key, None)
        if found is not None and found[:3] == (weight.ctypes.data, weight.shape, group):
            self.handed += 1
            return found.codes, found.scales
        self._settle()  # the activations are the thread's while it works
        return self.activations.fit_int4(key, weight, group)

    def fit_table(self, weight: np.ndarray, group: int, asym: bool = False) -> tuple[np.ndarray, ...]:
        self._settle()
        self.loaded.clear()  # the lm_head comes after every layer: nothing loaded ahead is still to be taken
        return self.activations.fit_table(weight, group, asym)

    def __call__(self, piece: Piece) -> list[dict[str, np.ndarray]] | None:
        self._settle()
        return self.activations(piece)

    def close(self) -> None:
        """The compile is done with it: its thread's work waited for and the thread ended, nothing held."""
        self._settle()
        self.pool.shutdown()
        self.fitter.shutdown()
        self.loaded.clear()
        self.fitted.clear()

    def _submit(self, lent: list[Weights], first: int) -> None:
        """Prepare the ``lent`` layers from ``first`` on the thread, then load and prepare the dense layer after."""
        after, dims = first + len(lent), self.activations.ckpt.dims
        self.ahead = after if self.load_ahead and after < dims.num_layers and not dims.sparse(after) else None
        if lent or self.ahead is not None:
            self.pending = self.pool.submit(self._prepare, lent, first, self.ahead, torch.get_num_threads())

    def _settle(self) -> None:
        """Wait for the thread's work, raising what it raised."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def _prepare(self, lent: list[Weights], first: int, ahead: int | None, threads: int) -> None:
        torch.set_num_threads(threads)  # a new thread's OpenMP count is not the compile thread's
        for layer, held in enumerate(lent, start=first):
            self._fit_layer(layer, held)
        if ahead is not None:
            held = load_layer(self.activations.ckpt, ahead, StageSpec(0, 1, 0, self.activations.ckpt.dims.num_layers))
            self._fit_layer(ahead, held)
            self.loaded[ahead] = held

    def _fit_layer(self, layer: int, held: Weights) -> None:
        """Layer ``layer`` run in float32 on its weights ``held`` (its matmuls' inputs caught), and each of its INT4
        weights fitted: where the layer is loaded ahead, each on :attr:`fitter` as soon as its matmul has run, while
        the run goes on (the run's large matmuls and the fits' many small ops share the cores)."""
        self.activations.lend(layer, [held])
        wanted = {}  # projection -> its weight and group, for those the format keeps INT4 in groups
        for name, tensor in held.named_buffers():
            projection, group = name.removesuffix("_weight"), self.fmt.group_for(tensor.shape[-1])
            if name != projection and tensor.dim() in (2, 3) and group is not None \
                    and f"{layer}.{projection}" not in self.fmt.int8_weights:
                wanted[projection] = tensor, group
        jobs: list[Future[None]] = []
        early: dict[str, tuple[torch.Tensor, int, int]] = {}  # projection -> weight, group, tokens it was fitted on
        moments: dict[tuple[int, int], torch.Tensor] = {}  # the fitter's own, for the inputs it was given

        def each(projection: str, inputs: torch.Tensor) -> None:
            if projection in wanted:
                early[projection] = *wanted.pop(projection), inputs.shape[0]
                jobs.append(self.fitter.submit(self._fit_one, layer, projection, *early[projection][:2], inputs,
                                               moments))
        try:
            self.activations.catch(layer, each if self.load_ahead else None)
        finally:
            for job in jobs:  # every fit begun is waited for, whatever the run raised
                job.exception()
        for job in jobs:
            job.result()
        for projection, (tensor, group, tokens) in early.items():  # a weight its layer read twice: all it read
            if self.activations.caught[projection].shape[0] != tokens:
                wanted[projection] = tensor, group
        self.early += len(early.keys() - wanted.keys())
        for projection, (tensor, group) in wanted.items():  # the rest (samples of several lengths: after the run)
            self._fit_one(layer, projection, tensor, group)
        self.ready.add(layer)

    def _fit_one(self, layer: int, projection: str, tensor: torch.Tensor, group: int,
                 inputs: torch.Tensor | None = None, moments: dict[tuple[int, int], torch.Tensor] | None = None) -> None:
        """One weight fitted to ``inputs`` (None: to those the layer's run caught) and kept for the compression."""
        key, data = f"{layer}.{projection}", tensor.numpy()
        try:
            if inputs is None or moments is None:
                codes, scales = self.activations.fit_int4(key, data, group)
            else:
                codes, scales = fit_inputs(inputs, data, group, moments, self.workers)
        except PassError:  # no matmul read it: never asked for, or the compression says so itself
            return
        self.fitted[key] = _Fitted(data.ctypes.data, data.shape, group, codes, scales)
