"""`--ray ADDRESS --workers N` for the heavy commands (record, grid, eval, train, demo): the shared CLI wiring.

    specpilot record --ray local --workers 2 --suite train --out runs/r/traces/train
    specpilot --threads 4 eval --ray auto --workers 8 --target T --draft D --out runs/r/eval

`specpilot.cli` calls `add_cluster_arguments(parser)` for each command in CLUSTER_COMMANDS (`specpilot train`
adds them to each stage) and wraps its handler with `with_cluster`: without --ray the command runs as before and
Ray is never imported; with --ray, record, grid and eval run here on a WorkerPool, while train and demo read
`args.ray` themselves (`open_pool`). Each worker
loads the pair named by --target/--draft (the embedded pair by default) with --threads torch threads.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

# commands whose parser gets the arguments from specpilot.cli; `train` adds them to each stage's parser itself
CLUSTER_COMMANDS = ("record", "grid", "eval", "demo")


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """--ray ADDRESS and --workers N (one call per heavy command's parser)."""
    from specpilot.drafting.cliargs import positive_int

    g = parser.add_argument_group("cluster (Ray; `pip install 'specpilot[ray]'`)")
    g.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run on Ray workers: 'local' starts Ray on this machine, 'auto' joins the cluster that "
                        "`ray start` set up on this node, or a cluster address HOST:PORT (default: none, run in "
                        "this process)")
    g.add_argument("--workers", type=positive_int, default=None,
                   help="Ray workers, each loading its own pair on its own GPU (or --threads CPU cores); default: "
                        "one per GPU of the cluster, else cluster CPUs // threads")


def default_workers(resources: dict, threads: int) -> int:
    """One worker per GPU when the cluster has GPUs, else as many `threads`-core workers as its CPUs hold."""
    gpus = int(resources.get("GPU", 0))
    return gpus if gpus > 0 else max(1, int(resources.get("CPU", 1)) // max(1, threads))


@contextmanager
def open_pool(args: argparse.Namespace, *, say: Callable[[str], None] | None = None) -> Iterator:
    """Connect to args.ray and start a WorkerPool of args.workers workers loading args' pair; close it after."""
    from specpilot.train.cluster import ClusterError, PairSpec, WorkerPool, connect, import_ray, shutdown

    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    threads = max(1, int(getattr(args, "threads", None) or 1))
    owned = not import_ray().is_initialized()  # a Ray this process already uses stays up after the command
    if args.workers is not None and args.workers < 1:
        raise ClusterError(f"--workers must be >= 1, got {args.workers}")
    resources = connect(args.ray)
    workers = args.workers or default_workers(resources, threads)
    spec = PairSpec(getattr(args, "target", None), getattr(args, "draft", None), getattr(args, "eagle", None),
                    getattr(args, "device", None), getattr(args, "dtype", None), threads)
    pool = WorkerPool(spec, workers=workers)
    say(f"ray {args.ray}: {len(pool)} workers ({', '.join(w['device'] + '@' + w['host'] for w in pool.workers)}), "
        f"{threads} thread(s) each")
    try:
        yield pool
    finally:
        pool.close()
        if owned:
            shutdown()


def with_cluster(command: str, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """The command's handler: `run` without --ray (or for train/demo, which handle --ray themselves), else the
    cluster version of record / grid / eval."""
    def handler(args: argparse.Namespace) -> int:
        if getattr(args, "ray", None) is None or command not in CLUSTER_RUNNERS:
            return run(args)
        from specpilot.train.cluster import ClusterError

        try:
            return CLUSTER_RUNNERS[command](args)
        except ClusterError as err:
            print(f"specpilot {command}: {err}", file=sys.stderr)
            return 2
    return handler


def run_record(args: argparse.Namespace) -> int:
    """`specpilot record --ray`: sharded recording (see specpilot.train.sharded.record_sharded)."""
    from specpilot.drafting.types import TreeConfig
    from specpilot.policies.observation import default_size_actions
    from specpilot.eval.suites import load_prompts
    from specpilot.train.sharded import record_sharded

    try:
        prompts = load_prompts(args.suite, args.split, args.limit)
    except ValueError as err:
        print(f"specpilot record: {err}", file=sys.stderr)
        return 2
    with open_pool(args) as pool:
        device = "cuda" if pool.gpus else (pool.spec.device or "cpu")
        max_size = args.max_size or max(max(default_size_actions(device)), TreeConfig().max_size)
        tree = TreeConfig(width=args.width, max_depth=args.max_depth, max_size=max_size)
        print(f"recording {len(prompts)} prompts from {args.suite!r} on {len(pool)} workers, tree {tree}, "
              f"max_new_tokens={args.max_new_tokens}")
        summary = record_sharded(pool, tree, prompts, args.out, max_new_tokens=args.max_new_tokens,
                                 profile_prompts=args.profile_prompts, seed=args.seed, progress=print)
    say_retries(summary["retried_prompts"], summary["resumed_shards"])
    print(f"wrote {args.out}/trace.npz, trace.json, profile.json, cluster.json")
    return 0


def say_retries(retried: list[int], resumed: list[int] | None = None) -> None:
    if retried:
        print(f"retried prompts (their shard failed once): {retried}")
    if resumed:
        print(f"resumed: shards {resumed} were already recorded")


def run_grid(args: argparse.Namespace) -> int:
    """`specpilot grid --ray`: replay sweeps as Ray tasks, live top cells on the workers."""
    from specpilot.eval.suites import load_prompts
    from specpilot.train.cluster_grid import grid_search_sharded
    from specpilot.train.grid import int_list, resolve_train_trace

    try:
        traces = [resolve_train_trace(t) for t in args.traces]
        prompts = load_prompts(args.val_suite, limit=args.val_limit) if args.live_top > 0 else None
    except (FileNotFoundError, ValueError) as err:
        print(f"specpilot grid: {err}", file=sys.stderr)
        return 2
    with open_pool(args) as pool:
        result = grid_search_sharded(pool, traces, depths=int_list(args.depths), sizes=int_list(args.sizes),
                                     max_new_tokens=args.max_new_tokens, val_prompts=prompts,
                                     live_top=args.live_top, live_repeats=args.live_repeats, out=args.out,
                                     progress=print)
    best = result["best"]
    print(f"best static config ({best['source']}): W={best['width']} depth={best['depth']} size={best['size']}, "
          f"replay {best['replay_tokens_per_s']:.1f} tok/s ({best['replay_speedup']:.2f}x AR)"
          + (f", live {best['live_speedup']:.2f}x AR" if best["source"] == "live" else ""))
    print(f"wrote {args.out}")
    return 0


# eval, train and demo read args.ray in their own run() (eval checks its inputs first, the same way with or
# without Ray)
CLUSTER_RUNNERS: dict[str, Callable[[argparse.Namespace], int]] = {"record": run_record, "grid": run_grid}
