"""Where a controller loses to the hindsight oracle in replay: an exact regret decomposition.

By the performance-difference identity, a controller's replay time minus the oracle's equals the sum, over the
questions the controller itself answers (skip / stop after each level / size), of Q*(s, its answer) - V*(s): the
hindsight time its answer loses against the best one, the oracle continuing (`OracleLabels`). `decompose` splits that
gap by kind of mistake (stopping too early / drafting too deep / size too small / too large / skipping wrongly), by
depth and by the previous cycle's accepted length. `benchmarks/oracle_gap.py` prints it for a trained run.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from specpilot.drafting.control import Controller
from specpilot.drafting.cycle import run_generation
from specpilot.envs.replay import ReplayModel, ReplaySession
from specpilot.policies.learned import STOP
from specpilot.policies.observation import ObservationSpec
from specpilot.train.rl.imitation import LabellingController, OracleLabels


class _Recording(Controller):
    """`inner` deciding, each question's (depth, previous accepted) recorded (the labeller asks once per question)."""

    def __init__(self, inner: Controller) -> None:
        self.inner, self.states = inner, {"depth": [], "size": []}

    def _note(self, kind: str, state) -> None:
        self.states[kind].append((state.depth, state.prev_accepted))

    def skip_drafting(self, state) -> bool:
        self._note("depth", state)
        return self.inner.skip_drafting(state)

    def should_stop(self, state) -> bool:
        self._note("depth", state)
        return self.inner.should_stop(state)

    def choose_size(self, state) -> int:
        self._note("size", state)
        return self.inner.choose_size(state)

    def reset(self) -> None:
        self.inner.reset()

    def observe(self, record) -> None:
        self.inner.observe(record)


def specs(model: ReplayModel, size_actions: list[int]) -> tuple[ObservationSpec, ObservationSpec]:
    tr = model.trace
    return (ObservationSpec.for_depth(tr.width, tr.max_depth),
            ObservationSpec.for_size(tr.width, tr.max_depth, size_actions=size_actions))


def decompose(model: ReplayModel, controller: Controller, size_actions: list[int]) -> dict:
    """{"gap_s", "parts": {kind: seconds}, "by_depth": {...}, "by_prev_accepted": {...}, "records"} of `controller`
    against the hindsight oracle over `size_actions` on `model`'s trace."""
    labels = OracleLabels(model, size_actions)
    rec = _Recording(controller)
    lab = LabellingController(labels, *specs(model, size_actions), size_actions, rec)
    states = rec.states
    records, time_s = [], 0.0
    for i in range(model.num_prompts):
        lab.session = ReplaySession(model, i)
        recs = run_generation(lab.session, lab)
        records += recs
        time_s += sum(r.draft_s + r.verify_s for r in recs)
    oracle_s = sum(labels.tables(i).cost[0, 1] for i in range(model.num_prompts))
    parts, by_depth, by_prev = defaultdict(float), defaultdict(float), defaultdict(float)
    for kind, data in (("depth", lab.depth_data), ("size", lab.size_data)):
        for (d, prev), regret, action in zip(states[kind], data.regret, data.actions):
            lost = float(np.nan_to_num(regret[action]))
            if lost <= 0:
                continue
            if kind == "depth":
                name = ("skip" if d == 0 else "stop_too_early") if action == STOP else \
                    ("draft_not_skip" if d == 0 else "too_deep")
            else:
                name = "size_too_small" if action < int(np.nanargmin(regret)) else "size_too_large"
            parts[name] += lost
            by_depth[f"{name}@d{d}"] += lost
            by_prev[f"{kind}@prev{min(prev, 4)}"] += lost
    return {"time_s": time_s, "oracle_s": float(oracle_s), "gap_s": time_s - float(oracle_s), "parts": dict(parts),
            "by_depth": dict(by_depth), "by_prev_accepted": dict(by_prev), "records": records}
