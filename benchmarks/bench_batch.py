"""Batched decoding throughput (not a test): tokens/s vs batch size for our batched AR
(`drafting.batch_ar.autoregressive_generate_batch`, target only), transformers' batched greedy `generate()`
(left-padded), and one static speculative config through `generate_batch`, on the embedded pair with its draft LM
(`--drafter eagle`: its EAGLE-3 head, in every mode), interleaved.

    .venv/bin/python benchmarks/bench_batch.py [--batch-sizes 1,2,4,8] [--max-new-tokens 48] [--repeats 2]
        [--depth 4] [--size 12]

Greedy. Each round runs every method on the same batch of held-out prompts, the method order rotating per round
and batch size; wall time of the whole call (prefill included, for every method alike), tokens counted up to and
including each row's EOS. Prints tokens/s per method and batch size, each method's ratio to HF generate, and
whether our batched AR emitted exactly HF's tokens.

    .venv/bin/python benchmarks/bench_batch.py --depth0 [--batch-sizes 1,4,16] [--prompts 4] [--max-new-tokens 32]
        [--repeats 8] [--depth 2] [--size 4]

    .venv/bin/python benchmarks/bench_batch.py --queue [--batch-sizes 4] [--prompts 16] [--max-new-tokens 32]

--queue: continuous batching (`max_batch=B`, finished rows refilled) over static batches of B on a queue with
ragged budgets, for batched AR and --depth/--size.

--depth0 checks that "don't speculate" costs what batched AR costs: FixedController(0, 0) through generate_batch
over batched AR per batch size, and at batch size 1 generate_batch over generate() (depth 0 and --depth/--size),
each a ratio with a 95% paired interval over interleaved rounds, plus each method's wall time outside the target's
forwards per step (bookkeeping, masks, and for drafting methods the draft), which the forwards' noise does not blur.

    .venv/bin/python benchmarks/bench_batch.py --policies [--batch-sizes 1,2,4,8,16] [--grid GRID.json]
        [--run RUN] [--prompts 4] [--max-new-tokens 32] [--candidates 0:0,1:2,2:4,4:12] [--table 1:2:4,16:0:0]

--policies prints the issue's table instead, measured by `specpilot.eval.batched.evaluate_batches` (the code
behind `specpilot eval --batch-sizes`; interleaved, per-sequence greedy identity checked): tokens/s vs batch size
for batched AR, the best static config for batch size 1 used at every size, and the per-batch-size table, each
with its ratio to batched AR and 95% paired interval (plus `ltd` with --run). The static configs come from
--table, --grid (its best and its per_batch_size table) or, without either, from a small live sweep of
--candidates at every batch size on validation prompts (not the measured held-out ones). With one batch per size
and one round there is no interval: use --repeats 2 or more.

    .venv/bin/python benchmarks/bench_batch.py --configs 2:4,6:16 --drafter eagle [--batch-sizes 1,4,16]
        [--prompts 4] [--max-new-tokens 32] [--repeats 3]

--configs: each DEPTH:SIZE static config through generate_batch against batched AR at every batch size, and at
batch size 1 generate_batch against generate() for each config, all interleaved (order rotated per round and batch
size); ratio of pooled tokens/s with a 95% paired bootstrap interval over rounds, greedy outputs checked equal.
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig
from specpilot.drafting.batch_ar import autoregressive_generate_batch
from specpilot.eval.rounds import RoundPlan
from specpilot.eval.suites import choose_suite, load_suite
from specpilot.policies import FixedController


def hf_generate(pair: ModelPair, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' batched greedy generate, left-padded; each row's tokens up to and including its first end id."""
    from specpilot.drafting.cycle_math import first_end

    ends = pair.eos_token_ids
    width = max(len(p) for p in prompts)
    pad = ends[0] if ends else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=pair.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=pair.device)
    with torch.inference_mode():
        out = pair.target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                   do_sample=False, pad_token_id=pad, eos_token_id=list(ends) or None)
    rows = []
    for row in out[:, width:].tolist():
        end = first_end(row, ends)
        rows.append(row[: end + 1] if end is not None else row)
    return rows


def sweep_table(pair, tree, sizes, candidates, prompts, max_new_tokens) -> dict[int, tuple[int, int]]:
    """{batch size: the candidate (depth, size) with the highest tokens/s at that batch size}, measured live (one
    interleaved round of every candidate per batch size, `evaluate_batches`)."""
    from specpilot.eval.batched import evaluate_batches

    controllers = {f"d{d}_s{s}": (FixedController(d, s), tree) for d, s in candidates}
    result = evaluate_batches(prompts, pair=pair, batch_sizes=sizes, tree=tree, methods=[], controllers=controllers,
                              max_new_tokens=max_new_tokens, warmup=1)
    table = {}
    for section in result["batch_sizes"]:
        rates = {r["method"]: r["tokens_per_s"] for r in section["methods"]}
        table[section["batch_size"]] = max(candidates, key=lambda c: rates.get(f"d{c[0]}_s{c[1]}", 0.0))
    return table


def load_pair(args) -> ModelPair:
    """The embedded pair with the drafter --drafter names (its draft LM or its EAGLE-3 head)."""
    return ModelPair.from_pretrained(**{args.drafter: "embedded"})


def bench_prompts(args, pair: ModelPair) -> list[list[int]]:
    """The held-out prompts the modes decode, token ids: --suite, else the suite that matches the pair
    (`eval.suites.choose_suite`: `heldout_code` for the embedded code pair, whose target answers prose with junk
    that drafts trivially)."""
    name = choose_suite(args.suite, getattr(args, "target", None))["name"]
    return [pair.encode(p.prompt) for p in load_suite(name)]


def rotated(names: list[str], round_index: int, size_index: int) -> list[str]:
    """The methods' order in one (round, batch size): rotated each time, so no method always runs first."""
    shift = (round_index + size_index) % len(names)
    return names[shift:] + names[:shift]


def timed_call(units: dict, name: str, b: int, call) -> tuple[list[list[int]], float]:
    """(call()'s sequences, its wall seconds); appends its tokens and seconds to units[(name, b)] ([tokens],
    [seconds]: the paired interval's units)."""
    t0 = time.perf_counter()
    out = call()
    wall = time.perf_counter() - t0
    tokens, seconds = units.setdefault((name, b), ([], []))
    tokens.append(sum(len(t) for t in out))
    seconds.append(wall)
    return out, wall


def drafter_label(pair: ModelPair) -> str:
    return "EAGLE-3 head" if pair.eagle is not None else "draft LM"


def configs(args, sizes: list[int]) -> int:
    """--configs (module docstring): static configs via generate_batch vs batched AR per batch size, and
    generate_batch vs generate at batch size 1."""
    from specpilot.eval.stats import paired_ratio_interval

    pair = load_pair(args)
    cells = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    suite = bench_prompts(args, pair)[: args.prompts]
    decoder = SpeculativeDecoder(pair, TreeConfig(width=4, max_depth=max([1] + [d for d, _ in cells]), max_size=64))
    n = args.max_new_tokens
    methods = {"batched_ar": lambda rows: [o.tokens for o in autoregressive_generate_batch(pair, rows,
                                                                                           max_new_tokens=n)]}
    pairs = {b: [] for b in sizes}
    for d, v in cells:
        controller = FixedController(d, v)
        methods[f"batch_d{d}_v{v}"] = (lambda c: lambda rows: [o.tokens for o in decoder.generate_batch(
            rows, controller=c, max_new_tokens=n)])(controller)
        methods[f"generate_d{d}_v{v}"] = (lambda c: lambda rows: [decoder.generate(r, controller=c,
                                                                                   max_new_tokens=n).tokens
                                                                  for r in rows])(controller)
        for b in sizes:
            pairs[b].append((f"batch_d{d}_v{v}", "batched_ar"))
        if 1 in pairs:
            pairs[1].append((f"batch_d{d}_v{v}", f"generate_d{d}_v{v}"))
    for run in methods.values():  # warm-up
        run(suite[:2])
    units = {}
    t_start = time.perf_counter()
    for r in range(args.repeats):
        for j, b in enumerate(sizes):
            rows = [suite[(r * 3 + i) % len(suite)] for i in range(b)]
            outs = {}
            for name in rotated(sorted({m for pr in pairs[b] for m in pr}), r, j):
                outs[name], _ = timed_call(units, name, b, lambda: methods[name](rows))
            assert all(o == outs["batched_ar"] for o in outs.values()), "greedy outputs differ"
    print(f"{pair.name} ({drafter_label(pair)}), {pair.device} {str(pair.dtype).replace('torch.', '')}, torch "
          f"threads {torch.get_num_threads()}; greedy; {len(suite)} held-out prompts, {n} new tokens, "
          f"{args.repeats} interleaved rounds ({time.perf_counter() - t_start:.0f}s); outputs identical")
    for b in sizes:
        for a, ref in pairs[b]:
            ci = paired_ratio_interval(*units[a, b], *units[ref, b])
            rates = [sum(units[m, b][0]) / sum(units[m, b][1]) for m in (a, ref)]
            print(f"B={b:>2}  {a:>16} / {ref:<16} {ci.ratio:.3f}x [{ci.low:.3f}, {ci.high:.3f}]  "
                  f"({rates[0]:.1f} vs {rates[1]:.1f} tok/s)")
    return 0


def depth0(args, sizes: list[int]) -> int:
    """--depth0: "don't speculate" through generate_batch (FixedController(0, 0)) against batched AR, and at batch
    size 1 generate_batch against generate() (depth 0 and --depth/--size), interleaved; one unit = one round's
    batch; ratio of pooled tokens/s with a 95% paired bootstrap interval over rounds."""
    from specpilot.eval.stats import paired_ratio_interval

    pair = load_pair(args)
    suite = bench_prompts(args, pair)[: args.prompts]
    decoder = SpeculativeDecoder(pair, TreeConfig(width=4, max_depth=max(args.depth, 1), max_size=64))
    n = args.max_new_tokens
    spec = FixedController(args.depth, args.size)

    def batch(controller):
        return lambda rows: [o.tokens for o in decoder.generate_batch(rows, controller=controller,
                                                                      max_new_tokens=n)]

    def single(controller):
        return lambda rows: [decoder.generate(r, controller=controller, max_new_tokens=n).tokens for r in rows]

    pairs = {b: [("batch_d0", "batched_ar")] for b in sizes}
    if 1 in pairs:
        pairs[1] += [("batch_d0", "generate_d0"), (f"batch_d{args.depth}_s{args.size}",
                                                   f"generate_d{args.depth}_s{args.size}")]
    methods = {"batched_ar": lambda rows: [o.tokens for o in autoregressive_generate_batch(pair, rows,
                                                                                           max_new_tokens=n)],
               "batch_d0": batch(FixedController(0, 0)), "generate_d0": single(FixedController(0, 0)),
               f"batch_d{args.depth}_s{args.size}": batch(spec),
               f"generate_d{args.depth}_s{args.size}": single(spec)}
    for run in methods.values():  # warm-up
        run(suite[:2])
    units = {}  # (method, b) -> ([tokens per round], [seconds per round])
    # time spent outside the target's forwards (Python, masks, bookkeeping, and for drafting methods the draft):
    # what "don't speculate" may add over batched AR, measured apart from the forwards' noise
    inside = {"s": 0.0}
    forward = pair.target.forward

    def timed_forward(*a, **k):
        t0 = time.perf_counter()
        out = forward(*a, **k)
        inside["s"] += time.perf_counter() - t0
        return out

    pair.target.forward = timed_forward
    outside = {}  # (method, b) -> [seconds outside target forwards, steps (tokens of the longest row)]
    t_start = time.perf_counter()
    for r in range(args.repeats):
        for j, b in enumerate(sizes):
            rows = [suite[(r * 3 + i) % len(suite)] for i in range(b)]
            outs = {}
            for name in rotated(sorted({m for pr in pairs[b] for m in pr}), r, j):
                inside["s"] = 0.0
                outs[name], wall = timed_call(units, name, b, lambda: methods[name](rows))
                acc = outside.setdefault((name, b), [0.0, 0])
                acc[0] += wall - inside["s"]
                acc[1] += max(len(t) for t in outs[name])
            assert all(o == outs["batch_d0"] for o in outs.values()), "greedy outputs differ"
    pair.target.forward = forward
    print(f"{pair.name} ({drafter_label(pair)}), {pair.device} {str(pair.dtype).replace('torch.', '')}, torch threads "
          f"{torch.get_num_threads()}; greedy; {len(suite)} held-out prompts, {n} new tokens, {args.repeats} "
          f"interleaved rounds ({time.perf_counter() - t_start:.0f}s)")
    for b in sizes:
        for a, ref in pairs[b]:
            ci = paired_ratio_interval(*units[a, b], *units[ref, b])
            rate = sum(units[a, b][0]) / sum(units[a, b][1])
            extra = [1e3 * outside[m, b][0] / outside[m, b][1] for m in (a, ref)]
            print(f"B={b:>2}  {a:>16} / {ref:<16} {ci.ratio:.3f}x [{ci.low:.3f}, {ci.high:.3f}]  "
                  f"({rate:.1f} tok/s; outside target forwards {extra[0]:.2f} vs {extra[1]:.2f} ms/step)")
    return 0


def queue(args, sizes: list[int]) -> int:
    """--queue: continuous batching against static batching on a prompt queue with ragged budgets (every other
    prompt gets a quarter of --max-new-tokens): `max_batch=B` refills finished rows, static batching decodes the
    queue in consecutive batches of B; for batched AR and for --depth/--size, interleaved, ratio with a 95% paired
    interval over rounds."""
    from specpilot.eval.stats import paired_ratio_interval

    pair = load_pair(args)
    suite = bench_prompts(args, pair)[: args.prompts]
    decoder = SpeculativeDecoder(pair, TreeConfig(width=4, max_depth=max(args.depth, 1), max_size=64))
    n = args.max_new_tokens
    budgets = [n if i % 2 == 0 else max(1, n // 4) for i in range(len(suite))]
    spec = FixedController(args.depth, args.size)

    def chunks(b):
        return [(suite[i:i + b], budgets[i:i + b]) for i in range(0, len(suite), b)]

    def run(name, b):
        if name == "ar_queue":
            return [o.tokens for o in autoregressive_generate_batch(pair, suite, max_new_tokens=budgets, max_batch=b)]
        if name == "ar_static":
            return [o.tokens for p, m in chunks(b) for o in autoregressive_generate_batch(pair, p, max_new_tokens=m)]
        if name == "spec_queue":
            return [o.tokens for o in decoder.generate_batch(suite, controller=spec, max_new_tokens=budgets,
                                                             max_batch=b)]
        return [o.tokens for p, m in chunks(b) for o in decoder.generate_batch(p, controller=spec, max_new_tokens=m)]

    names = ["ar_queue", "ar_static", "spec_queue", "spec_static"]
    for name in names:
        run(name, 2)  # warm-up
    units = {}
    for r in range(args.repeats):
        for j, b in enumerate(sizes):
            outs = {}
            for name in rotated(names, r, j):
                outs[name], _ = timed_call(units, name, b, lambda: run(name, b))
            assert all(o == outs["ar_static"] for o in outs.values()), "greedy outputs differ"
    print(f"{pair.name} ({drafter_label(pair)}), {pair.device}, torch threads {torch.get_num_threads()}; greedy; "
          f"queue of "
          f"{len(suite)} held-out prompts, budgets {n} and {max(1, n // 4)} alternating, {args.repeats} rounds")
    for b in sizes:
        for a, ref in (("ar_queue", "ar_static"), ("spec_queue", "spec_static")):
            ci = paired_ratio_interval(*units[a, b], *units[ref, b])
            print(f"B={b:>2}  {a:>10} / {ref:<11} {ci.ratio:.3f}x [{ci.low:.3f}, {ci.high:.3f}]  "
                  f"({sum(units[a, b][0]) / sum(units[a, b][1]):.1f} vs "
                  f"{sum(units[ref, b][0]) / sum(units[ref, b][1]):.1f} tok/s)")
    return 0


def policies(args, sizes: list[int]) -> int:
    """The issue's table (module docstring)."""
    from specpilot.eval.batched import evaluate_batches
    from specpilot.eval.methods import grid_batch_table
    from specpilot.policies import BatchTableController
    from specpilot.artifacts.grid import GridResult

    pair = load_pair(args)
    n = args.max_new_tokens
    candidates = [tuple(int(x) for x in c.split(":")) for c in args.candidates.split(",")]
    deepest = max([d for d, _ in candidates] + [1])
    heldout = [pair.encode(p.prompt) for p in load_suite("heldout_code")][: args.prompts]
    t0 = time.perf_counter()
    if args.table:  # B:DEPTH:SIZE entries given (e.g. a sweep printed earlier): the batch-1 entry is the static
        table = {int(b): (int(d), int(z)) for b, d, z in (e.split(":") for e in args.table.split(","))}
        static, source = table[min(table)], f"--table {args.table}"
        deepest = max([deepest] + [d for d, _ in table.values()])
    elif args.grid:
        best = GridResult.load(args.grid).best
        cells = grid_batch_table(args.grid)
        table = {b: (c["depth"], c["size"]) for b, c in cells.items()}
        static, source = (best["depth"], best["size"]), f"grid {args.grid}"
        deepest = max([deepest, static[0]] + [d for d, _ in table.values()])
    else:
        tree = TreeConfig(width=4, max_depth=deepest, max_size=64)
        tune = [pair.encode(p.prompt) for p in load_suite("validation")][: args.prompts]
        table = sweep_table(pair, tree, sizes, candidates, tune, n)
        static, source = table[min(sizes)], f"live sweep of {args.candidates} on {len(tune)} validation prompts"
    sweep_s = time.perf_counter() - t0
    tree = TreeConfig(width=4, max_depth=max(deepest, 1), max_size=64)
    controllers = {f"static_b1_d{static[0]}_s{static[1]}": (FixedController(*static), tree),
                   "batch_table": (BatchTableController(table), tree)}
    result = evaluate_batches(heldout, pair=pair, batch_sizes=sizes, tree=tree, controllers=controllers,
                              methods=["ltd"] if args.run else [], run_dir=args.run, max_new_tokens=n,
                              plan=RoundPlan.make(args.repeats), warmup=1)
    print(f"{pair.name} ({drafter_label(pair)}), {pair.device} {str(pair.dtype).replace('torch.', '')}, "
          f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}; greedy; "
          f"{len(heldout)} held-out prompts, {n} new tokens, {args.repeats} round(s), tree width 4")
    print(f"static configs from {source} ({sweep_s:.0f}s); batch table "
          + ", ".join(f"B>={b}: ({d}, {s})" for b, (d, s) in sorted(table.items())))
    if result["skipped"]:
        print(f"skipped: {result['skipped']}")
    names = [n for n in result["methods"]]
    print(f"{'batch':>5}  " + "  ".join(f"{name:>34}" for name in names) + "  exact")
    for section in result["batch_sizes"]:
        rows = {r["method"]: r for r in section["methods"]}
        cells = []
        for name in names:
            r = rows.get(name)
            if r is None:
                cells.append(f"{'-':>34}")
                continue
            ci = r["speedup_ci"]
            interval = (f"[{ci[0]:.2f},{ci[1]:.2f}]" if ci and ci[0] is not None and ci[0] == ci[0]
                        else ("" if name == "ar" else "[n/a: 1 unit]"))
            cells.append(f"{r['tokens_per_s']:>8.1f} tok/s {r['speedup']:>5.2f}x {interval:>13}")
        exact = all(r["identical_to_ar"] for r in rows.values())
        print(f"{section['batch_size']:>5}  " + "  ".join(cells) + f"  {exact}")
    print(f"({result['protocol']['seconds']:.0f}s measured; ratios vs batched ar with 95% paired bootstrap "
          "intervals over batches, over rounds where there is one batch)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--size", type=int, default=12)
    ap.add_argument("--policies", action="store_true", help="the static-vs-per-batch-table table (see above)")
    ap.add_argument("--queue", action="store_true", help="continuous batching (max_batch) vs static batches of B "
                    "on a queue of --prompts prompts with ragged budgets")
    ap.add_argument("--depth0", action="store_true", help="FixedController(0, 0) via generate_batch vs batched AR, "
                    "and generate_batch vs generate at batch size 1, with intervals")
    ap.add_argument("--drafter", choices=("draft", "eagle"), default="draft",
                    help="the embedded pair's drafter: its draft LM (default) or its EAGLE-3 head")
    ap.add_argument("--configs", default=None, help="DEPTH:SIZE,...: each via generate_batch vs batched AR per "
                    "batch size, and vs generate at batch size 1 (see above)")
    ap.add_argument("--suite", default=None, help="held-out prompts: a suite name or file (default: the one that "
                    "matches the pair, heldout_code for the embedded pair)")
    ap.add_argument("--grid", default=None, help="--policies: grid.json with best and per_batch_size")
    ap.add_argument("--run", default=None, help="--policies: a trained run (adds ltd)")
    ap.add_argument("--prompts", type=int, default=4, help="--policies: held-out (and sweep) prompts")
    ap.add_argument("--candidates", default="0:0,1:2,2:4,4:12", help="--policies: DEPTH:SIZE configs swept")
    ap.add_argument("--table", default=None, help="--policies: B:DEPTH:SIZE,... per-batch table (skips the sweep)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    if args.configs:
        return configs(args, sizes)
    if args.policies:
        return policies(args, sizes)
    if args.depth0:
        return depth0(args, sizes)
    if args.queue:
        return queue(args, sizes)
    pair = load_pair(args)
    suite = bench_prompts(args, pair)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=4, max_depth=max(args.depth, 1), max_size=64))
    n = args.max_new_tokens

    def ours(controller):
        return lambda batch: [o.tokens for o in decoder.generate_batch(batch, controller=controller,
                                                                       max_new_tokens=n)]

    methods = {"hf_generate": lambda batch: hf_generate(pair, batch, n),
               "batched_ar": lambda batch: [o.tokens for o in autoregressive_generate_batch(pair, batch,
                                                                                          max_new_tokens=n)],
               f"spec_d{args.depth}_s{args.size}": ours(FixedController(args.depth, args.size))}
    for run in methods.values():  # warm-up
        run(suite[:2])
    units = {}
    same_as_hf = {b: True for b in sizes}
    for r in range(args.repeats):
        for j, b in enumerate(sizes):
            batch = [suite[(r * 7 + i) % len(suite)] for i in range(b)]
            outputs = {}
            for name in rotated(list(methods), r, j):
                outputs[name], _ = timed_call(units, name, b, lambda: methods[name](batch))
            same_as_hf[b] &= outputs["batched_ar"] == outputs["hf_generate"]
    print(f"{pair.name} ({drafter_label(pair)}), cpu {str(pair.dtype).replace('torch.', '')}, "
          f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}; greedy; "
          f"{args.repeats} rounds, {n} new tokens, tree width 4")
    print(f"{'batch':>5}  " + "  ".join(f"{name:>18}" for name in methods) + "   ratios to hf_generate   AR==HF")
    for b in sizes:
        rates = {name: sum(units[name, b][0]) / sum(units[name, b][1]) for name in methods}
        ratios = " ".join(f"{rates[name] / rates['hf_generate']:.2f}" for name in methods if name != "hf_generate")
        print(f"{b:>5}  " + "  ".join(f"{rates[name]:>12.1f} tok/s" for name in methods)
              + f"   {ratios:>20}   {same_as_hf[b]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
