"""`specpilot record`: record replay traces and a latency profile for a task (the library is envs/record.py)."""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specpilot.artifacts.profile import DEFAULT_PROFILE_CYCLES
from specpilot.drafting.cliargs import add_pair_arguments, non_negative_int, output_dir, positive_int, seed
from specpilot.eval.suites import load_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default="train", help="bundled suite name or path to a .jsonl/.json/.txt file")
    parser.add_argument("--split", default=None, help="keep only prompts of this split (default: all)")
    parser.add_argument("--out", required=True, type=output_dir,
                        help="output folder for trace.npz, trace.json and profile.json (checked before recording)")
    add_pair_arguments(parser)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="generation budget per prompt")
    parser.add_argument("--width", type=positive_int, default=8, help="tree beam width W")
    parser.add_argument("--max-depth", type=positive_int, default=12, help="deepest tree recorded")
    parser.add_argument("--max-size", type=positive_int, default=None,
                        help="largest verification size (default: the largest default size action for the device)")
    parser.add_argument("--limit", type=positive_int, default=None, help="record only the first N prompts "
                                                                         "(default: all)")
    parser.add_argument("--profile-prompts", type=positive_int, default=None,
                        help="measure the latency profile on the first N prompts (default: all)")
    parser.add_argument("--profile-cycles", type=non_negative_int, default=DEFAULT_PROFILE_CYCLES,
                        help="decode the profile prompts again until the profile holds at least N cycles (0: one "
                             "pass)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the profile's random (depth, size) draws")
    parser.add_argument("--processes", type=non_negative_int, default=0,
                        help="record the traces on N local processes side by side (one torch thread each; on a CPU "
                             "where batch-1 decoding gains little from a second thread), then measure the latency "
                             "profile and AR timing in this process alone (default: 0, this process records; not "
                             "with --ray)")


def check_room(pair, prompts: list[str], *, max_new_tokens: int, max_depth: int) -> None:
    """A trace records the target's continuation max_depth tokens past the budget (the deepest tree drafted at its
    last cycle): every prompt needs prompt + max_new_tokens + max_depth + 1 positions. Refused before recording,
    naming the options (not the internal sum they add up to)."""
    for i, text in enumerate(prompts):
        n = len(pair.encode(text))
        need = n + max_new_tokens + max_depth + 1
        if need > pair.max_context:
            raise ValueError(f"prompt {i + 1} is {n} tokens: with --max-new-tokens {max_new_tokens} and --max-depth "
                             f"{max_depth} (the trace follows the target {max_depth} tokens past the budget) it needs "
                             f"{need} positions, but the models' context is {pair.max_context}; lower --max-depth or "
                             "--max-new-tokens, or shorten the prompt")


@contextmanager
def trace_processes(executor, args: argparse.Namespace) -> Iterator:
    """A `ProcessPool` of args.processes processes loading the executor's pair (same models, device and dtype), or
    None for fewer than 2; closed after the block."""
    if args.processes < 2:
        yield None
        return
    from specpilot.train.scale.cluster import PairSpec
    from specpilot.train.scale.processes import ProcessPool

    pair = executor.pair
    spec = PairSpec(args.target, args.draft, args.eagle, device=str(pair.device), threads=1,
                    dtype=str(pair.dtype).replace("torch.", ""))
    with ProcessPool(spec, args.processes) as pool:
        yield pool


def run(args: argparse.Namespace) -> int:
    from specpilot.drafting.decoder import SpeculativeDecoder
    from specpilot.drafting.executor import LocalExecutor
    from specpilot.drafting.folder_lock import output_lock
    from specpilot.drafting.types import TreeConfig
    from specpilot.envs.record import check_recording_writable, record_task
    from specpilot.policies.observation import default_size_actions
    from specpilot.train.scale.cluster_cli import open_executor

    prompts = load_prompts(args.suite, args.split, args.limit)
    if args.profile_prompts is not None and args.profile_prompts > len(prompts):
        raise ValueError(f"--profile-prompts {args.profile_prompts} is more than the {len(prompts)} prompt(s) "
                         "recorded: give --profile-prompts "
                         f"{len(prompts)} or less{', or a larger --limit' if args.limit else ''}")
    if args.processes and getattr(args, "ray", None):
        raise ValueError("--processes records on local processes and --ray on Ray workers: give one of them")
    check_recording_writable(args.out)  # before the models load (record_task checks the shard folders again)
    with output_lock(args.out, what="--out"), open_executor(args) as executor, \
            trace_processes(executor, args) as processes:
        max_size = args.max_size or max(max(default_size_actions(executor.device)), TreeConfig().max_size)
        tree = TreeConfig(width=args.width, max_depth=args.max_depth, max_size=max_size)
        if isinstance(executor, LocalExecutor):  # the tree fits the drafter (width <= vocabulary) before hours of work
            SpeculativeDecoder(executor.pair, tree)
            check_room(executor.pair, prompts, max_new_tokens=args.max_new_tokens, max_depth=args.max_depth)
        recorders = processes or executor
        print(f"recording {len(prompts)} prompts from {args.suite!r} on {len(recorders)} "
              f"{'process(es) side by side' if processes else 'worker(s)'} "
              f"({', '.join(sorted({w['device'] for w in recorders.workers}))}), tree {tree}, "
              f"max_new_tokens={args.max_new_tokens}")
        try:
            trace_dir, profile_path = record_task(None, tree, prompts, args.out, max_new_tokens=args.max_new_tokens,
                                                  profile_prompts=args.profile_prompts,
                                                  profile_cycles=args.profile_cycles, seed=args.seed, progress=True,
                                                  executor=executor, ar=True,  # the AR reference of replay speedups
                                                  trace_workers=processes)
        except KeyboardInterrupt:  # finished shards are kept (done.json): the same command resumes from them
            done = len(list(Path(args.out).glob("shards/shard-*/done.json")))
            kept = (f"{done} finished shard(s) kept under {Path(args.out) / 'shards'}: run the same command again to "
                    "resume from them" if done else "no shard had finished, so nothing was kept")
            print(f"specpilot record: interrupted; {kept}", file=sys.stderr)
            return 130
    print(f"wrote {trace_dir / 'trace.npz'}, {trace_dir / 'trace.json'}, {profile_path}")
    return 0
