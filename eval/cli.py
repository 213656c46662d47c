"""`specpilot eval`: evaluate decoding methods on a task suite and write report.json, report.md and plots.

The command only parses arguments and calls library functions: `load_suite` and `specpilot.eval.full.full_evaluation`
(`evaluate`, with --replay-dir exact replay beside live and the cost-model check, `write_report`), in this process
or with --ray on Ray workers: the same files either way. It prints the verdict-first summary of
`specpilot.eval.summary`.

Before anything is measured (`prepare`): the output folder is writable, every method asked for by name can run
(`specpilot.eval.inputs.check_methods`: a missing or broken --run / --grid is an error, not a skipped method), and
with --run the tree is the run's (its policies' contract; a conflicting --width/--max-depth/--max-size is refused).

With --batch-sizes the command runs the batched evaluation instead (`specpilot.eval.batched.evaluate_batches`,
in this process, every method decoding batches of each size vs batched ar, at each of --temperatures: greedy with
token identity checked, sampled with per-sequence seeds) and writes its sections.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from specpilot.artifacts.profile import DEFAULT_PROFILE_CYCLES
from specpilot.drafting.cliargs import (add_pair_arguments, add_stop_arguments, batch_sizes, float_list,
                                        given_options, name_list, non_negative_float, non_negative_int, output_dir,
                                        positive_float, positive_int, probability, run_folder, say, seed)
from specpilot.drafting.checks import check_prompt_lengths, prompt_room
from specpilot.eval.suites import CHAT_TEMPLATE_MODES
# the names of specpilot.eval.methods.METHODS, written out so that parsing arguments never imports torch
# (tests/test_bad_options.py keeps the two equal)
METHODS = ("ar", "hf_generate", "hf_assisted", "fixed", "grid", "batch_table", "ddd", "svip", "confidence",
           "hf_heuristic", "ltd", "depth_only", "size_only", "ltd_guarded")

_methods = name_list(METHODS, "method")


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


def _decide(text: str) -> tuple[str, str]:
    names = _methods(text)
    if len(names) != 2:
        raise argparse.ArgumentTypeError(f"expected METHOD,BASELINE (two method names), got {text!r}")
    return names[0], names[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default=None,
                        help="bundled suite (train, validation, heldout, heldout_code) or a path to a "
                             ".jsonl / .json / .txt (default: the held-out suite that matches the pair: "
                             "heldout_code for the embedded pair or a code model, heldout for a general-purpose "
                             "target)")
    parser.add_argument("--split", default=None, help="keep only prompts of this split (default: all)")
    parser.add_argument("--chat-template", choices=CHAT_TEMPLATE_MODES, default="auto",
                        help="send prompts through the target tokenizer's chat template: auto = natural-language "
                             "prompts when the tokenizer has one (code completions stay raw), on = every prompt, "
                             "off = none")
    parser.add_argument("--methods", type=_methods, default=None,
                        help=f"comma list (default: all available): {', '.join(METHODS)}; `ar` always runs; a "
                             "method named here that cannot run is an error")
    parser.add_argument("--temperatures", type=float_list(non_negative_float), default=(0.0, 1.0),
                        help="comma list of sampling temperatures, 0 = greedy")
    parser.add_argument("--sampled-methods", type=_methods, default=None,
                        help="comma list of the methods run at temperatures > 0 (default: all of --methods)")
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="top-k when sampling (0: off)")
    parser.add_argument("--top-p", type=probability, default=1.0, help="top-p when sampling (1: off)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens generated per prompt")
    add_stop_arguments(parser, what="every method's generation of a prompt")
    parser.add_argument("--rounds", type=_rounds, default="auto",
                        help="rounds over all prompts: N, or auto (default): until the --decide pair's 95%% interval "
                             "is within --target-half-width, they made the same decisions, or --time-budget is spent")
    parser.add_argument("--min-rounds", type=positive_int, default=2,
                        help="fewest rounds with --rounds auto, run even past --time-budget; with nothing to decide "
                             "(every prompt's output degenerate, or a deciding method missing) the rounds stop after "
                             "--full-rounds")
    parser.add_argument("--max-rounds", type=positive_int, default=20, help="most rounds with --rounds auto")
    parser.add_argument("--time-budget", type=positive_float, default=None,
                        help="seconds for the whole evaluation (default: none); after --min-rounds, another round "
                             "starts only if it fits")
    parser.add_argument("--target-half-width", type=positive_float, default=0.015,
                        help="stop when the deciding interval is within +- this fraction")
    parser.add_argument("--decide", type=_decide, default=("ltd", "grid"),
                        help="the deciding pair METHOD,BASELINE (default: ltd,grid)")
    parser.add_argument("--full-rounds", type=positive_int, default=1,
                        help="rounds in which every method runs; later rounds run ar and the deciding pair")
    parser.add_argument("--repeats", dest="rounds", type=positive_int, default=argparse.SUPPRESS,
                        help="old name of a fixed --rounds N (default: unset, --rounds applies)")
    parser.add_argument("--replay-dir", type=output_dir, default=None,
                        help="record (or reuse) greedy traces of the prompts here and report exact replay beside "
                             "live (default: no replay)")
    parser.add_argument("--processes", type=non_negative_int, default=0,
                        help="with --replay-dir: record its greedy trace on N local processes side by side (one "
                             "torch thread each; recording reads no clock), then measure everything else in this "
                             "process alone (default: 0, this process records; not with --ray)")
    parser.add_argument("--profile-cycles", type=non_negative_int, default=DEFAULT_PROFILE_CYCLES,
                        help="with --replay-dir: decode the profile prompts again until the latency profile "
                             "re-measured for replay holds at least N cycles (0: one pass)")
    parser.add_argument("--check-profile", action="append", default=[], metavar="PROFILE_JSON",
                        help="with --replay-dir: check this latency profile against the live runs (repeatable; "
                             "default: none)")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed warm-up runs per method")
    parser.add_argument("--concurrency", type=positive_int, default=1,
                        help="also run N streams at once and report speedup/latency under that load")
    parser.add_argument("--batch-sizes", type=batch_sizes, default=None,
                        help="comma list of batch sizes (e.g. 1,2,4,8,16): decode the prompts in batches of each "
                             "size with every method vs batched ar, at each of --temperatures (sampled: "
                             "per-sequence seeds) (default: none, one sequence at a time)")
    add_pair_arguments(parser)
    parser.add_argument("--grid", default=None,
                        help="grid-search result JSON (enables methods `grid`, and `batch_table` when it has a "
                             "per_batch_size table; default: none)")
    parser.add_argument("--run", dest="run_dir", type=run_folder, default=None,
                        help="trained run dir (enables `ltd`, `depth_only`, `size_only`, and `ltd_guarded` when "
                             "it has a batch guard (train --batch-sizes); its tree is used; default: none)")
    parser.add_argument("--out", type=output_dir, default="eval_out",
                        help="output folder (checked before anything is measured)")
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="evaluate only the first N prompts (default: all)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of sampling and of the bootstrap")
    parser.add_argument("--width", type=positive_int, default=None,
                        help="draft tree beam width W (default: the --run's, else 8)")
    parser.add_argument("--max-depth", type=positive_int, default=None,
                        help="most draft levels per cycle (default: the --run's, else 12)")
    parser.add_argument("--max-size", type=positive_int, default=None,
                        help="most candidates verified per cycle (default: the --run's largest size action, else 64)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--wandb", default=None, choices=["online", "offline", "disabled"],
                        help="wandb mode of the evaluation's run in OUT/wandb: the report's numbers as its summary "
                             "and every option as its config (default: $WANDB_MODE, else offline)")
    parser.add_argument("--truncate-prompts", action="store_true",
                        help="keep the last tokens of prompts too long for the context, and say so (default: refuse "
                             "them)")


@dataclass
class EvalPlan:
    """What `prepare` checked: the prompts, the methods (None: all available), the tree, the deciding pair."""

    prompts: list
    methods: list[str] | None
    sampled: list[str] | None
    tree: object
    decide: tuple[str, str]
    suite: dict | None = None  # {"name", "chosen_by"}: for the report


def prepare(args: argparse.Namespace) -> EvalPlan:
    """Everything that can be checked without a model, before anything is measured (see the module docstring)."""
    from specpilot.drafting.folder_lock import being_written, check_not_in_use
    from specpilot.envs.profile import LatencyProfile
    from specpilot.eval.inputs import RUN_DTYPE_SOURCE, check_methods, requested_methods, resolve_tree, run_dtype
    from specpilot.eval.rounds import RoundPlan
    from specpilot.drafting.pair import load_tokenizer
    from specpilot.eval.suites import choose_suite, load_suite, with_chat_template

    suite = choose_suite(args.suite, getattr(args, "target", None))
    prompts = load_suite(suite["name"], split=args.split)
    if args.limit is not None:
        prompts = prompts[: args.limit]
    if not any(t > 0 for t in args.temperatures):
        given = [o for o, v, off in (("--top-k", args.top_k, 0), ("--top-p", args.top_p, 1.0)) if v != off]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise ValueError(f"{' and '.join(given)} {verb} only when sampling, but --temperatures "
                             f"{','.join(f'{t:g}' for t in args.temperatures)} is greedy only: add a temperature > 0, "
                             "or drop them")
    if {"--repeats", "--rounds"} <= given_options(args):  # both set args.rounds: the later one would silently win
        raise ValueError("--repeats is the old name of --rounds: give one of them")
    _check_round_options(args)
    ending = [o for o, given in (("--stop", args.stop), ("--stop-token-id", args.stop_token_id),
                                 ("--ignore-eos", args.ignore_eos)) if given]
    if ending and args.replay_dir:
        raise ValueError(f"--replay-dir cannot be combined with {', '.join(ending)}: replay's traces are greedy "
                         "decodings to the end token or --max-new-tokens; drop one of them")
    if args.processes and not args.replay_dir:
        raise ValueError("--processes records the --replay-dir trace on processes side by side: give --replay-dir, "
                         "or drop --processes (live measurements always run in this process alone)")
    if args.processes and getattr(args, "ray", None):
        raise ValueError("--processes records on local processes and --ray on Ray workers: give one of them")
    if args.check_profile and not args.replay_dir:
        raise ValueError("--check-profile needs --replay-dir (the profile is checked against replay of the runs)")
    if "--profile-cycles" in given_options(args) and not args.replay_dir:
        raise ValueError("--profile-cycles sets the latency profile replay uses: give --replay-dir, or drop "
                         "--profile-cycles (live measurements need no profile)")
    checked = [(path, LatencyProfile.load(path)) for path in args.check_profile]
    # the round plan's own checks (e.g. --min-rounds above --max-rounds) before the replay recording, not after it
    RoundPlan.make(args.rounds, min_rounds=args.min_rounds, max_rounds=args.max_rounds, time_budget_s=args.time_budget,
                   target_half_width=args.target_half_width, decide=tuple(args.decide), full_rounds=args.full_rounds)
    if getattr(args, "batch_sizes", None):
        check_batch_options(args)
    tree = resolve_tree(args.run_dir, width=args.width, max_depth=args.max_depth, max_size=args.max_size)
    for path, profile in checked:  # replay of the --replay-dir trace would refuse it, but only after recording it
        if profile.max_depth < tree.max_depth:
            raise ValueError(f"--check-profile {path} covers draft depths up to {profile.max_depth}, but this "
                             f"evaluation's tree drafts up to {tree.max_depth}: give a profile measured with this "
                             "tree (or --max-depth)")
    check_not_in_use(args.out, what="--out")  # refused in its one line, before any note
    if args.replay_dir:
        check_not_in_use(args.replay_dir, what="--replay-dir")
    if args.run_dir is not None and (writer := being_written(args.run_dir)) is not None:
        say(f"note: --run {args.run_dir} is being written by another specpilot run ({writer}): its policies are read "
            "as they are now and may change after this evaluation")
    if hasattr(args, "dtype"):  # the run's dtype unless one is asked for (the costs its policies were tuned for)
        asked = args.dtype
        args.dtype, note = run_dtype(args.run_dir, getattr(args, "device", None), args.dtype)
        if asked is None and args.dtype is not None:  # the pair's dtype_reason says so, not "asked for"
            args.dtype_source = RUN_DTYPE_SOURCE
        if note:
            say(f"note: {note}")
    check_methods(requested_methods(args.methods, args.sampled_methods, grid=args.grid, run_dir=args.run_dir),
                  grid=args.grid, run_dir=args.run_dir)
    _report_logger(args, None).check_folders()  # a file where OUT/tb goes: said now, not after measuring
    check_report_files(args.out, args.temperatures)
    prompts, suite["chat_template"] = with_chat_template(prompts, load_tokenizer(getattr(args, "target", None)),
                                                         args.chat_template)
    return EvalPlan(prompts, args.methods, args.sampled_methods, tree, tuple(args.decide), suite)


def _check_round_options(args: argparse.Namespace) -> None:
    """Options the round plan would take and ignore, or a deciding pair that decides nothing: refused."""
    given = given_options(args)
    if args.rounds != "auto":
        auto_only = [o for o in ("--min-rounds", "--max-rounds", "--target-half-width") if o in given]
        if auto_only:
            verb = "applies" if len(auto_only) == 1 else "apply"
            raise ValueError(f"{', '.join(auto_only)} {verb} only with --rounds auto, but --rounds {args.rounds} "
                             "runs that many rounds: drop them, or use --rounds auto")
    elif args.min_rounds > args.max_rounds:
        raise ValueError(f"--min-rounds {args.min_rounds} exceeds --max-rounds {args.max_rounds}: raise "
                         "--max-rounds, or lower --min-rounds")
    method, baseline = args.decide
    if method == baseline:
        raise ValueError(f"--decide {method},{baseline} compares a method with itself: name two different methods")
    if "--decide" in given and args.methods is not None:
        running = {"ar", *args.methods, *(args.sampled_methods or [])}  # `ar` always runs
        missing = [m for m in (method, baseline) if m not in running]
        if missing:
            raise ValueError(f"--decide names {' and '.join(missing)}, which --methods {','.join(args.methods)} does "
                             f"not run: add {'it' if len(missing) == 1 else 'them'} to --methods, or decide on two "
                             "methods that run")
    if args.sampled_methods is not None and not any(t > 0 for t in args.temperatures):
        raise ValueError(f"--sampled-methods names the methods run at temperatures > 0, but --temperatures "
                         f"{','.join(f'{t:g}' for t in args.temperatures)} is greedy only: add a temperature > 0, "
                         "or drop --sampled-methods")


def check_replay_dir(replay_dir, identity: dict, *, tree=None, max_new_tokens: int | None = None,
                     num_prompts: int | None = None) -> None:
    """--replay-dir caches this pair's held-out trace (re-recorded there when the prompts, tree or budget changed);
    a trace of another pair there is someone's data, never overwritten: ContractError naming both pairs; so is a
    trace evaluation did not record there (`replay_eval.check_replaceable_trace`), unless it is the one asked for."""
    from specpilot.artifacts.contract import check_pair
    from specpilot.artifacts.trace import TraceHeader, is_trace
    from specpilot.eval.replay_eval import check_replaceable_trace

    if replay_dir is None or not is_trace(replay_dir):
        return
    try:
        recorded = TraceHeader.load(replay_dir).pair
    except (OSError, ValueError):  # unreadable: re-recorded, as before
        return
    check_pair(recorded, identity, expected_from=f"the trace in --replay-dir {replay_dir}",
               got_from="the pair loaded for evaluation",
               fix="give this pair's or an empty --replay-dir (that trace is left as it is)")
    if tree is not None and max_new_tokens is not None:
        check_replaceable_trace(replay_dir, tree=tree, max_new_tokens=max_new_tokens, num_prompts=num_prompts)


def _records_trace(args: argparse.Namespace) -> bool:
    """Whether --processes has a trace to record: --replay-dir holds none yet (a trace there is reused, or recorded
    again in this process when it was made for other prompts)."""
    from specpilot.artifacts.trace import is_trace

    return args.processes >= 2 and args.replay_dir is not None and not is_trace(args.replay_dir)


def check_batch_options(args: argparse.Namespace) -> None:
    """--batch-sizes runs the batched evaluation (in this process): options it cannot honour are refused."""
    conflicts = [o for o, given in (("--replay-dir", args.replay_dir), ("--check-profile", args.check_profile),
                                    ("--concurrency", args.concurrency > 1), ("--ray", getattr(args, "ray", None)))
                 if given]
    if conflicts:
        raise ValueError(f"--batch-sizes cannot be combined with {', '.join(conflicts)}: the batched evaluation "
                         "decodes batches in this process; drop them")


def run(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from specpilot.drafting.decoder import SpeculativeDecoder
    from specpilot.drafting.executor import LocalExecutor, prompt_lengths
    from specpilot.drafting.folder_lock import output_lock
    from specpilot.drafting.stopping import check_stop_token_ids
    from specpilot.envs.cli import trace_processes
    from specpilot.eval.full import full_evaluation
    from specpilot.eval.inputs import EvalInputError, check_inputs_pair, check_methods
    from specpilot.eval.methods import assisted_refusal_on
    from specpilot.train.scale.cluster_cli import open_executor

    plan = prepare(args)
    if args.batch_sizes:
        with output_lock(args.out, what="--out"):
            return run_batches(args, plan)
    with output_lock(args.out, what="--out"), \
            output_lock(args.replay_dir, what="--replay-dir") if args.replay_dir else nullcontext(), \
            open_executor(args) as executor, \
            trace_processes(executor, args) if _records_trace(args) else nullcontext() as processes:
        if isinstance(executor, LocalExecutor):  # the tree fits the drafter (width <= its vocabulary)
            SpeculativeDecoder(executor.pair, plan.tree)
        identity = executor.workers[0]["pair"]
        check_inputs_pair(identity, run_dir=args.run_dir, grid=args.grid)  # the run / grid were made on this pair
        check_stop_token_ids(args.stop_token_id, identity["vocab_size"])  # before OUT's old plots are cleared
        check_replay_dir(args.replay_dir, identity, tree=plan.tree, max_new_tokens=args.max_new_tokens,
                         num_prompts=len(plan.prompts))
        methods = plan.methods
        # hf_assisted, one rule everywhere (eval.methods._assistant): transformers' assisted generation drafts with
        # a separate draft LM, the embedded one for the embedded EAGLE-3 pair; another EAGLE-3 pair has none, so the
        # method is refused when named (prepare() checked the --run / --grid methods already) and skipped with a
        # meta.skipped entry otherwise
        local = executor.pair if isinstance(executor, LocalExecutor) else None
        if (identity["drafter"] == "eagle3" and not identity["name"].startswith("specpilot-default")
                and (local is None or local.draft is None)):
            asked = dict.fromkeys([*(methods or []), *(plan.sampled or [])])
            check_methods([m for m in asked if m == "hf_assisted"], drafter_kind="eagle3")
        if "hf_assisted" in [*(methods or []), *(plan.sampled or [])]:  # a draft padded unlike the target
            refusal = assisted_refusal_on(executor)
            if refusal is not None:
                raise EvalInputError(refusal)
        # counted by a worker (on Ray the driver has no pair): refused now, before any measuring
        lengths, context = prompt_lengths(executor, [p.prompt for p in plan.prompts])
        notes = check_prompt_lengths(plan.prompts, lengths, context=context, max_new_tokens=args.max_new_tokens,
                                     max_depth=plan.tree.max_depth, truncate=args.truncate_prompts)
        devices = ", ".join(sorted({w["device"] for w in executor.workers}))
        say(f"evaluating {len(plan.prompts)} prompts of suite {plan.suite['name']} ({plan.suite['chosen_by']}) on "
            f"{identity['name']} ({len(executor)} worker(s): {devices}, {executor.workers[0]['dtype']}), "
            f"tree {plan.tree}")
        for note in notes:
            say(note)
        clear_outputs(args.out)
        result, paths = full_evaluation(
            plan.prompts, executor=executor, tree=plan.tree, out_dir=args.out, trace_dir=args.replay_dir,
            replay=bool(args.replay_dir), check_profiles={p: p for p in args.check_profile},
            time_budget_s=args.time_budget, rounds=args.rounds, full_rounds=args.full_rounds,
            temperatures=args.temperatures, max_new_tokens=args.max_new_tokens, grid=args.grid,
            run_dir=args.run_dir, methods=methods, sampled_methods=plan.sampled, seed=args.seed,
            plots=not args.no_plots, progress=say, top_k=args.top_k, top_p=args.top_p, min_rounds=args.min_rounds,
            max_rounds=args.max_rounds, target_half_width=args.target_half_width, decide=plan.decide,
            warmup=args.warmup, concurrency=args.concurrency, suite=plan.suite, stop_strings=args.stop,
            stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos, trace_workers=processes,
            profile_cycles=args.profile_cycles)
    for name, reason in result.meta["skipped"].items():
        say(f"skipped {name}: {reason}")
    if result.meta["executor"]["retried_prompts"]:
        say(f"retried prompts (their worker failed once): {result.meta['executor']['retried_prompts']}")
    _print_summary(paths["json"])
    log_report(args, paths["json"])
    print(f"wrote {paths['md']} and {paths['json']}")
    return 0


def run_batches(args: argparse.Namespace, plan: EvalPlan) -> int:
    """`eval --batch-sizes`: `specpilot.eval.batched.evaluate_batches` on the loaded pair at each of --temperatures
    (--sampled-methods at T > 0; --time-budget shared evenly by the temperatures still to run), one report section
    per (temperature, batch size) (report.json "batch_sizes", report.md tables), and the tables printed."""
    import time

    from specpilot.drafting.cliargs import dtype_label, load_pair
    from specpilot.drafting.stopping import check_stop_token_ids, stopping_options
    from specpilot.eval.batched import evaluate_batches
    from specpilot.eval.inputs import check_inputs_pair
    from specpilot.eval.exactness import identity_line
    from specpilot.eval.report import batch_lines, report_identity, write_report
    from specpilot.eval.rounds import RoundPlan
    from specpilot.eval.runner import build_meta
    from specpilot.eval.suites import prompt_mix

    pair = load_pair(args)
    check_inputs_pair(pair.identity(), run_dir=args.run_dir, grid=args.grid)
    check_stop_token_ids(args.stop_token_id, pair.vocab_size)  # before OUT's old plots are cleared
    ids = {p.prompt: pair.encode(p.prompt) for p in plan.prompts}
    lengths = {text: len(tokens) for text, tokens in ids.items()}
    for note in check_prompt_lengths(plan.prompts, lengths, context=pair.max_context,
                                     max_new_tokens=args.max_new_tokens, max_depth=plan.tree.max_depth,
                                     truncate=args.truncate_prompts):
        say(note)
    limit = prompt_room(pair.max_context, args.max_new_tokens, plan.tree.max_depth)
    tokens = [ids[p.prompt][-limit:] for p in plan.prompts]
    methods = plan.methods if plan.methods is not None else list(METHODS)
    temperatures = list(dict.fromkeys(float(t) for t in args.temperatures))
    say(f"evaluating {len(plan.prompts)} prompts of suite {plan.suite['name']} in batches of "
        f"{','.join(map(str, args.batch_sizes))} on {pair.name} ({pair.device}), tree {plan.tree}, temperatures "
        f"{','.join(f'{t:g}' for t in temperatures)}")
    say(f"dtype {dtype_label(pair.dtype, getattr(pair, 'dtype_reason', ''))}")
    clear_outputs(args.out)
    started, results = time.perf_counter(), []
    for j, t in enumerate(temperatures):
        budget = (None if args.time_budget is None else
                  max(args.time_budget - (time.perf_counter() - started), 1e-3) / (len(temperatures) - j))
        rounds = RoundPlan.make(args.rounds, min_rounds=args.min_rounds, max_rounds=args.max_rounds,
                                time_budget_s=budget, target_half_width=args.target_half_width,
                                decide=tuple(args.decide), full_rounds=args.full_rounds)
        names = plan.sampled if t > 0 and plan.sampled is not None else methods
        results.append(evaluate_batches(tokens, pair=pair, batch_sizes=args.batch_sizes, tree=plan.tree,
                                        methods=names, max_new_tokens=args.max_new_tokens, plan=rounds,
                                        warmup=args.warmup, seed=args.seed, grid=args.grid, run_dir=args.run_dir,
                                        temperature=t, top_k=args.top_k, top_p=args.top_p, stop_strings=args.stop,
                                        stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos,
                                        progress=lambda msg, t=t: say(f"T={t:g}: {msg}")))
    sections = [s for r in results for s in r["batch_sizes"]]
    described = {n: d for r in results for n, d in r["methods"].items()}
    skipped = {n: why for r in results for n, why in r["skipped"].items()}
    repeats = max(s["rounds"]["rounds"] for s in sections)
    meta = build_meta(pair, tree=plan.tree, prompts=plan.prompts, temperatures=tuple(temperatures),
                      top_k=args.top_k, top_p=args.top_p, max_new_tokens=args.max_new_tokens, repeats=repeats,
                      warmup=args.warmup, concurrency=1, seed=args.seed, methods=described, skipped=skipped,
                      stopping=stopping_options(args.stop, args.stop_token_id, args.ignore_eos))
    meta.update(prompt_mix=prompt_mix(list(plan.prompts)), suite=plan.suite,
                batch_protocol=[r["protocol"] for r in results])
    paths = write_report([], meta, args.out, plots=False, analysis={"batch_sizes": sections})
    for name, reason in skipped.items():
        say(f"skipped {name}: {reason}")
    print("\n".join(batch_lines(sections, meta["dtype"])))
    # a report, not a crash: the same rule as one sequence at a time (rounding in half precision, a bug in fp32)
    identity = identity_line(report_identity({"meta": meta, "batch_sizes": sections}))
    if identity:
        say(f"{identity} (report: mismatched_sequences)")
    log_report(args, paths["json"])
    print(f"wrote {paths['md']} and {paths['json']}")
    return 0


# the files an evaluation writes into --out beside report.json / report.md (eval/plots.py): cleared first, so a
# folder reused from an earlier evaluation never shows its stale plots
PLOT_PATTERNS = ("forest_speedup_T*.png", "forest_groups_T*.png", "decisions_T*.png", "time_split_T*.png",
                 "choices_T*.png")


def check_report_files(out: str, temperatures) -> None:
    """report.json, report.md and the plots of each temperature can be written in `out`: a folder of one of their
    names is refused before anything is measured, not found when the report is written at the end."""
    from pathlib import Path

    from specpilot.drafting.files import check_outputs

    out = Path(out)
    files = [out / "report.json", out / "report.md"]
    files += [out / pattern.replace("*", f"{t:g}") for t in temperatures for pattern in PLOT_PATTERNS]
    check_outputs({path: "file" for path in files}, what="--out",
                  fix="move it away, or give another --out (nothing was measured)")


def clear_outputs(out: str) -> None:
    from pathlib import Path

    for pattern in PLOT_PATTERNS:
        for path in Path(out).glob(pattern):
            path.unlink(missing_ok=True)


def _report_logger(args: argparse.Namespace, config: dict | None):
    from pathlib import Path

    from specpilot.train.rl.logging import RunLogger

    out = Path(args.out)
    return RunLogger(out, config, mode=args.wandb, name=f"{out.resolve().name}-eval", resume=False,
                     folder_option="--out")


def log_report(args: argparse.Namespace, report_json: str) -> None:
    """The evaluation as a wandb run in OUT/wandb (and TensorBoard text in OUT/tb): every option as its config, the
    report's numbers (`summary.report_metrics`) as its summary. A new run per evaluation; --wandb disabled writes
    TensorBoard only."""
    from specpilot.artifacts.report import read_report
    from specpilot.drafting.cliargs import options_config
    from specpilot.eval.summary import report_metrics

    config = options_config(args, "eval")
    with _report_logger(args, config) as logger:
        logger.summarize(report_metrics(read_report(report_json)))


def _print_summary(report_json: str) -> None:
    from specpilot.artifacts.report import read_report
    from specpilot.eval.summary import format_summary_lines, summarise_report

    report = read_report(report_json)
    temperatures = sorted({s["temperature"] for s in report.get("summary") or []}) or [0.0]
    first, *others = temperatures
    if others:
        print(f"T={first:g}:")
    print("\n".join(format_summary_lines(summarise_report(report, temperature=first))))
    for t in others:  # the method table at every other temperature (verdicts above cover them all)
        print(f"T={t:g}:")
        print("\n".join(format_summary_lines({"methods": summarise_report(report, temperature=t)["methods"]})))
