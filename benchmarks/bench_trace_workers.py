"""Benchmark of recording with the traces on local processes side by side (`record_task(trace_workers=...)`, the
profile and AR timing measured alone after them) against recording in this process (traces and timing in it).

    python -m specpilot.benchmarks.bench_trace_workers [--prompts 8] [--workers 2] [--repeats 3]
        [--max-new-tokens 48] [--profile-prompts 2] [--profile-cycles 100]

The embedded pair records the first `--prompts` train prompts (W=4, depth 8, V<=32, as the demo) both ways, in an
order alternated every repeat after one untimed warm-up of each; both measure the same profile (same prompts, seed
and cycles) and AR timing. Prints each repeat's wall time and the ratio in-process / processes (median and range
over repeats). The pool's start-up (spawn, import, load the pair) is measured once: it is paid once per command.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--profile-prompts", type=int, default=2)
    ap.add_argument("--profile-cycles", type=int, default=100)
    args = ap.parse_args()

    import torch

    from specpilot.drafting.pair import ModelPair
    from specpilot.drafting.types import TreeConfig
    from specpilot.envs.record import record_task
    from specpilot.eval.suites import load_prompts
    from specpilot.train.scale.cluster import PairSpec
    from specpilot.train.scale.processes import ProcessPool

    prompts = load_prompts("train", limit=args.prompts)
    tree = TreeConfig(width=4, max_depth=8, max_size=32)
    pair = ModelPair.from_pretrained(device="cpu", dtype="float32")
    kw = dict(max_new_tokens=args.max_new_tokens, profile_prompts=args.profile_prompts,
              profile_cycles=args.profile_cycles, ar=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-trace-workers-"))
    t0 = time.perf_counter()
    pool = ProcessPool(PairSpec(device="cpu", dtype="float32", threads=1), args.workers)
    t_pool = time.perf_counter() - t0
    methods = {"processes": lambda tag: record_task(pair, tree, prompts, tmp / tag, trace_workers=pool, **kw),
               "in-process": lambda tag: record_task(pair, tree, prompts, tmp / tag, **kw)}
    for name, run in methods.items():  # warm-up, untimed
        run(f"warm-{name}")
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(args.repeats):
        for name in names[r % 2:] + names[:r % 2]:
            t0 = time.perf_counter()
            methods[name](f"{name}-{r}")
            times[name].append(time.perf_counter() - t0)
            print(f"  repeat {r}: {name} {times[name][-1]:.1f}s", flush=True)
    pool.close()
    print(f"recording {len(prompts)} prompts (profile on {args.profile_prompts}, >= {args.profile_cycles} cycles, AR "
          f"timed), embedded pair fp32, tree {tree}, max_new_tokens={args.max_new_tokens}, {args.repeats} "
          f"interleaved repeats, this process at {torch.get_num_threads()} torch threads, {args.workers} processes "
          "at 1")
    for name in names:
        print(f"  {name:10s} wall s per repeat: " + ", ".join(f"{t:.1f}" for t in times[name]))
    ratios = [a / b for a, b in zip(times["in-process"], times["processes"])]
    print(f"  in-process / processes: median {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    print(f"  pool start-up (once per command): {t_pool:.1f}s")


if __name__ == "__main__":
    main()
