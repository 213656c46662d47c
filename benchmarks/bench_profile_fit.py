"""Does the latency profile price configs as they run live? (not a test) Replay, the grid search, behaviour cloning
and PPO all rank decisions by the profile's prices; a profile whose relative prices are off by a few percent trains
a policy towards configs that are not faster live, and the grid's live check does not correct it for the policy.

    PYTHONPATH=<tree parent> .venv/bin/python benchmarks/bench_profile_fit.py RUN_DIR [--profile P ...]
        [--configs 3x7,4x15,3x3] [--eagle embedded] [--dtype auto] [--prompts 30] [--rounds 2]

RUN_DIR: a demo run (its deployed ltd, the grid's live-picked config, its held-out greedy trace and eval report).
Live: ltd, the grid's config and each --configs DxV decode the run's held-out prompts in lockstep (one cycle each per
turn, the order drawn every turn: `bench_lockstep.lockstep`'s protocol; the first round a warm-up), each cycle's
draft and verify time taken from the decoder's own CycleRecord. Replay: the same controllers over the same prompts of
the held-out trace under each --profile (default: the run's re-measured held-out profile). Prints per method the
live tokens/s over the grid's beside each profile's replayed ratio, and per (depth, size) the live draft and verify
time over each profile's price (one level per profile cancels: it is the load; what matters is that the ratios
between configs agree). Greedy outputs are checked identical to the trace's (fp32).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder
from specpilot.drafting.cycle import run_cycle
from specpilot.envs.oracle import replay_controller
from specpilot.envs.profile import LatencyProfile
from specpilot.envs.replay import load_trace
from specpilot.eval.inputs import read_grid_best, resolve_tree
from specpilot.policies import FixedController
from specpilot.policies.ppo import load_run_controllers


def price(profile: LatencyProfile, draft_table: np.ndarray, max_size: int, record) -> tuple[float, float]:
    """The profile's (draft, verify) seconds for one live CycleRecord, as replay prices it (`draft_table`: the
    profile's `draft_table()`, built once)."""
    draft = float(draft_table[min(record.fed, draft_table.shape[0] - 1), record.depth]) if record.depth else 0.0
    verify = float(profile.verify_table(max_size, np.array([record.context_len]))[0, record.size])
    return draft, verify


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--profile", action="append", default=[], help="a profile.json to price with (repeatable)")
    ap.add_argument("--configs", default="3x7,4x15,3x3", help="static configs DxV beside ltd and the grid")
    ap.add_argument("--eagle", default="embedded")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    run = Path(args.run_dir)
    trace = load_trace(run / "traces" / "heldout")
    profiles = {p: LatencyProfile.load(p) for p in (args.profile or [str(run / "traces" / "heldout" / "profile.json")])}
    pair = ModelPair.from_pretrained(eagle=args.eagle, dtype=args.dtype)
    tree = resolve_tree(run)
    decoder = SpeculativeDecoder(pair, tree)
    best = read_grid_best(run / "grid.json")
    controllers = {"ltd": load_run_controllers(run)["ltd"], "grid": FixedController(best["depth"], best["size"])}
    for spec in filter(None, args.configs.split(",")):
        depth, size = (int(v) for v in spec.lower().split("x"))
        controllers[f"d{depth} V{size}"] = FixedController(depth, size)
    degeneracy = json.loads((run / "eval" / "report.json").read_text()).get("degeneracy") or {}
    flagged = set(degeneracy.get("flagged", []))
    from specpilot.eval.suites import load_suite

    kept = {tuple(pair.encode(p.prompt)) for p in load_suite("heldout_code") if p.id not in flagged}
    indices = [i for i in range(trace.num_prompts) if tuple(trace.prompt(i)) in kept][:args.prompts]  # as the verdicts
    draft_tables = [profile.draft_table() for profile in profiles.values()]
    rng = np.random.default_rng(args.seed)
    seen: dict = defaultdict(int)  # cycles per (depth, size), all methods
    live = {m: defaultdict(float) for m in controllers}
    cells = {m: defaultdict(lambda: np.zeros(2 + 2 * len(profiles))) for m in controllers}  # live, priced per profile
    for r in range(args.rounds + 1):
        for i in indices:
            ids = trace.prompt(i)
            sessions = {m: decoder.start(ids, max_new_tokens=trace.max_new_tokens) for m in controllers}
            for c in controllers.values():
                c.reset()
            while any(not s.done for s in sessions.values()):
                for m in rng.permutation(list(controllers)):
                    if sessions[m].done:
                        continue
                    t0 = time.perf_counter()
                    record = run_cycle(sessions[m], controllers[m])
                    wall = time.perf_counter() - t0
                    if r == 0:
                        continue
                    live[m]["wall"] += wall
                    live[m]["tokens"] += record.emitted
                    cell = cells[m][(record.depth, record.size)]
                    seen[(record.depth, record.size)] += 1
                    cell[0] += record.draft_s
                    cell[1] += record.verify_s
                    for k, profile in enumerate(profiles.values()):
                        cell[2 + 2 * k: 4 + 2 * k] += price(profile, draft_tables[k], tree.max_size, record)
            if r == 0 and pair.dtype == torch.float32:
                for m, s in sessions.items():
                    out = list(s.output().tokens)  # the trace records a few tokens past the budget (lookahead)
                    if out != trace.continuation(i).tolist()[:len(out)]:
                        raise SystemExit(f"{m}: greedy output differs from the trace's on prompt {i}")
        print(f"round {r} done", flush=True)
    live_tps = {m: v["tokens"] / v["wall"] for m, v in live.items()}
    replayed = {p: {m: replay_controller(trace, prof, c, prompts=indices)["tokens_per_s"]
                    for m, c in controllers.items()} for p, prof in profiles.items()}
    print(f"{pair.name}, {str(pair.dtype).replace('torch.', '')}, {args.threads} threads, tree {tree}, "
          f"{len(indices)} held-out prompts x {args.rounds} rounds, lockstep; profiles: "
          + ", ".join(f"[{k}] {p} ({sum(prof.verify_size.get('count', []))} drafting cycles, "
                      f"{sum(prof.plain.get('count', []))} plain steps, "
                      f"measured in {prof.meta.get('measured_s', 0):.0f} s)"
                      for k, (p, prof) in enumerate(profiles.items())))
    print("method          live tok/s  live/grid  " + "  ".join(f"replay/grid [{k}]" for k in range(len(profiles))))
    for m in controllers:
        print(f"  {m:14s} {live_tps[m]:9.1f}  {live_tps[m] / live_tps['grid']:9.3f}  "
              + "  ".join(f"{replayed[p][m] / replayed[p]['grid']:15.3f}" for p in profiles))
    print("per (depth, size), the 14 with the most live time: live / priced draft and verify time per profile")
    merged: dict = defaultdict(lambda: np.zeros(2 + 2 * len(profiles)))
    for m in controllers:
        for key, cell in cells[m].items():
            merged[key] += cell
    for key, cell in sorted(merged.items(), key=lambda kv: -kv[1][:2].sum())[:14]:
        ratios = "  ".join(f"[{k}] draft {cell[0] / cell[2 + 2 * k]:.3f} verify {cell[1] / cell[3 + 2 * k]:.3f}"
                           if cell[2 + 2 * k] else f"[{k}] verify {cell[1] / cell[3 + 2 * k]:.3f}"
                           for k in range(len(profiles)))
        print(f"  d{key[0]} V{key[1]:<3d} {seen[key]:5d} cycles  {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
