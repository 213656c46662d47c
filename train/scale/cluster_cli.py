"""`--ray ADDRESS --workers N` for the heavy commands (record, grid, eval, train, demo): the shared CLI wiring.

    specpilot record --ray local --workers 2 --suite train --out runs/r/traces/train
    specpilot --threads 4 eval --ray auto --workers 8 --target T --draft D --out runs/r/eval

`specpilot.cli` calls `add_cluster_arguments(parser)` for each command in CLUSTER_COMMANDS (`specpilot train`
adds them to each stage) and wraps its handler with `with_cluster`. Each command runs its one orchestrator on
`open_executor(args)`: this process without --ray (Ray is never imported), else a WorkerPool (`open_pool`) whose
workers each load the pair named by --target/--draft (the embedded pair by default) with --threads torch threads.
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
    from specpilot.train.scale.cluster import ClusterError, PairSpec, WorkerPool, connect, import_ray, shutdown

    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    # `specpilot --threads N` (stored as global_threads): each worker's torch threads, as the README's examples set it
    threads = max(1, int(getattr(args, "global_threads", None) or getattr(args, "threads", None) or 1))
    owned = not import_ray().is_initialized()  # a Ray this process already uses stays up after the command
    if args.workers is not None and args.workers < 1:
        raise ClusterError(f"--workers must be >= 1, got {args.workers}")
    try:
        resources = connect(args.ray)
        workers = args.workers or default_workers(resources, threads)
        spec = PairSpec(getattr(args, "target", None), getattr(args, "draft", None), getattr(args, "eagle", None),
                        getattr(args, "device", None), getattr(args, "dtype", None), threads,
                        getattr(args, "dtype_source", None))
        pool = WorkerPool(spec, workers=workers)
    except BaseException:  # refused, a worker failed to load, Ctrl-C: the Ray this command started stops with it
        if owned:
            shutdown()
        raise
    say(f"ray {args.ray}: {len(pool)} worker{'s' if len(pool) != 1 else ''} "
        f"({', '.join(w['device'] + '@' + w['host'] for w in pool.workers)}), {threads} thread(s) each")
    try:
        yield pool
    finally:
        pool.close()
        if owned:
            shutdown()


@contextmanager
def open_executor(args: argparse.Namespace) -> Iterator:
    """The executor of a command: a WorkerPool with --ray (`open_pool`), else this process on args' pair."""
    if getattr(args, "ray", None) is None:
        from specpilot.drafting.cliargs import load_pair
        from specpilot.drafting.executor import LocalExecutor

        yield LocalExecutor(load_pair(args))
        return
    with open_pool(args) as pool:
        yield pool


def with_cluster(command: str, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """The command's handler: `run`, with a cluster that cannot do what was asked reported in one line (exit 2)."""
    def handler(args: argparse.Namespace) -> int:
        from specpilot.train.scale.cluster import ClusterError

        if getattr(args, "workers", None) is not None and getattr(args, "ray", None) is None:
            print(f"specpilot {command}: --workers sets how many Ray workers run the command; without --ray it "
                  "would be ignored: add --ray local (or a cluster address), or drop --workers", file=sys.stderr)
            return 2
        try:
            return run(args)
        except ClusterError as err:
            print(f"specpilot {command}: {err}", file=sys.stderr)
            return 2
    return handler
