"""fp32 vs bf16 decoding side by side (not a test): AR fp32, AR bf16, the best static tree in each dtype, and a trained
run's `ltd` policies in bf16 (--run), in ONE interleaved run on held-out code prompts.

    .venv/bin/python benchmarks/bench_dtype.py [--drafter eagle|draft] [--prompts 6] [--max-new-tokens 64]
        [--repeats 3] [--cells 2:4,3:8,4:12,6:24] [--run RUN] [--guard UNITS] [--allow-emulated] [--out FILE]

1. `auto`'s decision on this machine (`resolve_dtype`: CPU flags, and where they allow it the micro-benchmark).
2. Selection (not timed into the result): each static cell DEPTH:SIZE (W4 tree) decodes 2 validation prompts once
   per dtype; the fastest cell per dtype is that dtype's "best static". Selecting on other prompts than the ones
   measured keeps the winner's luck out of its number.
3. Measurement: every method decodes every held-out code prompt each repeat, greedy, the order rotating per prompt
   and repeat; warm-up excluded; perf_counter around each call (CUDA synchronised). Speedups are over the fastest AR
   (pooled tokens/s ratio) with paired bootstrap 95% intervals over (prompt, repeat) units (`eval/stats.py`), and
   each method's greedy output is checked against AR in the same dtype.
Refuses a dtype the machine only emulates unless --allow-emulated (then the bf16 numbers measure torch's emulation).
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.pair import half_support, resolve_dtype
from specpilot.eval.stats import paired_ratio_interval
from specpilot.eval.suites import load_suite
from specpilot.policies import FixedController
from specpilot.drafting.timing import timed


def cells(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in part.split(":")) for part in text.split(",") if part.strip()]


def static_method(pair, depth, size, guard, max_new_tokens):
    tree = TreeConfig(width=4, max_depth=max(6, depth), max_size=max(32, size), near_tie=guard)
    decoder, controller = SpeculativeDecoder(pair, tree), FixedController(depth, size)
    return lambda ids: decoder.generate(ids, controller=controller, max_new_tokens=max_new_tokens)


def best_static(pair, grid, prompts, guard, max_new_tokens, say) -> tuple[int, int]:
    """The fastest (depth, size) of `grid` on `prompts` (one pass after a warm-up)."""
    speed = {}
    for depth, size in grid:
        run = static_method(pair, depth, size, guard, max_new_tokens)
        run(prompts[0][:8])  # warm-up
        tokens = seconds = 0.0
        for ids in prompts:
            out, s = timed(lambda: run(ids))
            tokens, seconds = tokens + out.num_tokens, seconds + s
        speed[(depth, size)] = tokens / seconds
    best = max(speed, key=speed.get)
    say(f"  {str(pair.dtype).removeprefix('torch.')} selection: " + ", ".join(
        f"D{d}:V{v} {t:.1f}" for (d, v), t in speed.items()) + f" tok/s -> D{best[0]}:V{best[1]}")
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", choices=["eagle", "draft"], default="eagle")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cells", type=cells, default=cells("2:4,3:8,4:12,6:24"))
    ap.add_argument("--run", default=None, help="a trained run: its ltd policies decode in bf16")
    ap.add_argument("--guard", type=float, default=None, help="near-tie guard width for bf16 (default: dtype's)")
    ap.add_argument("--allow-emulated", action="store_true")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    say = lambda *parts: print(*parts, flush=True)  # noqa: E731

    support, why = half_support(torch.bfloat16, args.device)
    if support == "none" or (support == "emulated" and not args.allow_emulated):
        say(f"bench_dtype: no native bfloat16 here ({why}); --allow-emulated measures torch's emulation anyway")
        return 2
    kwargs = {args.drafter: "embedded"}
    pairs = {"fp32": ModelPair.from_pretrained(device=args.device, dtype="float32", **kwargs),
             "bf16": ModelPair.from_pretrained(device=args.device, dtype="bfloat16", **kwargs)}
    auto = resolve_dtype("auto", args.device, model=pairs["fp32"].target)
    say(f"{pairs['fp32'].name} ({args.drafter}) on {args.device}, "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    say(f"bf16 support: {support} ({why}); auto -> {auto[1]}")
    code = [p for p in load_suite("heldout") if p.task == "code"][: args.prompts]
    selection = [p.prompt for p in load_suite("validation")][:2]
    kw = dict(max_new_tokens=args.max_new_tokens)
    ids = {k: [pair.encode(p.prompt) for p in code] for k, pair in pairs.items()}  # same tokenizer: same ids
    guards = {"fp32": None, "bf16": args.guard}
    say("selection of the best static cell per dtype on 2 validation prompts:")
    best = {k: best_static(pairs[k], args.cells, [pairs[k].encode(p) for p in selection], guards[k],
                           args.max_new_tokens, say) for k in pairs}
    methods = {"ar_fp32": lambda x: autoregressive_generate(pairs["fp32"], x, **kw),
               "ar_bf16": lambda x: autoregressive_generate(pairs["bf16"], x, **kw)}
    for k in pairs:
        d, v = best[k]
        methods[f"static_{k} D{d}:V{v}"] = static_method(pairs[k], d, v, guards[k], args.max_new_tokens)
    if args.run:
        from specpilot.eval.inputs import resolve_tree
        from specpilot.eval.methods import EvalContext, build_methods

        run_tree = resolve_tree(args.run)  # the run's tree: its policies' contract
        tree = TreeConfig(width=run_tree.width, max_depth=run_tree.max_depth, max_size=run_tree.max_size,
                          near_tie=args.guard)
        built, skipped = build_methods(["ltd"], EvalContext(pair=pairs["bf16"], tree=tree, run_dir=args.run))
        if "ltd" in built:
            rec = built["ltd"]
            methods["ltd_bf16"] = lambda x, m=rec: m.decoder.generate(x, controller=m.controller, **kw)
        else:
            say(f"ltd: skipped ({skipped.get('ltd')})")
    names = list(methods)
    for name in names:  # warm-up
        methods[name](ids["fp32"][0][:8])
    units = {name: ([], []) for name in names}   # per (prompt, repeat): tokens, seconds
    same_as_ar = {name: 0 for name in names}
    turn = 0
    for r in range(args.repeats):
        for i in range(len(code)):
            order = names[turn % len(names):] + names[: turn % len(names)]
            turn += 1
            outs = {}
            for name in order:
                out, seconds = timed(lambda: methods[name](ids["fp32"][i]))
                outs[name] = out.tokens
                units[name][0].append(out.num_tokens)
                units[name][1].append(seconds)
            if r == 0:
                for name in names:
                    ref = outs["ar_bf16" if "bf16" in name else "ar_fp32"]
                    same_as_ar[name] += outs[name] == ref
    tps = {n: sum(units[n][0]) / sum(units[n][1]) for n in names}
    fastest_ar = max(("ar_fp32", "ar_bf16"), key=tps.get)
    say(f"{len(code)} held-out code prompts x {args.repeats} repeats, {args.max_new_tokens} new tokens, greedy; "
        f"baseline: the fastest AR = {fastest_ar}")
    rows = {}
    for n in names:
        iv = paired_ratio_interval(*units[n], *units[fastest_ar])
        rows[n] = {"tokens_per_s": tps[n], "speedup": iv.ratio, "ci95": iv.ci(),
                   "identical_to_same_dtype_ar": f"{same_as_ar[n]}/{len(code)}"}
        say(f"  {n:24s} {tps[n]:7.1f} tok/s  {iv.ratio:5.2f}x [{iv.low:.2f}, {iv.high:.2f}]  "
            f"identical to same-dtype AR {same_as_ar[n]}/{len(code)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"support": support, "why": why, "auto": auto[1], "best": {
            k: list(v) for k, v in best.items()}, "baseline": fastest_ar, "methods": rows,
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
