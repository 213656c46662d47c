"""What a learned policy's decisions cost (not a test): the current deciding path against a baseline revision's,
interleaved in one run, on live generations of held-out code prompts with the same trained policies.

    PYTHONPATH=<tree parent> .venv/bin/python benchmarks/bench_decisions.py RUN_DIR [--baseline HEAD~1]
        [--eagle embedded] [--width 4 --depth 8 --size 32] [--prompts 4] [--rounds 2] [--max-new-tokens 96]

The baseline's policies/actor.py and policies/observation.py are read from git (`git show REV:...`) and drive the
same trained SB3 policies (the baseline timed per part: observation building and actor forward). Each round runs
every prompt once per path (and once with the run's static fallback config: the floor of what run_cycle's timing
charges), untimed, alternating the order; both paths make the same decisions, so they generate the same cycles, and
the policy's share of generation time is CycleRecord.policy_s over draft + verify + policy time. One more pass per
prompt times each decision (the baseline per part: observation building and actor forward). A last part times the
recorded states again, alternating paths per state, with a cache-evicting matrix product before every decision (a
model forward's effect on the caches, without the model).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig
from specpilot.eval.suites import load_suite
from specpilot.policies.learned import STOP
from specpilot.policies.ppo import load_run_controllers

ROOT = Path(__file__).resolve().parent.parent


def baseline_module(rev: str, rel: str, name: str, extra: dict | None = None) -> types.ModuleType:
    """A module executed from the source of `rel` at git revision `rev` (its specpilot imports resolve to this
    tree; `extra` replaces module globals after execution, e.g. the baseline observation module for its actor)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], check=True, capture_output=True,
                            text=True).stdout
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, f"{rev}:{rel}", "exec"), module.__dict__)
    module.__dict__.update(extra or {})
    return module


class Plain:
    """The baseline's deciding path (observation vector, then Actor.act) on the controller's SB3 policies, untimed:
    what the baseline's LearnedController did."""

    def __init__(self, ctl, actor_mod, obs_mod) -> None:
        self.ctl, self.obs = ctl, obs_mod
        self.depth = actor_mod.Actor.from_sb3(ctl.depth_policy)
        self.size = actor_mod.Actor.from_sb3(ctl.size_policy)
        self.name = "baseline"

    def skip_drafting(self, state):
        return self.depth.act(self.obs.depth_observation(state, self.ctl.depth_spec)) == STOP

    should_stop = skip_drafting

    def choose_size(self, state):
        return self.ctl.size_actions[self.size.act(self.obs.size_observation(state, self.ctl.size_spec))]

    def reset(self):
        self.ctl.reset()

    def observe(self, record):
        self.ctl.observe(record)


class Baseline(Plain):
    """The baseline's path with its two parts timed per decision."""

    def __init__(self, ctl, actor_mod, obs_mod) -> None:
        super().__init__(ctl, actor_mod, obs_mod)
        self.times = {"obs": [], "actor": []}

    def _time(self, build, actor, state, spec) -> int:
        t0 = time.perf_counter_ns()
        obs = build(state, spec)
        t1 = time.perf_counter_ns()
        action = actor.act(obs)
        t2 = time.perf_counter_ns()
        self.times["obs"].append(t1 - t0)
        self.times["actor"].append(t2 - t1)
        return action

    def skip_drafting(self, state):
        return self._time(self.obs.depth_observation, self.depth, state, self.ctl.depth_spec) == STOP

    should_stop = skip_drafting

    def choose_size(self, state):
        return self.ctl.size_actions[self._time(self.obs.size_observation, self.size, state, self.ctl.size_spec)]

    def reset(self):
        self.ctl.reset()

    def observe(self, record):
        self.ctl.observe(record)


class Timed:
    """The current controller, its decisions timed whole (the fused path has no separate observation step)."""

    def __init__(self, ctl) -> None:
        self.ctl, self.times, self.name = ctl, {"decision": []}, "current"

    def _time(self, fn, state):
        t0 = time.perf_counter_ns()
        out = fn(state)
        self.times["decision"].append(time.perf_counter_ns() - t0)
        return out

    def skip_drafting(self, state):
        return self._time(self.ctl.skip_drafting, state)

    def should_stop(self, state):
        return self._time(self.ctl.should_stop, state)

    def choose_size(self, state):
        return self._time(self.ctl.choose_size, state)

    def reset(self):
        self.ctl.reset()

    def observe(self, record):
        self.ctl.observe(record)


class Recorder(Timed):
    """Keeps detached copies of the states the current controller was asked about (for the tight-loop part)."""

    def __init__(self, ctl) -> None:
        super().__init__(ctl)
        self.states = []

    def _time(self, fn, state):
        self.states.append((fn.__name__, state.detached() if state.depth else state))
        return super()._time(fn, state)


def us(ns: list[int]) -> str:
    return f"median {statistics.median(ns) / 1e3:6.1f} us, mean {sum(ns) / len(ns) / 1e3:6.1f} us (n={len(ns)})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--baseline", default="HEAD~1", help="git revision whose deciding path is the baseline")
    ap.add_argument("--eagle", default="embedded")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--loop-repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    obs_mod = baseline_module(args.baseline, "policies/observation.py", "_baseline_observation")
    actor_mod = baseline_module(args.baseline, "policies/actor.py", "_baseline_actor")
    ctl = load_run_controllers(args.run_dir)["ltd"]
    pair = ModelPair.from_pretrained(eagle=args.eagle)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=args.width, max_depth=args.depth, max_size=args.size))
    prompts = [p.prompt for p in load_suite("heldout_code")][-args.prompts:]
    # policy shares: the two controllers as eval runs them (no timing wrappers), alternating which goes first
    # ("fixed": the run's static fallback config, the floor of what run_cycle's timing itself charges)
    plain = {"baseline": Plain(ctl, actor_mod, obs_mod), "current": ctl, "fixed": ctl.fallback}
    shares = {name: [] for name in plain}
    cycles = {name: [] for name in plain}
    for c in plain.values():
        decoder.generate(prompts[0], controller=c, max_new_tokens=16)  # warm-up, not counted
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            names = ["baseline", "current", "fixed"] if (r + i) % 2 == 0 else ["fixed", "current", "baseline"]
            for name in names:
                out = decoder.generate(prompt, controller=plain[name], max_new_tokens=args.max_new_tokens)
                policy = sum(c.policy_s for c in out.cycles)
                total = sum(c.draft_s + c.verify_s + c.policy_s for c in out.cycles)
                shares[name].append((policy, total))
                cycles[name].append([(c.depth, c.size, c.accepted) for c in out.cycles])
    # per-decision times: one more pass per prompt with timers around the parts (they add their own overhead)
    paths = [Baseline(ctl, actor_mod, obs_mod), Recorder(ctl)]
    for i, prompt in enumerate(prompts):
        for path in (paths if i % 2 == 0 else paths[::-1]):
            decoder.generate(prompt, controller=path, max_new_tokens=args.max_new_tokens)
    base, cur = paths
    same = cycles["baseline"] == cycles["current"]  # the same decisions, so the same cycles
    print(f"{pair.name} ({pair.drafter_kind}), threads {torch.get_num_threads()}, W{args.width} D{args.depth} "
          f"V{args.size}, {len(prompts)} held-out code prompts x {args.rounds} rounds, {args.max_new_tokens} tokens; "
          f"same cycles on both paths: {same}")
    print("live, per decision (timed pass):")
    print(f"  baseline observation  {us(base.times['obs'])}")
    print(f"  baseline actor        {us(base.times['actor'])}")
    both = [a + b for a, b in zip(base.times["obs"], base.times["actor"])]
    print(f"  baseline decision     {us(both)}")
    print(f"  current decision      {us(cur.times['decision'])}")
    for name, rows in shares.items():
        pol, tot = sum(p for p, _ in rows), sum(t for _, t in rows)
        per = [p / t for p, t in rows]
        print(f"  {name:<9} policy share of generation time (untimed passes) {100 * pol / tot:.2f}% (per generation: min "
              f"{100 * min(per):.2f}%, max {100 * max(per):.2f}%; {tot:.1f} s generating)")
    ratios = [b[0] / c[0] for b, c in zip(shares["baseline"], shares["current"]) if c[0] > 0]
    print(f"  policy time baseline / current per generation: median {statistics.median(ratios):.2f}x "
          f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x, n={len(ratios)})")

    # tight loop over the recorded states, caches evicted before every decision
    a, b = torch.randn(256, 2048), torch.randn(2048, 1024)
    fns = {"baseline": {"should_stop": plain["baseline"].should_stop, "skip_drafting": plain["baseline"].skip_drafting,
                        "choose_size": plain["baseline"].choose_size},
           "current": {"should_stop": ctl.should_stop, "skip_drafting": ctl.skip_drafting,
                       "choose_size": ctl.choose_size}}
    loop = {name: [] for name in fns}
    for r in range(args.loop_repeats):
        for i, (fn_name, state) in enumerate(cur.states):
            for name in (("baseline", "current") if (r + i) % 2 == 0 else ("current", "baseline")):
                a @ b  # evict: ~10 MB of operands through the caches
                t0 = time.perf_counter_ns()
                fns[name][fn_name](state)
                loop[name].append(time.perf_counter_ns() - t0)
    print("tight loop over the recorded states, a 256x2048x1024 matmul before each decision:")
    for name, ns in loop.items():
        print(f"  {name:<9} decision {us(ns)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
