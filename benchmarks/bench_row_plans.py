"""A trained run's ltd and grid under three CPU kernel choices, side by side (not a test).

    PYTHONPATH=<tree parent> .venv/bin/python benchmarks/bench_row_plans.py RUN_DIR [--prompts 30] [--repeats 2]
        [--max-new-tokens 48] [--threads 2] [--suite heldout_code]

RUN_DIR: a demo run on the embedded pair with its EAGLE-3 head (`RUN/policies.json`, `RUN/grid.json`). Greedy, one
process: `ar`, the run's `grid` (its best static config) and `ltd` (its deployed policies), each with the pair's
linears under

- `plan`: the row plan `linear_kernels.measure` made for each model in this process (the default);
- `2-8`: W @ x^T for 2-8 rows unpadded and torch's linear otherwise (the stop-57 version of the same layers);
- `off`: torch's linear (the layers switched back),

every (method, mode) on each prompt in turn, the order rotating per prompt and repeat, after a warm-up pass.
Prints tokens/s (prefill included) and, with 95% cluster-bootstrap intervals over prompts: each method under
`plan` against `2-8` and `off`, and ltd against grid under each mode. The same trained policies run under every
mode: the policies were trained on a latency profile measured under one of them (the run's).
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
import torch

from specpilot.artifacts.grid import GridResult
from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting import linear_kernels
from specpilot.drafting.linear_kernels import describe, disable_small_row_linears, enable_small_row_linears
from specpilot.eval.stats import cluster_ratio_interval, verdict
from specpilot.eval.suites import load_suite
from specpilot.policies import FixedController
from specpilot.policies.ppo import load_run_controllers

MODES = ("plan", "2-8", "off")
STOP_57_ROWS = {r: r for r in range(2, 9)}


def set_mode(models: list, mode: str, plans: dict) -> None:
    """Switch every model's linears to `mode` (module docstring); `plans` holds the measured widths per entry."""
    for m in models:
        (disable_small_row_linears if mode == "off" else enable_small_row_linears)(m)
    for key, entry in linear_kernels._MEASURED.items():
        entry["widths"] = plans[key] if mode == "plan" else (STOP_57_ROWS if plans[key] else {})


def interval(rows: dict, a: tuple, b: tuple) -> str:
    x, y = np.array(rows[a]), np.array(rows[b])
    iv = cluster_ratio_interval(x[:, 1], x[:, 2], y[:, 1], y[:, 2], x[:, 0].astype(int))
    return f"{iv.ratio:.3f} [{iv.low:.3f}, {iv.high:.3f}] {verdict(iv)}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--suite", default="heldout_code")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = ModelPair.from_pretrained(eagle="embedded")
    models = [m for m in (pair.target, pair.eagle) if m is not None]
    plans = {key: dict(entry["widths"]) for key, entry in linear_kernels._MEASURED.items()}
    best = GridResult.load(args.run_dir / "grid.json").best
    methods = {"ar": None, "grid": FixedController(best["depth"], best["size"]),
               "ltd": load_run_controllers(args.run_dir)["ltd"]}
    decoder = SpeculativeDecoder(pair, TreeConfig(width=int(best.get("width", 4)), max_depth=8, max_size=32))
    prompts = [pair.encode(p.prompt) for p in load_suite(args.suite)][: args.prompts]
    print(f"{pair.name} + EAGLE-3 head, cpu {str(pair.dtype).replace('torch.', '')}, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; run {args.run_dir} "
          f"(grid d{best['depth']} V{best['size']}); plans {[m['plan'] for m in describe(models)['measured']]}; "
          f"{len(prompts)} {args.suite} prompts x {args.repeats}, {args.max_new_tokens} new tokens, greedy")
    runs = [(name, mode) for name in methods for mode in MODES]
    rows = {run: [] for run in runs}  # (prompt index, tokens, seconds)
    for r in range(args.repeats + 1):
        for i, ids in enumerate(prompts):
            k = (i + r * len(prompts)) % len(runs)
            for name, mode in runs[k:] + runs[:k]:
                set_mode(models, mode, plans)
                t0 = time.perf_counter()
                if methods[name] is None:
                    out = autoregressive_generate(pair, ids, max_new_tokens=args.max_new_tokens)
                else:
                    out = decoder.generate(ids, controller=methods[name], max_new_tokens=args.max_new_tokens)
                if r > 0:  # the first pass is a warm-up
                    rows[(name, mode)].append((i, out.num_tokens, time.perf_counter() - t0))
    set_mode(models, "plan", plans)
    for name in methods:
        tps = {m: np.array(rows[(name, m)])[:, 1].sum() / np.array(rows[(name, m)])[:, 2].sum() for m in MODES}
        print(f"  {name:4s} " + ", ".join(f"{m} {tps[m]:6.1f} tok/s" for m in MODES)
              + f"; plan/2-8 {interval(rows, (name, 'plan'), (name, '2-8'))}; "
                f"plan/off {interval(rows, (name, 'plan'), (name, 'off'))}")
    for mode in MODES:
        print(f"  ltd vs grid under {mode}: {interval(rows, ('ltd', mode), ('grid', mode))}; "
              f"ltd vs ar {interval(rows, ('ltd', mode), ('ar', mode))}; "
              f"grid vs ar {interval(rows, ('grid', mode), ('ar', mode))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
