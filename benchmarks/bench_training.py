"""End-to-end training benchmark: record -> grid -> stage 1 -> co-adaptation -> replay + live validation numbers.

    .venv/bin/python benchmarks/bench_training.py --out runs/bench            # embedded default pair
    .venv/bin/python benchmarks/bench_training.py --out /tmp/b --target T --draft D --size-steps 4000 ...

Every step is skipped when its output already exists (traces, grid.json) or resumed (training stages), so an
interrupted benchmark continues where it stopped. Writes OUT/summary.json and prints a table:
replay and live validation tokens/s and speedup of the grid best, depth_only / size_only (stage 1), ltd
(co-adapted), the replay oracle, and the live decision overhead (policy_s / generation time).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--max-size", type=int, default=32)
    ap.add_argument("--train-limit", type=int, default=None, help="first N train prompts (default all)")
    ap.add_argument("--val-limit", type=int, default=None, help="first N validation prompts (default all)")
    ap.add_argument("--profile-prompts", type=int, default=8)
    ap.add_argument("--size-steps", type=int, default=20_000)
    ap.add_argument("--depth-steps", type=int, default=40_000)
    ap.add_argument("--coadapt-steps", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ablation-steps", type=int, default=0, help="reward ablation budget per mode (0: skip)")
    ap.add_argument("--pi-arch", default=None, help="actor layers for both policies (default: the paper's)")
    ap.add_argument("--live-top", type=int, default=3)
    ap.add_argument("--live-repeats", type=int, default=1)
    ap.add_argument("--wandb", default="offline")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from specpilot.drafting.pair import ModelPair
    from specpilot.drafting.types import TreeConfig
    from specpilot.envs.record import load_prompts
    from specpilot.policies.base import FixedController
    from specpilot.policies.ppo import load_run_controllers
    from specpilot.train import pipeline as P
    from specpilot.train.grid import grid_search

    out = Path(args.out)
    timings: dict[str, float] = {}
    pair = ModelPair.from_pretrained(args.target, args.draft, tokenizer=args.tokenizer, device="cpu",
                                     dtype="float32")
    tree = TreeConfig(width=args.width, max_depth=args.max_depth, max_size=args.max_size)
    train_prompts = load_prompts("train", limit=args.train_limit)
    val_prompts = load_prompts("validation", limit=args.val_limit)

    t0 = time.perf_counter()
    if not (out / "traces" / "validation" / "ar.json").is_file():
        P.record_traces(pair, out / "traces", tree=tree, train_prompts=train_prompts, val_prompts=val_prompts,
                        max_new_tokens=args.max_new_tokens, profile_prompts=args.profile_prompts, progress=True)
    timings["record_s"] = time.perf_counter() - t0
    traces = P.TaskTraces.resolve(out / "traces")

    t0 = time.perf_counter()
    if not (out / "grid.json").is_file():
        grid_search(traces.train, pair=pair, val_prompts=val_prompts, live_top=args.live_top,
                    out=out / "grid.json", progress=True)
    grid = json.loads((out / "grid.json").read_text())
    timings["grid_s"] = time.perf_counter() - t0
    print("grid best:", grid["best"], flush=True)

    over = {}
    if args.pi_arch:
        over["pi_arch"] = [int(x) for x in args.pi_arch.split(",")]
    t0 = time.perf_counter()
    P.run_pipeline(out, traces, size_steps=args.size_steps, depth_steps=args.depth_steps,
                   coadapt_steps=args.coadapt_steps, rounds=args.rounds, resume=True, wandb=args.wandb, **over)
    timings["train_s"] = time.perf_counter() - t0

    replay = P.evaluate_run(out, traces)
    static = P.static_config(out)
    ctrls = {"grid_best": FixedController(*static)}
    final = load_run_controllers(out)
    stage1 = load_run_controllers(out / "stage1")
    ctrls.update(depth_only=stage1["depth_only"], size_only=stage1["size_only"], s1_ltd=stage1["ltd"],
                 ltd=final["ltd"])
    t0 = time.perf_counter()
    live = P.evaluate_live(pair, ctrls, val_prompts, tree=tree, max_new_tokens=args.max_new_tokens,
                           repeats=args.live_repeats, progress=True)
    timings["live_eval_s"] = time.perf_counter() - t0

    ablation = None
    if args.ablation_steps > 0:
        t0 = time.perf_counter()
        ablation = P.reward_ablation(out, traces, steps=args.ablation_steps, resume=True, wandb=args.wandb, **over)
        timings["ablation_s"] = time.perf_counter() - t0

    keys = {"grid_best": "static", "depth_only": "s1_depth_only", "size_only": "s1_size_only", "s1_ltd": "s1_ltd",
            "ltd": "ltd"}
    rows = []
    for name, rkey in keys.items():
        r, l_ = replay[rkey], live[name]
        rows.append({"method": name, "replay_tokens_per_s": r["tokens_per_s"], "replay_speedup": r["speedup"],
                     "replay_tau": r["mean_accepted_length"], "live_tokens_per_s": l_["tokens_per_s"],
                     "live_speedup": l_["speedup"], "live_tau": l_["mean_accepted_length"],
                     "policy_overhead": l_["policy_overhead"], "depth_mean": l_["depth_mean"],
                     "size_mean": l_["size_mean"]})
    rows.append({"method": "oracle", "replay_tokens_per_s": replay["oracle"]["tokens_per_s"],
                 "replay_speedup": replay["oracle"]["speedup"], "replay_tau": replay["oracle"]["mean_accepted_length"]})
    summary = {"rows": rows, "replay": replay, "live": live, "grid_best": grid["best"], "ablation": ablation,
               "ltd_fraction_of_oracle": replay["ltd"]["tokens_per_s"] / replay["oracle"]["tokens_per_s"],
               "timings": timings, "args": vars(args)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    print(f"{'method':<12}{'replay tok/s':>13}{'x AR':>7}{'tau':>6}{'live tok/s':>12}{'x AR':>7}{'tau':>6}"
          f"{'policy %':>10}{'depth':>7}{'size':>7}")
    for r in rows:
        def f(key, fmt):
            v, width = r.get(key), int(fmt.split(".")[0])
            return format(v, fmt) if isinstance(v, (int, float)) else "-".rjust(width)
        print(f"{r['method']:<12}{f('replay_tokens_per_s', '13.1f')}{f('replay_speedup', '7.2f')}"
              f"{f('replay_tau', '6.2f')}{f('live_tokens_per_s', '12.1f')}{f('live_speedup', '7.2f')}"
              f"{f('live_tau', '6.2f')}{f('policy_overhead', '10.2%')}{f('depth_mean', '7.2f')}{f('size_mean', '7.2f')}")
    print(f"ltd / replay oracle: {summary['ltd_fraction_of_oracle']:.1%}; timings {timings}")
    if ablation:
        for row in ablation["rows"]:
            fin = row["final"]
            print(f"ablation {row['reward']:<11} final {fin['tokens_per_s']:.1f} tok/s ({fin['speedup']:.2f}x) "
                  f"tau {fin['mean_accepted_length']:.2f} size {fin['size_mean']:.1f} | best "
                  f"{row['best']['tokens_per_s']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
