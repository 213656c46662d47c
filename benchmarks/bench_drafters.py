"""Separate draft LM vs EAGLE-3 head on the embedded target, side by side in one run (not a test).

    .venv/bin/python benchmarks/bench_drafters.py [--prompts 8] [--max-new-tokens 96] [--repeats 2] [--tasks code|all|a,b]
        [--out DIR]

For each drafter, on held-out prompts (code by default), greedy:
1. a trace (W=4, D=6) of the prompts: tau of every static (depth, size) under replay, and calibration: every drafted
   candidate's cumulative draft probability, binned, against how often it lies on the target's greedy path;
2. the three best static configs under that replay, then every drafter's configs and our AR measured live,
   interleaved (methods rotated per prompt and repeat): tokens/s over AR with a paired bootstrap interval, tau,
   identical tokens, and the best head config over the best draft-LM config;
3. step costs: the mean drafter level time and the AR target step, from the same live runs.
Prints model, precision, sampling, hardware and prompt mix with the numbers; writes DIR/drafters.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.envs.oracle import replay_oracle
from specpilot.envs.profile import measure_profile
from specpilot.envs.record import record_trace
from specpilot.envs.replay import ReplayModel
from specpilot.eval.stats import paired_ratio_interval
from specpilot.eval.suites import load_suite
from specpilot.policies import FixedController

BINS = [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001]


def calibration(trace) -> list[dict]:
    """Binned cumulative draft probability of every candidate vs the share of them on the greedy path."""
    scores = trace.arrays["scores"]                              # [N, C] node order
    ranks = trace.arrays["onpath_rank"][:, -1, :]                # [N, D] rank among all candidates, by depth
    order = np.argsort(-scores, axis=1, kind="stable")           # the verification ranking
    on_path = np.zeros_like(scores, dtype=bool)
    rows = np.arange(scores.shape[0])
    for k in range(ranks.shape[1]):
        valid = ranks[:, k] < scores.shape[1]
        on_path[rows[valid], order[rows[valid], ranks[valid, k]]] = True
    prob = np.exp(scores)
    out = []
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        inside = (prob >= lo) & (prob < hi)
        if inside.any():
            out.append({"bin": f"[{lo:.2f}, {min(hi, 1.0):.2f})", "candidates": int(inside.sum()),
                        "mean_prob": float(prob[inside].mean()), "on_path": float(on_path[inside].mean())})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-depth", type=int, default=6)
    ap.add_argument("--tasks", default="code", help="held-out task groups, comma-separated, or 'all'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    suite = [p for p in load_suite("heldout") if args.tasks == "all" or p.task in args.tasks.split(",")]
    prompts = [p.prompt for p in suite[:: max(1, len(suite) // args.prompts)]][: args.prompts]  # spread over groups
    tree = TreeConfig(width=args.width, max_depth=args.max_depth, max_size=32)
    sizes = [2, 4, 6, 8, 12, 16, 24, 32]
    result, methods = {"drafters": {}}, {}
    pairs = {kind: ModelPair.from_pretrained(**{"eagle" if kind == "eagle3" else "draft": "embedded"})
             for kind in ("draft_lm", "eagle3")}
    for kind, pair in pairs.items():
        t0 = time.perf_counter()
        trace = record_trace(pair, tree, prompts, max_new_tokens=args.max_new_tokens)
        profile = measure_profile(pair, tree, prompts[:3], max_new_tokens=args.max_new_tokens)
        model = ReplayModel(trace, profile)
        oracle = replay_oracle(model, sizes=sizes)
        static = sorted(oracle["static"], key=lambda r: -r["tokens_per_s"])
        tau = {f"d{d}": max(r["mean_accepted_length"] for r in oracle["static"] if r["depth"] == d)
               for d in range(1, args.max_depth + 1)}
        result["drafters"][kind] = {"replay_top": static[:3], "best_tau_by_depth": tau,
                                    "calibration": calibration(trace), "record_s": time.perf_counter() - t0}
        print(f"{kind}: replay tau (best size) by depth {tau}")
        for row in static[:3]:
            methods[f"{kind} d{row['depth']} V{row['size']}"] = (SpeculativeDecoder(pair, tree),
                                                                FixedController(row["depth"], row["size"]))
    ar_pair = pairs["eagle3"]
    names = ["ar", *methods]
    totals = {n: {"tokens": 0, "time": 0.0, "cycles": 0, "levels": [], "identical": 0, "unit_tokens": [],
                  "unit_time": []} for n in names}
    for name in names:  # warm-up
        run(name, methods, ar_pair, prompts[0], 16)
    turn = 0
    for r in range(args.repeats):
        for i, prompt in enumerate(prompts):
            tokens = {}
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                t0 = time.perf_counter()
                out = run(name, methods, ar_pair, prompt, args.max_new_tokens)
                t = totals[name]
                elapsed = time.perf_counter() - t0
                t["time"] += elapsed
                t["tokens"] += out.num_tokens
                t["unit_time"].append(elapsed)
                t["unit_tokens"].append(out.num_tokens)
                t["cycles"] += len(out.cycles) or out.num_tokens
                t["levels"] += [s for c in out.cycles for s in c.level_s[1:]]
                tokens[name] = out.tokens
            if r == 0:
                for name in methods:
                    totals[name]["identical"] += tokens[name] == tokens["ar"]
            turn += 1
    ar = totals["ar"]
    ar_step = ar["time"] / ar["tokens"]
    result["live"] = {}
    print(f"embedded target {ar_pair.identity()['target_hash']}, cpu {str(ar_pair.dtype).replace('torch.', '')}, "
          f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}; greedy; "
          f"{len(prompts)} held-out prompts ({args.tasks}) x {args.repeats}, {args.max_new_tokens} new tokens; "
          f"AR {ar['tokens'] / ar['time']:.1f} tok/s ({1e3 * ar_step:.2f} ms per target step)")
    print(f"{'method':<24} {'speedup [95% CI]':>22} {'tau':>6} {'level/target step':>18} {'identical':>10}")
    for name in methods:
        t = totals[name]
        ci = paired_ratio_interval(t["unit_tokens"], t["unit_time"], ar["unit_tokens"], ar["unit_time"])
        row = {"speedup": ci.ratio, "speedup_ci": ci.ci(), "tau": t["tokens"] / t["cycles"],
               "level_step_ratio": float(np.mean(t["levels"])) / ar_step if t["levels"] else None,
               "identical": f"{t['identical']}/{len(prompts)}"}
        result["live"][name] = row
        ratio = f"{row['level_step_ratio']:.3f}" if row["level_step_ratio"] else "-"
        print(f"{name:<24} {row['speedup']:>6.2f}x [{ci.low:.2f}, {ci.high:.2f}] {row['tau']:>6.2f} {ratio:>18} "
              f"{row['identical']:>10}")
    # the two drafters' best live configs against each other, paired by (prompt, repeat)
    best = {kind: max((n for n in methods if n.startswith(kind)), key=lambda n: result["live"][n]["speedup"])
            for kind in pairs}
    a, b = totals[best["eagle3"]], totals[best["draft_lm"]]
    ci = paired_ratio_interval(a["unit_tokens"], a["unit_time"], b["unit_tokens"], b["unit_time"])
    result["eagle_vs_draft_lm"] = {"eagle3": best["eagle3"], "draft_lm": best["draft_lm"], "ratio": ci.ratio,
                                   "ci": ci.ci()}
    print(f"best eagle3 ({best['eagle3']}) / best draft_lm ({best['draft_lm']}): {ci.ratio:.3f}x "
          f"[{ci.low:.3f}, {ci.high:.3f}] (paired bootstrap over prompt x repeat)")
    for kind, info in result["drafters"].items():
        print(f"calibration, {kind} (cumulative draft probability -> share on the greedy path):")
        for b in info["calibration"]:
            print(f"  {b['bin']:<14} n={b['candidates']:>6}  mean p {b['mean_prob']:.3f}  on path {b['on_path']:.3f}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "drafters.json").write_text(json.dumps(result, indent=1))
    return 0


def run(name, methods, pair, prompt, max_new_tokens):
    if name == "ar":
        return autoregressive_generate(pair, prompt, max_new_tokens=max_new_tokens)
    decoder, controller = methods[name]
    return decoder.generate(prompt, controller=controller, max_new_tokens=max_new_tokens)


if __name__ == "__main__":
    raise SystemExit(main())
