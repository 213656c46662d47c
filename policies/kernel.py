"""One compiled call per decision: a numba kernel that runs a whole actor (folded first layer, hidden layers,
argmax) on a draft state's scores and scalars, so a decision touches one native function instead of a dozen numpy
ufuncs and products.

Why: a decision runs right after a model forward has evicted the CPU caches, and there its cost is set by how much
distinct code and data it touches, not by its arithmetic (a [64, 64] actor is ~9k multiply-adds: ~2 us warm).
Measured on the embedded pair in bf16 (2-core Xeon with AMX, interleaved per cycle, medians over ~170-640 questions
each): the numpy path (`Actor._forward`) 73 / 78 / 44 us for skip / stop / size, this kernel 52 / 49 / 30 us
(README, "Decision latency").

The weights are packed once per (actor, observation spec) into one float32 array and an int64 layout (`pack`): numba
unboxes two plain arrays much faster than a tuple of matrices. Actors call the compiled function's native entry
point (`compiled`), not numba's dispatcher: the dispatcher types every argument and looks the overload up on each
call, ~5 us more per cold decision (measured interleaved with a demo's policies: 330 -> 312 and 304 -> 283 us of
decisions per cycle, `benchmarks/bench_kernel.py`'s loop with the dispatcher as the other path). Without numba (not
installed, or it fails to import or compile) `KERNEL` is None and actors decide with numpy: the same arithmetic in
float32, so both paths agree up to float round-off (tests compare them on random actors and states).
"""
from __future__ import annotations

import warnings

import numpy as np

ACTIVATION_CODES = {"identity": 0, "tanh": 1, "relu": 2}  # the activations the kernel runs (others: numpy path)


def _build():
    """The kernel module, or None (numba missing or broken: decisions stay on numpy)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from specpilot.policies import _numba_kernel
        return _numba_kernel
    except Exception:  # noqa: BLE001 - any failure to import or set up numba only means the numpy path is used
        return None


KERNEL = _build()


def compiled(num_scalars: int, depths: bool = False):
    """`KERNEL.decide` for `num_scalars` scalar slots as a native entry point: (scores, scalars, weights, layout)
    -> action, scores a float32 1-D array (any stride), scalars a tuple of `num_scalars` floats, (weights, layout)
    from `pack`. depths: `KERNEL.decide_depths` instead, (scores, ids, scalars, weights, layout) with the candidates'
    int64 node ids (a size policy observing their depths; `pack(..., width=W)`). None without numba, or when
    compiling fails (the numpy path decides)."""
    if KERNEL is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return (KERNEL.entry_point_depths if depths else KERNEL.entry_point)(num_scalars)
    except Exception:  # noqa: BLE001 - the numpy path decides instead
        return None


def pack(folded_first: list[np.ndarray], later: list[np.ndarray], codes: list[int], num_scalars: int,
         score_floor: float, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(weights, layout) for `KERNEL`: folded_first[k] is the first layer folded for k real scores
    ((k + num_scalars + 1, width): `observation.fold_first_layer`, k = 0..num_scores), later the [W.T; bias] matrices
    of the other layers (`Actor._numpy_plan`), codes the activation after each layer (ACTIVATION_CODES). Everything
    the kernel needs travels in these two arrays (each further argument costs a cold decision microseconds); width:
    the tree's W, last in the layout, for `decide_depths`."""
    parts, layout_rest, offset = [np.array([score_floor], np.float32)], [], 1  # weights[0]: the score floor
    for matrix, code in zip(later, codes[1:]):
        layout_rest += [offset, matrix.shape[0] - 1, matrix.shape[1], code]
        parts.append(matrix.ravel())
        offset += matrix.size
    first_offsets = []
    for matrix in folded_first:
        first_offsets.append(offset)
        parts.append(matrix.ravel())
        offset += matrix.size
    layout = [num_scalars, folded_first[0].shape[1], codes[0], len(later), len(folded_first) - 1, *layout_rest,
              *first_offsets, *([] if width is None else [width])]  # width: decide_depths' id -> depth
    return (np.ascontiguousarray(np.concatenate(parts), dtype=np.float32),
            np.ascontiguousarray(layout, dtype=np.int64))
