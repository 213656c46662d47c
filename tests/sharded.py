"""Shared by the tests of sharded recordings (on Ray workers, on local processes): the tiny tree and code prompts
they record, and the check that a sharded trace equals a one-process one."""
from __future__ import annotations

import numpy as np

from specpilot.drafting.types import TreeConfig

TREE = TreeConfig(width=2, max_depth=3, max_size=6)
PROMPTS = ["def f(x):\n    return", "def g(y):", "return x + 1", "def add(a, b):", "x = f(1)", "def h():"]


def assert_same_tables(a, b) -> None:
    """Traces a and b hold the same arrays: integers exactly, floats up to rounding (the same kernels on the same
    CPU, at other thread counts)."""
    assert set(a.arrays) == set(b.arrays)
    for key, value in b.arrays.items():
        assert a.arrays[key].dtype == value.dtype, key
        if np.issubdtype(value.dtype, np.integer):
            np.testing.assert_array_equal(a.arrays[key], value, err_msg=key)
        else:
            np.testing.assert_allclose(a.arrays[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
