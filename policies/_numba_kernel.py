"""The numba-compiled decision kernel (`specpilot.policies.kernel` imports it when numba is available)."""
import numpy as np
from numba import njit, types


@njit(cache=True, nogil=True)
def activate(y, code):
    if code == 1:
        for i in range(y.shape[0]):
            y[i] = np.tanh(y[i])
    elif code == 2:
        for i in range(y.shape[0]):
            if y[i] < 0.0:
                y[i] = 0.0


@njit(cache=True, nogil=True)
def later_layers(y, weights, layout):
    """The action from the first layer's activated output `y`: the later layers, then the argmax."""
    rest = layout[3]
    for layer in range(rest):
        at = 5 + 4 * layer
        offset, n_in, n_out = layout[at], layout[at + 1], layout[at + 2]
        z = weights[offset + n_in * n_out: offset + (n_in + 1) * n_out].copy()  # the bias row
        for i in range(n_in):
            v = y[i]
            row = offset + i * n_out
            for j in range(n_out):
                z[j] += v * weights[row + j]
        activate(z, layout[at + 3])
        y = z
    if y.shape[0] == 1:  # two actions reduced to l1 - l0
        return 1 if y[0] > 0.0 else 0
    return np.argmax(y)


@njit(cache=True, nogil=True)
def decide(scores, scalars, weights, layout):
    """The action for a state's scores (clipped at the floor, the first num_scores of them) and scalar slots."""
    # layout: [num_scalars, first layer width, its activation, n later layers, num_scores, (offset, in, out,
    # activation) per later layer, then the offset of the first layer folded for k = 0..num_scores real scores];
    # weights[0] is the score floor
    m, h, rest = layout[0], layout[1], layout[3]
    k = min(scores.shape[0], layout[4])
    floor = weights[0]
    base = layout[5 + 4 * rest + k]
    y = weights[base + (k + m) * h: base + (k + m + 1) * h].copy()  # the folded constant row
    for i in range(k):
        s = scores[i]
        if s < floor:  # clip at score_floor (the scale is folded into the rows)
            s = floor
        row = base + i * h
        for j in range(h):
            y[j] += s * weights[row + j]
    for i in range(m):
        s = np.float32(scalars[i])
        row = base + (k + i) * h
        for j in range(h):
            y[j] += s * weights[row + j]
    activate(y, layout[2])
    return later_layers(y, weights, layout)


@njit(cache=True, nogil=True)
def decide_depths(scores, ids, scalars, weights, layout):
    """`decide` for a size policy that also observes each candidate's depth: the first layer is folded for k real
    candidates as rows [k scores, k depths, scalars, constant], and a candidate's depth comes from its node id
    (`ids`, verification order; W at level 1 and W*W at each later level: W is the layout's last entry)."""
    m, h, rest = layout[0], layout[1], layout[3]
    k = min(scores.shape[0], ids.shape[0], layout[4])
    floor = weights[0]
    width = layout[layout.shape[0] - 1]
    base = layout[5 + 4 * rest + k]
    y = weights[base + (2 * k + m) * h: base + (2 * k + m + 1) * h].copy()  # the folded constant row
    for i in range(k):
        s = scores[i]
        if s < floor:
            s = floor
        node = ids[i]
        depth = np.float32(1.0) if node < width else np.float32(2 + (node - width) // (width * width))
        row = base + i * h
        drow = base + (k + i) * h
        for j in range(h):
            y[j] += s * weights[row + j] + depth * weights[drow + j]
    for i in range(m):
        s = np.float32(scalars[i])
        row = base + (2 * k + i) * h
        for j in range(h):
            y[j] += s * weights[row + j]
    activate(y, layout[2])
    return later_layers(y, weights, layout)


def entry_point_depths(num_scalars):
    """`decide_depths`' native entry point (as `entry_point`): float32 scores and int64 node ids of any layout."""
    signature = (types.Array(types.float32, 1, "A"), types.Array(types.int64, 1, "A"),
                 types.UniTuple(types.float64, num_scalars), types.Array(types.float32, 1, "C"),
                 types.Array(types.int64, 1, "C"))
    decide_depths.compile(signature)
    return decide_depths.overloads[signature].entry_point


def entry_point(num_scalars):
    """`decide` compiled for float32 scores of any layout (contiguous or a strided view) and `num_scalars` float
    scalars, as the native entry point that skips numba's per-call type dispatch (typing the arguments and looking
    up the overload: ~5-10 us of a cold decision). It unboxes exactly these types; callers pass nothing else."""
    signature = (types.Array(types.float32, 1, "A"), types.UniTuple(types.float64, num_scalars),
                 types.Array(types.float32, 1, "C"), types.Array(types.int64, 1, "C"))
    decide.compile(signature)
    return decide.overloads[signature].entry_point
