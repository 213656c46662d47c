"""`specpilot record`: record replay traces and a latency profile for a task (the library is envs/record.py)."""
from __future__ import annotations

import argparse
import sys

from specpilot.eval.suites import load_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default="train", help="bundled suite name or path to a .jsonl/.txt file")
    parser.add_argument("--split", default=None, help="keep only prompts of this split")
    parser.add_argument("--out", required=True, help="output directory (trace.npz, trace.json, profile.json)")
    parser.add_argument("--target", default=None, help="target model (hub id or path); default: embedded pair")
    parser.add_argument("--draft", default=None, help="draft model (with --target)")
    parser.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: per device)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="generation budget per prompt")
    parser.add_argument("--width", type=int, default=8, help="tree beam width W")
    parser.add_argument("--max-depth", type=int, default=12, help="deepest tree recorded")
    parser.add_argument("--max-size", type=int, default=None,
                        help="largest verification size (default: the largest default size action for the device)")
    parser.add_argument("--limit", type=int, default=None, help="record only the first N prompts")
    parser.add_argument("--profile-prompts", type=int, default=None,
                        help="measure the latency profile on the first N prompts (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the profile's random (depth, size) draws")


def run(args: argparse.Namespace) -> int:
    from specpilot.drafting.pair import ModelPair
    from specpilot.drafting.types import TreeConfig
    from specpilot.policies.observation import default_size_actions

    try:
        prompts = load_prompts(args.suite, args.split, args.limit)
    except ValueError as err:
        print(f"specpilot record: {err}", file=sys.stderr)
        return 2
    try:
        pair = ModelPair.from_pretrained(args.target, args.draft, device=args.device, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as err:
        print(f"specpilot record: {err}", file=sys.stderr)
        return 2
    max_size = args.max_size or max(max(default_size_actions(str(pair.device))), TreeConfig().max_size)
    tree = TreeConfig(width=args.width, max_depth=args.max_depth, max_size=max_size)
    print(f"recording {len(prompts)} prompts from {args.suite!r} on {pair.name} ({pair.device}), tree {tree}, "
          f"max_new_tokens={args.max_new_tokens}")
    from specpilot.envs.record import record_task

    trace_dir, profile_path = record_task(pair, tree, prompts, args.out, max_new_tokens=args.max_new_tokens,
                                          profile_prompts=args.profile_prompts, seed=args.seed, progress=True)
    print(f"wrote {trace_dir / 'trace.npz'}, {trace_dir / 'trace.json'}, {profile_path}")
    return 0
