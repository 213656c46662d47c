"""Where a trained run loses to the hindsight oracle in replay: an exact regret decomposition.

    python -m specpilot.benchmarks.oracle_gap RUN TRACE_DIR [--controller ltd]

By the performance-difference identity, a controller's replay time minus the oracle's equals the sum, over the
questions the controller itself answers (skip / stop after each level / size), of Q*(s, its answer) - V*(s): the
hindsight time its answer loses against the best one, the oracle continuing (`train.rl.gap.decompose`).
Printed: the share of the gap each kind of mistake makes (stopping too early / drafting too deep / size too small /
too large / skipping wrongly), by depth and by the previous cycle's accepted length, and how the oracle itself
decides (how often it drafts exactly the levels that will be accepted: knowledge no causal policy has).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from specpilot.drafting.cycle import run_generation
from specpilot.envs.oracle import replay_oracle
from specpilot.envs.replay import ReplayModel, ReplaySession
from specpilot.policies.ppo import load_run_controllers
from specpilot.train.rl.gap import decompose, specs
from specpilot.train.rl.imitation import LabellingController, OracleLabels


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
          f"{o['best_static']['tokens_per_s']:.1f}, each prompt at its own best static "
          f"{o['per_prompt_static']['tokens_per_s']:.1f}")


if __name__ == "__main__":
    main()
