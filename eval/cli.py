"""`specpilot eval`: evaluate decoding methods on a task suite and write report.json, report.md and plots.

The command only parses arguments and calls library functions: `load_suite`, `evaluate`, `write_report`, and
with --replay-dir `specpilot.eval.full.prepare_replay` / `attach_replay` (exact replay beside live, cost-model
check). It prints the verdict-first summary of `specpilot.eval.summary`.
"""
from __future__ import annotations

import argparse
import sys

from specpilot.eval.runner import METHODS


def _rounds(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of rounds or \"auto\", got {text!r}")
    return value


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default="heldout",
                        help="bundled suite (train, validation, heldout) or a path to .jsonl / .txt (default heldout)")
    parser.add_argument("--split", default=None, help="keep only prompts of this split")
    parser.add_argument("--methods", default=None,
                        help=f"comma list (default: all available): {', '.join(METHODS)}; `ar` always runs")
    parser.add_argument("--temperatures", type=_floats, default=(0.0, 1.0), help="comma list (default 0,1)")
    parser.add_argument("--sampled-methods", default=None,
                        help="comma list of the methods run at temperatures > 0 (default: all of --methods)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k when sampling (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top-p when sampling (1: off)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=_rounds, default="auto",
                        help="rounds over all prompts: N, or auto (default): until the --decide pair's 95%% interval "
                             "is within --target-half-width, they made the same decisions, or --time-budget is spent")
    parser.add_argument("--min-rounds", type=int, default=2, help="fewest rounds with --rounds auto (default 2)")
    parser.add_argument("--max-rounds", type=int, default=20, help="most rounds with --rounds auto (default 20)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the whole evaluation (default: none); another round starts only if it fits")
    parser.add_argument("--target-half-width", type=float, default=0.015,
                        help="stop when the deciding interval is within +- this fraction (default 0.015)")
    parser.add_argument("--decide", default="ltd,grid", help="the deciding pair METHOD,BASELINE (default ltd,grid)")
    parser.add_argument("--full-rounds", type=int, default=1,
                        help="rounds in which every method runs; later rounds run ar and the deciding pair (default 1)")
    parser.add_argument("--repeats", type=int, default=None, help="old name of a fixed --rounds N")
    parser.add_argument("--replay-dir", default=None,
                        help="record (or reuse) greedy traces of the prompts here and report exact replay beside live")
    parser.add_argument("--check-profile", action="append", default=[], metavar="PROFILE_JSON",
                        help="with --replay-dir: check this latency profile against the live runs (repeatable)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs per method")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="also run N streams at once and report speedup/latency under that load")
    parser.add_argument("--target", default=None, help="target model (hub id or path); default: embedded pair")
    parser.add_argument("--draft", default=None, help="draft model (hub id or path); default: embedded pair")
    parser.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default per device)")
    parser.add_argument("--grid", default=None, help="grid-search result JSON (enables method `grid`)")
    parser.add_argument("--run", dest="run_dir", default=None,
                        help="trained run dir (enables `ltd`, `depth_only`, `size_only`)")
    parser.add_argument("--out", default="eval_out", help="output directory (default eval_out)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=8, help="draft tree beam width W")
    parser.add_argument("--max-depth", type=int, default=12, help="most draft levels per cycle")
    parser.add_argument("--max-size", type=int, default=64, help="most candidates verified per cycle")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def run(args: argparse.Namespace) -> int:
    from specpilot.drafting.pair import ModelPair
    from specpilot.drafting.types import TreeConfig
    from specpilot.eval.report import write_report
    from specpilot.eval.runner import evaluate
    from specpilot.eval.suites import SuiteError, load_suite

    try:
        prompts = load_suite(args.suite, split=args.split)
    except SuiteError as err:
        print(f"specpilot eval: {err}", file=sys.stderr)
        return 2
    if args.limit is not None:
        prompts = prompts[: args.limit]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    sampled = [m.strip() for m in args.sampled_methods.split(",") if m.strip()] if args.sampled_methods else None
    unknown = [m for m in (methods or []) + (sampled or []) if m not in METHODS]
    if unknown:
        print(f"specpilot eval: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}",
              file=sys.stderr)
        return 2
    try:
        tree = TreeConfig(width=args.width, max_depth=args.max_depth, max_size=args.max_size)
        pair = ModelPair.from_pretrained(args.target, args.draft, device=args.device, dtype=args.dtype)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"specpilot eval: {err}", file=sys.stderr)
        return 2
    decide = tuple(m.strip() for m in args.decide.split(","))
    if len(decide) != 2:
        print(f"specpilot eval: --decide takes METHOD,BASELINE, got {args.decide!r}", file=sys.stderr)
        return 2
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    print(f"evaluating {len(prompts)} prompts on {pair.name} ({pair.device}, {pair.dtype})", file=sys.stderr)
    trace = profile = None
    ids = {p.prompt: pair.encode(p.prompt) for p in prompts}
    if args.replay_dir:
        from specpilot.eval.full import prepare_replay

        trace, profile = prepare_replay(pair, tree, list(ids.values()), args.replay_dir,
                                        max_new_tokens=args.max_new_tokens, seed=args.seed, progress=say)
    try:
        result = evaluate(prompts, pair=pair, methods=methods, temperatures=args.temperatures, top_k=args.top_k,
                          top_p=args.top_p, max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                          min_rounds=args.min_rounds, max_rounds=args.max_rounds, time_budget_s=args.time_budget,
                          target_half_width=args.target_half_width, decide=decide, full_rounds=args.full_rounds,
                          repeats=args.repeats, warmup=args.warmup, concurrency=args.concurrency, tree=tree,
                          grid=args.grid, run_dir=args.run_dir, seed=args.seed, encode=ids.__getitem__,
                          progress=say, sampled_methods=sampled)
    except ValueError as err:
        print(f"specpilot eval: {err}", file=sys.stderr)
        return 2
    if trace is not None:
        from pathlib import Path

        from specpilot.eval.full import attach_replay

        attach_replay(result, trace, profile, prompts, profile_path=Path(args.replay_dir) / "profile.json",
                      check_profiles={p: p for p in args.check_profile}, seed=args.seed, progress=say)
    paths = write_report(result.results, result.meta, args.out, plots=not args.no_plots, analysis=result.analysis())
    for name, reason in result.meta["skipped"].items():
        print(f"skipped {name}: {reason}", file=sys.stderr)
    _print_summary(paths["json"])
    print(f"wrote {paths['md']} and {paths['json']}")
    return 0


def _print_summary(report_json: str) -> None:
    import json
    from pathlib import Path

    from specpilot.eval.summary import format_summary_lines, summarise_report

    report = json.loads(Path(report_json).read_text())
    print("\n".join(format_summary_lines(summarise_report(report))))
