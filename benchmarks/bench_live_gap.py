"""Why a live ltd-vs-grid ratio differs from replay's (not a test): the same two methods over whole generations,
interleaved per prompt as the evaluation runs them, with the time split so that each part of the gap shows.

    PYTHONPATH=<tree parent> .venv/bin/python benchmarks/bench_live_gap.py RUN [--rounds 3] [--among-all]
        [--load none|cpu]

RUN: a demo run (its deployed ltd, the grid's live pick, the held-out prompts its verdicts kept). Each prompt runs
every method once per round, in an order drawn per prompt (the first round is a warm-up). Printed, each as ltd vs
grid with a 95% interval over prompts (`eval.stats.cluster_ratio_interval`, each prompt's rounds together):

- wall: the whole call, as the evaluation times it (prefill included);
- without prefill: what replay models (decoding only; decision time included);
- cycles only: draft + verify time of the cycles (`CycleRecord.cycle_s`), neither prefill nor decisions.

--among-all runs the evaluation's other methods in the same rounds (transformers' generate, assisted generation,
the heuristics), as `specpilot eval` does. --load cpu adds a busy process that keeps one core half busy, paused
(SIGSTOP) or running (SIGCONT) per generation: every method runs with and without it, interleaved, and the ratio is
printed for each condition (POSIX only). Compare with `bench_profile_fit.py RUN` (the same pair per cycle, and
replay) to tell the cost model's share of a gap from the prefill's and the load's.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from specpilot.drafting import ModelPair
from specpilot.eval.inputs import resolve_tree
from specpilot.eval.methods import EvalContext, build_methods
from specpilot.eval.stats import cluster_ratio_interval
from specpilot.eval.suites import load_suite

OTHERS = ["hf_generate", "hf_assisted", "ddd", "svip", "confidence", "hf_heuristic"]
HALF_BUSY = ("import time\nwhile True:\n    t = time.perf_counter()\n    while time.perf_counter() - t < 0.005: pass\n"
             "    time.sleep(0.005)\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a demo run directory (e.g. runs/demo)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds after one warm-up round (default 3)")
    p.add_argument("--among-all", action="store_true", help="run the evaluation's other methods in the same rounds")
    p.add_argument("--load", choices=("none", "cpu"), default="none", help="also measure beside a half-busy core")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = ModelPair.from_pretrained(eagle="embedded", dtype="auto")
    ctx = EvalContext(pair=pair, tree=resolve_tree(args.run), grid=args.run / "grid.json", run_dir=args.run)
    methods, _ = build_methods(["ltd", "grid"] + (OTHERS if args.among_all else []), ctx)
    degeneracy = json.loads((args.run / "eval" / "report.json").read_text())["degeneracy"]
    evaluated, flagged = set(degeneracy["prompts"]), set(degeneracy["flagged"])  # the verdicts' prompts
    prompts = [(p.id, pair.encode(p.prompt)) for p in load_suite("heldout_code")
               if p.id in evaluated and p.id not in flagged]
    conditions = [False, True] if args.load == "cpu" else [False]
    hog = subprocess.Popen([sys.executable, "-c", HALF_BUSY]) if args.load == "cpu" else None
    if hog:
        os.kill(hog.pid, signal.SIGSTOP)
    units: dict[tuple[str, bool], list] = {(m, c): [] for m in methods for c in conditions}
    rng = random.Random(0)
    try:
        for r in range(args.rounds + 1):
            for prompt_id, ids in prompts:
                order = list(units)
                rng.shuffle(order)
                for name, loaded in order:
                    if hog:
                        os.kill(hog.pid, signal.SIGCONT if loaded else signal.SIGSTOP)
                    t0 = time.perf_counter()
                    rec = methods[name](list(ids), max_new_tokens=48, temperature=0.0, top_k=0, top_p=1.0, seed=0)
                    wall = time.perf_counter() - t0
                    if hog:
                        os.kill(hog.pid, signal.SIGSTOP)
                    if r:  # round 0 warms up
                        units[(name, loaded)].append((prompt_id, len(rec.tokens), wall, rec.prefill_s,
                                                      rec.draft_s + rec.verify_s))
            print(f"round {r} done", flush=True)
    finally:
        if hog:
            hog.kill()
    print(f"{args.run}: {len(prompts)} kept held-out prompts x {args.rounds} rounds"
          + (", among all methods" if args.among_all else ""))
    for loaded in conditions:
        a, b = units[("ltd", loaded)], units[("grid", loaded)]
        clusters = [u[0] for u in a]
        label = "beside a half-busy core" if loaded else "quiet"
        for part, time_of in (("wall", lambda u: u[2]), ("without prefill", lambda u: u[2] - u[3]),
                              ("cycles only", lambda u: u[4])):
            iv = cluster_ratio_interval([u[1] for u in a], [time_of(u) for u in a], [u[1] for u in b],
                                        [time_of(u) for u in b], clusters)
            print(f"  {label:24s} ltd vs grid, {part:16s} {iv.ratio:.3f}x [{iv.low:.3f}, {iv.high:.3f}]")
    if args.load == "cpu":
        for name in ("ltd", "grid"):
            quiet, loaded = units[(name, False)], units[(name, True)]
            iv = cluster_ratio_interval([u[1] for u in quiet], [u[2] for u in quiet], [u[1] for u in loaded],
                                        [u[2] for u in loaded], [u[0] for u in quiet])
            print(f"  {name}: quiet over beside the load {iv.ratio:.3f}x [{iv.low:.3f}, {iv.high:.3f}]")


if __name__ == "__main__":
    main()
