"""Learned policy vs the grid's static config in lockstep (not a test): both decode the same prompt at once, one cycle
each in turn (the order drawn at random every turn), so load drift on a shared machine hits both within
milliseconds instead of within seconds, as the evaluation's per-prompt interleaving does.

    PYTHONPATH=<tree parent> .venv/bin/python benchmarks/bench_lockstep.py RUN_DIR [--eagle embedded]
        [--dtype auto] [--prompts 30] [--rounds 3] [--max-new-tokens 48] [--suite heldout_code]

RUN_DIR: a demo run (its policies.json and grid.json: the deployed ltd and its tree, the grid's live-picked static
config). The prompts are those its evaluation measured (eval/report.json), less those it flagged degenerate,
as in its verdicts; without a report, the first --prompts of --suite. Each method's time is the sum of its own cycles'
wall time, from its first question to its `observe` (`run_cycle`, decisions included), on the perf_counter clock with
the device synchronised by the decoder's steps; prefill is left out (both prefill the same prompt). Prints each
method's decode throughput, the pooled ratio ltd / grid with a 95% cluster-bootstrap interval over prompts (each
prompt's rounds together, as the evaluation's verdicts) and its verdict, and the per-cycle decision time. The first
round is a warm-up and is not counted. Greedy outputs are checked equal to each other in fp32 (both are the target's
greedy output); in half precision the prompts where they differ are counted (near-tie argmaxes round differently in
different shapes).

Caveat: two sessions alternate, so each cycle starts after the other method's cycle, never after its own; both
pay that alike, but absolute throughput can differ from a method decoding alone.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder
from specpilot.drafting.cycle import run_cycle
from specpilot.eval.inputs import read_grid_best, resolve_tree
from specpilot.eval.stats import cluster_ratio_interval, verdict
from specpilot.eval.suites import load_suite
from specpilot.policies import FixedController
from specpilot.policies.ppo import load_run_controllers


def _grid_controller(run_dir: Path) -> tuple[FixedController, str]:
    best = read_grid_best(run_dir / "grid.json")
    return FixedController(best["depth"], best["size"]), f"d{best['depth']} V{best['size']}"


def lockstep(decoder: SpeculativeDecoder, ids: list[int], controllers: dict, *, max_new_tokens: int,
             rng: np.random.Generator) -> dict:
    """Decode `ids` with every controller at once, one cycle each per turn in a random order; per method its
    tokens, summed cycle wall time, decision time and cycles."""
    sessions = {name: decoder.start(ids, max_new_tokens=max_new_tokens) for name in controllers}
    for controller in controllers.values():
        controller.reset()
    out = {name: {"time_s": 0.0, "policy_s": 0.0, "cycles": 0} for name in controllers}
    names = list(controllers)
    while any(not s.done for s in sessions.values()):
        for name in rng.permutation(names):
            session = sessions[name]
            if session.done:
                continue
            t0 = time.perf_counter()
            record = run_cycle(session, controllers[name])
            out[name]["time_s"] += time.perf_counter() - t0
            out[name]["policy_s"] += record.policy_s
            out[name]["cycles"] += 1
    for name, session in sessions.items():
        out[name]["tokens"] = list(session.output().tokens)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--eagle", default="embedded")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--suite", default="heldout_code")
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir)
    pair = ModelPair.from_pretrained(eagle=args.eagle, dtype=args.dtype)
    decoder = SpeculativeDecoder(pair, resolve_tree(run_dir))  # the run's tree, as its evaluation
    grid, grid_name = _grid_controller(run_dir)
    controllers = {"ltd": load_run_controllers(run_dir)["ltd"], "grid": grid}
    prompts = load_suite(args.suite)
    report = run_dir / "eval" / "report.json"
    measured = (json.loads(report.read_text()).get("degeneracy") or {}) if report.is_file() else {}
    if measured.get("prompts"):  # the run's own held-out prompts, less those flagged degenerate (as its verdicts)
        prompts = [p for p in prompts if p.id in measured["prompts"] and p.id not in measured.get("flagged", [])]
    prompts = prompts[:args.prompts]
    rng = np.random.default_rng(args.seed)
    rows = []  # (prompt id, {method: result})
    differ: set[str] = set()  # prompts whose outputs differ (half precision: README, "near-tie guard")
    for r in range(args.rounds + 1):
        for p in prompts:
            got = lockstep(decoder, pair.encode(p.prompt), controllers, max_new_tokens=args.max_new_tokens, rng=rng)
            if got["ltd"]["tokens"] != got["grid"]["tokens"]:
                if pair.dtype == torch.float32:  # exact in fp32; half precision may flip near-tie argmaxes
                    raise SystemExit(f"prompt {p.id}: greedy outputs differ between ltd and grid in fp32")
                differ.add(p.id)
            if r > 0:  # round 0 is the warm-up
                rows.append((p.id, got))
        print(f"round {r} done", flush=True)
    tokens = {m: np.array([len(g[m]["tokens"]) for _, g in rows], float) for m in controllers}
    times = {m: np.array([g[m]["time_s"] for _, g in rows]) for m in controllers}
    interval = cluster_ratio_interval(tokens["ltd"], times["ltd"], tokens["grid"], times["grid"],
                                      [pid for pid, _ in rows])
    print(f"{pair.name} ({pair.drafter_kind}, {str(pair.dtype).replace('torch.', '')}), {args.threads} threads, "
          f"tree {decoder.tree}, {len(prompts)} {args.suite} prompts x {args.rounds} rounds, {args.max_new_tokens} "
          f"new tokens, greedy; lockstep, one cycle each per turn")
    for m in controllers:
        policy = sum(g[m]["policy_s"] for _, g in rows)
        cycles = sum(g[m]["cycles"] for _, g in rows)
        label = f"grid ({grid_name})" if m == "grid" else m
        print(f"  {label:14s} {tokens[m].sum() / times[m].sum():7.1f} tok/s, tau {tokens[m].sum() / cycles:.2f}, "
              f"decisions {1e6 * policy / cycles:.0f} us per cycle ({100 * policy / times[m].sum():.2f}%)")
    print(f"  ltd vs grid: {interval.ratio:.3f}x [{interval.low:.3f}, {interval.high:.3f}], {verdict(interval)}, "
          f"{interval.n_units} prompts")
    if differ:
        print(f"  outputs differ between the two on {len(differ)} of {len(prompts)} prompts "
              f"({str(pair.dtype).replace('torch.', '')}: near-tie argmaxes round differently in different shapes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
