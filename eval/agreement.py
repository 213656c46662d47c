"""`specpilot agreement`: how often greedy speculative output in half precision equals autoregressive output, where
it leaves it, and whether what it says instead is any less likely: "lossless up to rounding", measured.

In fp32 greedy speculative output equals the target's greedy output token for token (the tests prove it). In bf16 or
fp16 a tree forward and a one-token forward round differently, so where the target's top-1 and top-2 logits nearly
tie the two can pick different tokens and the texts part. Over a suite, for each prompt:

    first_divergence           first position where speculative output differs from same-dtype AR (None: identical)
    first_divergence_vs_fp32   ... from fp32 AR (the target's own greedy text, unrounded)
    ar_vs_fp32                 ... same-dtype AR from fp32 AR: what rounding does to AR itself, the yardstick
    margin_fp32 / margin_half  the target's top-1/top-2 logit margin at the divergence (one full forward over the
                               shared prefix, in fp32 and in the dtype); margin_scales: margin_half in rounding
                               scales eps(dtype) * max(1, |top-1|), the near-tie guard's unit (drafting/verify.py)
    logprob_spec / logprob_ar  mean log-probability per token, under the fp32 target, of each continuation from the
                               divergence on: equal in expectation when the divergence is rounding, not error
    *_vs_fp32 / *_fp32_ar      the same at the divergence from fp32 AR (margin under fp32, both log-probs)

`agreement_report(pair, prompts, reference=fp32 pair)` returns the dict `specpilot agreement` writes to
DIR/agreement.json (`dtype`, `guard`, `n_prompts`, `identical_share`, per-prompt rows, and summaries); the guard
(`--guard on|off|auto`, TreeConfig.near_tie) is reported with what it cost: extra one-token forwards per token.
"""
from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import torch

from specpilot.drafting.cliargs import add_pair_arguments, non_negative_float, output_dir, positive_int, say

GUARD_CHOICES = ("on", "off", "auto")
AGREEMENT_MAX_DEPTH = 12  # the default tree's deepest draft: prompts need room for it beside the budget
AGREEMENT_MAX_SIZE = 64  # the default tree's largest verification


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where the token lists differ (the shorter one's length when one is a prefix of the other), None
    when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _rows(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """fp32 logits [len(continuation), V] of one full forward: row j predicts continuation[j]."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + continuation], dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(continuation)].float()


def mean_logprob(model, prompt: list[int], continuation: list[int], start: int = 0) -> float | None:
    """Mean log-probability (nats/token) of continuation[start:] under `model` given prompt + continuation[:start]."""
    if start >= len(continuation):
        return None
    rows = torch.log_softmax(_rows(model, prompt, continuation), dim=-1)
    picked = rows[torch.arange(len(continuation)), torch.tensor(continuation, device=rows.device)]
    return float(picked[start:].mean())


def margin_at(model, prompt: list[int], prefix: list[int], dtype: torch.dtype) -> dict:
    """The target's top-1/top-2 margin predicting the token after prompt + prefix, raw and in rounding scales of
    `dtype` (eps * max(1, |top-1|))."""
    row = _rows(model, prompt, prefix + [0])[-1]
    top = torch.topk(row, 2).values
    margin = float(top[0] - top[1])
    scale = float(torch.finfo(dtype).eps) * max(1.0, abs(float(top[0])))
    return {"margin": margin, "scales": margin / scale, "top1": int(row.argmax())}


def _summary(values: list) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0}
    return {"n": len(values), "mean": statistics.fmean(values), "median": statistics.median(values),
            "min": min(values), "max": max(values)}


def agreement_report(pair, prompts: list, *, reference=None, near_tie: float | None = None, tree=None,
                     depth: int | None = None, size: int | None = None, max_new_tokens: int = 64,
                     progress=None) -> dict:
    """The agreement of greedy speculative decoding of `pair` with AR decoding in its dtype and with AR decoding of
    `reference` (an fp32 load of the same target; `pair` itself when it is fp32), over `prompts` (suite Prompts
    or texts). near_tie: the guard's width (None: the dtype's default, 0: off); tree / depth / size: the static
    configuration decoded with (default: W4 tree, FixedController's CPU or GPU default)."""
    from specpilot.drafting import SpeculativeDecoder, TreeConfig, autoregressive_generate
    from specpilot.drafting.control import fits_tree
    from specpilot.drafting.cycle import run_generation
    from specpilot.drafting.pair import half_support
    from specpilot.policies import FixedController

    reference = pair if reference is None else reference
    if reference.dtype != torch.float32:
        raise ValueError(f"the reference pair must be fp32 (got {reference.dtype}): it is the unrounded yardstick")
    base = tree or TreeConfig(width=8 if pair.device.type == "cuda" else 4, max_depth=AGREEMENT_MAX_DEPTH,
                               max_size=AGREEMENT_MAX_SIZE)
    tree = TreeConfig(width=base.width, max_depth=base.max_depth, max_size=base.max_size,
                      sampled_children=base.sampled_children, near_tie=near_tie if near_tie is not None
                      else base.near_tie)
    controller = FixedController(depth, size, device=str(pair.device))
    fits_tree(controller, tree)  # a depth or size beyond the tree: refused, not capped while reported as asked
    decoder = SpeculativeDecoder(pair, tree)
    units = tree.near_tie_units(pair.dtype)
    dtype_name = str(pair.dtype).removeprefix("torch.")
    rows, spec_s, ar_s = [], 0.0, 0.0
    totals = {"tokens": 0, "cycles": 0, "near_ties": 0, "target_forwards": 0}
    for k, item in enumerate(prompts):
        text = getattr(item, "prompt", item)
        ids = pair.encode(text)
        t0 = time.perf_counter()
        ar = autoregressive_generate(pair, ids, max_new_tokens=max_new_tokens).tokens
        t1 = time.perf_counter()
        session = decoder.start(ids, max_new_tokens=max_new_tokens)
        run_generation(session, controller)
        t2 = time.perf_counter()
        spec = list(session.new_tokens)
        ar_s, spec_s = ar_s + t1 - t0, spec_s + t2 - t1
        ar32 = ar if reference is pair else autoregressive_generate(reference, ids, max_new_tokens=max_new_tokens
                                                                    ).tokens
        div = first_divergence(spec, ar)
        row = {"id": getattr(item, "id", str(k)), "tokens": len(spec), "first_divergence": div,
               "first_divergence_vs_fp32": first_divergence(spec, ar32), "ar_vs_fp32": first_divergence(ar, ar32),
               "cycles": len(session.cycles), "near_ties": session.near_ties}
        if div is not None and div < min(len(spec), len(ar)):
            half = margin_at(pair.target, ids, spec[:div], pair.dtype)
            full = margin_at(reference.target, ids, spec[:div], pair.dtype)
            row.update(margin_half=half["margin"], margin_scales=half["scales"], margin_fp32=full["margin"],
                       fp32_top1_is="spec" if full["top1"] == spec[div] else "ar" if full["top1"] == ar[div]
                       else "neither",
                       logprob_spec=mean_logprob(reference.target, ids, spec, div),
                       logprob_ar=mean_logprob(reference.target, ids, ar, div))
        div32 = row["first_divergence_vs_fp32"]
        if div32 is not None and div32 < min(len(spec), len(ar32)):  # where the dtype's text left fp32's
            full = margin_at(reference.target, ids, spec[:div32], pair.dtype)
            row.update(margin_fp32_at_fp32_divergence=full["margin"],
                       logprob_spec_vs_fp32=mean_logprob(reference.target, ids, spec, div32),
                       logprob_fp32_ar=mean_logprob(reference.target, ids, ar32, div32))
        rows.append(row)
        totals["tokens"] += len(spec)
        totals["cycles"] += len(session.cycles)
        totals["near_ties"] += session.near_ties
        totals["target_forwards"] += len(session.cycles) + session.near_ties
        if progress:
            progress(f"  [{k + 1}/{len(prompts)}] {row['id']}: first divergence {div} (vs fp32 AR "
                     f"{row['first_divergence_vs_fp32']}, AR vs fp32 AR {row['ar_vs_fp32']}), "
                     f"{session.near_ties} near ties guarded")
    n = len(rows)
    diverged = [r for r in rows if "logprob_spec" in r]
    share = (lambda key: sum(r[key] is None for r in rows) / n if n else float("nan"))
    deltas = [r["logprob_spec"] - r["logprob_ar"] for r in diverged if r["logprob_ar"] is not None]
    support, why = half_support(pair.dtype, str(pair.device))
    return {
        "dtype": dtype_name, "dtype_reason": getattr(pair, "dtype_reason", ""), "support": support,
        "support_reason": why,
        "guard": "on" if units > 0 else "off", "near_tie_units": units, "n_prompts": n,
        "identical_share": share("first_divergence"),
        "identical_share_vs_fp32_ar": share("first_divergence_vs_fp32"),
        "ar_identical_share_vs_fp32_ar": share("ar_vs_fp32"),
        "first_divergence": _summary([r["first_divergence"] for r in rows]),
        "first_divergence_vs_fp32_ar": _summary([r["first_divergence_vs_fp32"] for r in rows]),
        "ar_first_divergence_vs_fp32_ar": _summary([r["ar_vs_fp32"] for r in rows]),
        "margin_at_divergence": {"half": _summary([r["margin_half"] for r in diverged]),
                                 "scales": _summary([r["margin_scales"] for r in diverged]),
                                 "fp32": _summary([r["margin_fp32"] for r in diverged])},
        "vs_fp32_ar": {"margin_fp32": _summary([r.get("margin_fp32_at_fp32_divergence") for r in rows]),
                       "logprob_spec_minus_fp32_ar": _summary([r["logprob_spec_vs_fp32"] - r["logprob_fp32_ar"]
                                                               for r in rows if "logprob_spec_vs_fp32" in r])},
        "fp32_prefers": {w: sum(r["fp32_top1_is"] == w for r in diverged) for w in ("spec", "ar", "neither")},
        "logprob_fp32": {"spec": _summary([r["logprob_spec"] for r in diverged]),
                         "ar": _summary([r["logprob_ar"] for r in diverged]),
                         "spec_minus_ar": _summary(deltas)},
        "cost": {**totals, "tau": totals["tokens"] / totals["cycles"] if totals["cycles"] else math.nan,
                 "target_forwards_per_token": totals["target_forwards"] / totals["tokens"] if totals["tokens"]
                 else math.nan,
                 "spec_s": spec_s, "ar_s": ar_s, "timing_note": "one pass, not interleaved: see benchmarks/"
                                                               "bench_dtype.py for speed"},
        "config": {"width": tree.width, "max_depth": tree.max_depth, "max_size": tree.max_size,
                   "depth": controller.depth, "size": controller.size, "max_new_tokens": max_new_tokens},
        "pair": {"name": pair.name, "drafter": pair.drafter_kind, "device": str(pair.device)},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "prompts": rows,
    }


def describe(report: dict) -> str:
    """One line: the headline numbers of an agreement report."""
    fd = report["first_divergence"]
    delta = report["logprob_fp32"]["spec_minus_ar"]
    text = (f"{report['dtype']} guard {report['guard']}: {report['identical_share']:.0%} of {report['n_prompts']} "
            f"prompts identical to {report['dtype']} AR, {report['identical_share_vs_fp32_ar']:.0%} to fp32 AR "
            f"(AR itself: {report['ar_identical_share_vs_fp32_ar']:.0%})")
    if fd.get("n"):
        text += f"; first divergence median {fd['median']:g}"
    if delta.get("n"):
        text += f"; fp32 log-prob spec - AR after it {delta['mean']:+.3f} nats/token"
    cost = report["cost"]
    return text + f"; {cost['target_forwards_per_token']:.3f} target forwards/token ({cost['near_ties']} near ties)"


# -- the command ---------------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specpilot.drafting.types import NEAR_TIE_ON

    add_pair_arguments(parser)
    parser.add_argument("--suite", default=None,
                        help="bundled suite (train, validation, heldout, heldout_code) or a path to a "
                             ".jsonl / .json / .txt (default: the held-out suite that matches the pair, as `eval` "
                             "picks it: heldout_code for the embedded pair or a code model, heldout for a "
                             "general-purpose target)")
    parser.add_argument("--task", default=None, help="keep only prompts of this task, e.g. code (default: all)")
    parser.add_argument("--limit", type=positive_int, default=None, help="first N prompts (default: all)")
    parser.add_argument("--guard", choices=GUARD_CHOICES, default="auto",
                        help="the near-tie guard: on, off, or auto (the dtype's default)")
    parser.add_argument("--near-tie", type=non_negative_float, default=None,
                        help="the guard's width in rounding scales when on (default: TreeConfig's NEAR_TIE_ON, "
                             f"{NEAR_TIE_ON:g})")
    parser.add_argument("--depth", type=positive_int, default=None, help="static draft depth (default: 4 on CPU)")
    parser.add_argument("--size", type=positive_int, default=None, help="static verification size (default: 12 "
                                                                        "on CPU)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens generated per prompt")
    parser.add_argument("--allow-emulated", action="store_true",
                        help="measure a half dtype this CPU only emulates (its rounding is torch's, not a native "
                             "kernel's; default: refuse)")
    parser.add_argument("--out", required=True, type=output_dir, help="folder for agreement.json")


def _check_support(args: argparse.Namespace) -> None:
    """Refuse, in one line, a half dtype this machine cannot compute in (or only emulates, unless allowed)."""
    from specpilot.drafting.pair import check_device, half_support, resolve_dtype

    device = check_device(args.device)
    if args.dtype is None or args.dtype == "auto":
        return  # the default / auto never picks a dtype the machine lacks
    dtype = resolve_dtype(args.dtype, device)[0]
    support, why = half_support(dtype, device)
    name = str(dtype).removeprefix("torch.")
    if support == "none" or (support == "emulated" and not args.allow_emulated):
        extra = "; pass --allow-emulated to measure torch's emulated rounding anyway" if support == "emulated" else ""
        raise ValueError(f"no native {name} on this machine ({why}){extra}")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specpilot.drafting.files import check_outputs
    from specpilot.drafting.folder_lock import output_lock

    if args.near_tie is not None and args.guard != "on":
        raise ValueError(f"--near-tie sets the guard's width, which applies only with --guard on (got --guard "
                         f"{args.guard}): add --guard on, or drop --near-tie")
    _check_support(args)
    for option, value, most in (("--depth", args.depth, AGREEMENT_MAX_DEPTH),
                                ("--size", args.size, AGREEMENT_MAX_SIZE)):
        if value is not None and value > most:
            raise ValueError(f"{option} {value} is beyond the agreement's tree (depth up to {AGREEMENT_MAX_DEPTH}, "
                             f"size up to {AGREEMENT_MAX_SIZE}): give {option} {most} or less")
    out = Path(args.out)
    check_outputs({out / "agreement.json": "file"}, what="--out",
                  fix="move it away, or give another --out (nothing was measured)")
    with output_lock(out, what="--out"):  # one agreement run at a time in a folder
        return _measure(args, out)


def _measure(args: argparse.Namespace, out) -> int:
    from specpilot.drafting.cliargs import load_pair
    from specpilot.drafting.checks import check_prompt_lengths
    from specpilot.drafting.files import atomic_write_json
    from specpilot.drafting.types import NEAR_TIE_ON
    from specpilot.eval.suites import BUNDLED_SUITES, choose_suite, load_suite

    suite = choose_suite(args.suite, getattr(args, "target", None))
    prompts = load_suite(suite["name"])
    if args.task:
        prompts = [p for p in prompts if p.task == args.task]
        if not prompts:
            tasks = ", ".join(sorted({p.task for p in load_suite(suite["name"])}))
            raise ValueError(f"suite {suite['name']!r} has no prompts of task {args.task!r} (its tasks: {tasks})")
    prompts = prompts[: args.limit] if args.limit else prompts
    pair = load_pair(args)
    # every prompt must fit before any is decoded (room for the budget and the deepest draft: agreement_report's
    # tree reaches depth 12), so a long last prompt does not throw away the finished ones
    bundled = suite["name"] if suite["name"] in BUNDLED_SUITES else None
    check_prompt_lengths(prompts, {p.prompt: len(pair.encode(p.prompt)) for p in prompts}, context=pair.max_context,
                         max_new_tokens=args.max_new_tokens, max_depth=AGREEMENT_MAX_DEPTH, truncate=False,
                         options=("--max-new-tokens",), bundled=bundled)
    reference = pair
    if pair.dtype != torch.float32:
        reference = load_pair(argparse.Namespace(**{**vars(args), "dtype": "float32"}))
    near_tie = {"on": args.near_tie if args.near_tie is not None else NEAR_TIE_ON, "off": 0.0, "auto": None}[args.guard]
    say(f"agreement of {pair.name} in {str(pair.dtype).removeprefix('torch.')} ({pair.dtype_reason or 'given'}) "
        f"on {len(prompts)} prompts of suite {suite['name']} ({suite['chosen_by']}), guard {args.guard}")
    report = agreement_report(pair, prompts, reference=reference, near_tie=near_tie, depth=args.depth,
                              size=args.size, max_new_tokens=args.max_new_tokens, progress=say)
    report["suite"], report["suite_chosen_by"] = suite["name"], suite["chosen_by"]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "agreement.json", report, indent=1)
    print(describe(report))
    print(f"wrote {out / 'agreement.json'}")
    return 0
