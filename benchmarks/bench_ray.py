"""Benchmark of sharded recording on Ray: 2 workers x 1 thread vs one process (2 threads, 1 thread), and Ray's
start-up cost.

    PYTHONPATH=... python benchmarks/bench_ray.py [--prompts 8] [--workers 2] [--repeats 3] [--max-new-tokens 64]
        [--methods ray,proc-2t,proc-1t,2proc]

`specpilot record` of the first `--prompts` train prompts with the embedded pair (trace + latency profile):
- ray:      `record_task(executor=pool)` on a local Ray with `--workers` CPU workers of 1 thread each (1 prompt per shard);
- proc-2t:  `record_task` in this process with torch at 2 threads;
- proc-1t:  `record_task` in this process with torch at 1 thread;
- 2proc:    the no-Ray reference: two plain processes (started and warmed once) each `record_task` half the prompts
            at 1 thread, concurrently. ray/2proc is Ray's own cost; 2proc/proc-1t is what the machine's cores give.
The three run interleaved, in an order rotated every repeat, after one untimed warm-up of each; the table gives
each repeat's wall time and the ratios proc/ray (median and range over repeats). On 2 cores, 2x is the limit.
Start-up: `ray.init` (local Ray), the worker pool (actors start, import torch, load the pair; placement group),
and the first shard's round trip, measured once; they are paid per command, not per prompt.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

_PAIR = None


def _load_pair() -> None:
    """Initializer of the 2proc reference's processes: 1 thread, the embedded pair loaded once."""
    global _PAIR
    from specpilot.drafting.pair import ModelPair

    torch.set_num_threads(1)
    _PAIR = ModelPair.from_pretrained(device="cpu")


def _record_half(prompts: list, tree, out: str, max_new_tokens: int) -> None:
    from specpilot.envs.record import record_task

    record_task(_PAIR, tree, prompts, out, max_new_tokens=max_new_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--max-size", type=int, default=32)
    ap.add_argument("--methods", default="ray,proc-2t,proc-1t,2proc",
                    help="comma list; proc-2t stalls badly when other work shares the cores (drop it there)")
    args = ap.parse_args()

    from specpilot.drafting.pair import ModelPair
    from specpilot.drafting.types import TreeConfig
    from specpilot.eval.suites import load_prompts
    from specpilot.envs.record import record_task
    from specpilot.train.scale.cluster import PairSpec, WorkerPool, connect, shutdown

    prompts = load_prompts("train", limit=args.prompts)
    tree = TreeConfig(width=args.width, max_depth=args.max_depth, max_size=args.max_size)
    kw = dict(max_new_tokens=args.max_new_tokens)
    pair = ModelPair.from_pretrained(device="cpu")

    t0 = time.perf_counter()
    connect("local", num_cpus=args.workers)
    t_init = time.perf_counter() - t0
    t0 = time.perf_counter()
    pool = WorkerPool(PairSpec(device="cpu", threads=1), workers=args.workers)
    t_pool = time.perf_counter() - t0
    tmp = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    t0 = time.perf_counter()
    record_task(None, tree, prompts[:1], tmp / "first", executor=pool, **kw)
    t_first = time.perf_counter() - t0

    def ray_run(tag: str) -> None:
        record_task(None, tree, prompts, tmp / tag, executor=pool, shard_size=1, **kw)

    def proc_run(threads: int):
        def run(tag: str) -> None:
            torch.set_num_threads(threads)
            record_task(pair, tree, prompts, tmp / tag, **kw)
        return run

    procs = ProcessPoolExecutor(2, initializer=_load_pair)

    def two_procs(tag: str) -> None:
        half = len(prompts) // 2
        jobs = [procs.submit(_record_half, part, tree, str(tmp / tag / str(i)), args.max_new_tokens)
                for i, part in enumerate((prompts[:half], prompts[half:]))]
        for job in jobs:
            job.result()

    every = {"ray": ray_run, "proc-2t": proc_run(2), "proc-1t": proc_run(1), "2proc": two_procs}
    methods = {name: every[name] for name in args.methods.split(",")}
    print(f"start-up: ray.init {t_init:.1f}s, pool {t_pool:.1f}s, first shard {t_first:.1f}s", flush=True)
    for name, run in methods.items():  # warm-up, untimed
        run(f"warm-{name}")
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            methods[name](f"{name}-{r}")
            times[name].append(time.perf_counter() - t0)
            print(f"  repeat {r}: {name} {times[name][-1]:.1f}s", flush=True)
    pool.close()
    shutdown()
    procs.shutdown()

    print(f"recording {len(prompts)} prompts, embedded pair, tree {tree}, max_new_tokens={args.max_new_tokens}, "
          f"{args.repeats} interleaved repeats")
    for name in names:
        print(f"  {name:8s} wall s per repeat: " + ", ".join(f"{t:.1f}" for t in times[name]))
    for name in [n for n in ("proc-2t", "proc-1t", "2proc") if n in methods]:
        ratios = [p / q for p, q in zip(times[name], times["ray"])]
        print(f"  {name} / ray: median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})")
    print(f"start-up: ray.init {t_init:.1f}s, pool of {args.workers} workers {t_pool:.1f}s, "
          f"first 1-prompt shard {t_first:.1f}s")


if __name__ == "__main__":
    main()
