"""The cycle's arithmetic, written once: tree size, size clipping, emitted count, fed tokens, acceptance EMA.

The live decoder (drafting/decoder.py), replay (envs/replay.py), the oracle's vectorised sweeps (envs/oracle.py),
recording (envs/record.py) and the engine exports (policies/engine_configs.py) all count with these functions, so a
replayed cycle is the live one by construction. Each works on Python ints and, elementwise, on numpy integer arrays
(the oracle evaluates every (depth, size) cell at every position at once). Pure: no torch, no models.
"""
from __future__ import annotations

import numpy as np

ACCEPTANCE_RATE = 0.25  # EMA rate of DraftState.acceptance
FED_AT_START = 1  # tokens the first cycle's first draft forward feeds: the prefill leaves out the prompt's last token


def _like(value):
    """A numpy 0-d result as a Python int (scalar callers get ints back), arrays unchanged."""
    return int(value) if np.ndim(value) == 0 else value


def num_candidates(width: int, depth):
    """Candidates of a tree of `depth` draft levels with beam width W: W at level 1, W*W at each later level
    (W + (depth - 1) W^2; 0 for depth 0, a plain step)."""
    return (width + (depth - 1) * width * width) * (depth > 0)


def level_bounds(width: int, depth: int) -> tuple[int, int]:
    """Node-id range [start, end) of level `depth` (1-based; nodes are numbered level by level)."""
    start = num_candidates(width, depth - 1)
    return start, start + (width if depth == 1 else width * width)


def clip_size(size, drafted, max_size: int):
    """The size a cycle verifies: the size asked for, never more than the candidates drafted or max_size (so a
    plain step, with nothing drafted, verifies 0)."""
    return _like(np.minimum(np.minimum(size, drafted), max_size))


def first_end(tokens: list[int], end_ids: tuple[int, ...]) -> int | None:
    """Index of the first token that ends a generation (any of `end_ids`), None when none does."""
    return next((i for i, token in enumerate(tokens) if token in end_ids), None)


def emitted_count(accepted, left):
    """Tokens a cycle appends to the output: the accepted drafts + 1 bonus/correction token, never more than the
    tokens `left` in the generation (up to and including EOS, within max_new_tokens)."""
    return _like(np.minimum(accepted + 1, left))


def next_fed(depth, fed, emitted):
    """Committed tokens the drafter must catch up on in the next cycle's first draft forward: what this cycle
    emitted after a speculative cycle (depth > 0: the drafter saw everything before), those added to the `fed`
    still pending after a plain step (depth 0: the drafter did not run)."""
    return emitted + fed * (depth <= 0)


def update_acceptance(acceptance: float, accepted: int, depth: int) -> float:
    """DraftState.acceptance after a cycle: an EMA (rate ACCEPTANCE_RATE) of accepted / depth over speculative
    cycles; a plain step (depth 0) leaves it unchanged."""
    if depth <= 0:
        return acceptance
    return acceptance + ACCEPTANCE_RATE * (accepted / depth - acceptance)
