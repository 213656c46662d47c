"""Where a trained run loses to the hindsight oracle in replay: an exact regret decomposition.

    python -m specpilot.benchmarks.oracle_gap RUN TRACE_DIR [--controller ltd]

By the performance-difference identity, a controller's replay time minus the oracle's equals the sum, over the
questions the controller itself answers (skip / stop after each level / size), of Q*(s, its answer) - V*(s): the
hindsight time its answer loses against the best one, the oracle continuing (`train.rl.imitation.OracleLabels`).
Printed: the share of the gap each kind of mistake makes (stopping too early / drafting too deep / size too small /
too large / skipping wrongly), by depth and by the previous cycle's accepted length, and how the oracle itself
decides (how often it drafts exactly the levels that will be accepted: knowledge no causal policy has).
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np

from specpilot.drafting.control import Controller
from specpilot.drafting.cycle import run_generation
from specpilot.envs.oracle import replay_oracle
from specpilot.envs.replay import ReplayModel, ReplaySession
from specpilot.policies.learned import STOP
from specpilot.policies.observation import ObservationSpec
from specpilot.policies.ppo import load_run_controllers
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


def _shape(records) -> str:
    d = np.array([r.depth for r in records])
    a = np.array([r.accepted for r in records])
    s = d > 0
    return (f"{len(records)} cycles, skip {np.mean(~s):.0%}, mean depth {d[s].mean():.2f}, accepted {a[s].mean():.2f}, "
            f"every drafted level accepted in {np.mean(a[s] == d[s]):.0%} of the cycles")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="run directory with policies.json")
    p.add_argument("trace", type=Path, help="trace directory (trace.npz + profile.json), e.g. RUN/traces/heldout")
    p.add_argument("--controller", default="ltd", choices=("ltd", "depth_only", "size_only"))
    args = p.parse_args(argv)
    model = ReplayModel(args.trace)
    ctrl = load_run_controllers(args.run)[args.controller]
    actions = list(getattr(ctrl, "size_actions", None) or [2, 4, 6, 8, 12, 16, 24, 32])
    out = decompose(model, ctrl, actions)
    gap = out["gap_s"]
    print(f"{args.controller}: {out['time_s']:.3f} s, oracle {out['oracle_s']:.3f} s, gap {gap:.3f} s; "
          f"decomposed {sum(out['parts'].values()):.3f} s")
    for k, v in sorted(out["parts"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:16s} {v:7.3f} s  {v / gap:5.1%}")
    print("  by depth (>= 3% of the gap):",
          ", ".join(f"{k} {v / gap:.0%}" for k, v in sorted(out["by_depth"].items()) if v / gap >= 0.03))
    print("  by previous accepted:", ", ".join(f"{k} {v / gap:.0%}" for k, v in sorted(out["by_prev_accepted"].items())))
    print(f"  {args.controller}: {_shape(out['records'])}")
    labels = LabellingController(OracleLabels(model, actions), *specs(model, actions), actions, None)
    records = []
    for i in range(model.num_prompts):
        labels.session = ReplaySession(model, i)
        records += run_generation(labels.session, labels)
    print(f"  oracle: {_shape(records)}")
    o = replay_oracle(model, sizes=actions)
    print(f"  oracle {o['oracle']['tokens_per_s']:.1f} tok/s, greedy oracle {o['greedy_oracle']['tokens_per_s']:.1f}, "
          f"best static d={o['best_static']['depth']} V={o['best_static']['size']} "
          f"{o['best_static']['tokens_per_s']:.1f}")


if __name__ == "__main__":
    main()
