"""Small-row linears on and off, side by side (not a test): what `drafting/linear_kernels.py` changes in decoding.

    .venv/bin/python benchmarks/bench_small_rows.py [--drafter eagle|draft] [--temperatures 0,1] [--prompts 12]
        [--max-new-tokens 48] [--repeats 2] [--configs 1x1,2x6,4x16] [--threads 2]
    .venv/bin/python benchmarks/bench_small_rows.py --forwards 1,2,3,8,9,12,17,33 [--repeats 10]

For each temperature: AR (`autoregressive_generate`) and FixedController(depth, size) for each --configs entry, each
with the pair's linears turned (`enable_small_row_linears`) and plain (`disable_small_row_linears`), on the same
prompts with the same seeds; every (method, switch) runs each prompt in turn, the order rotating per prompt and
repeat, after a warm-up pass. Prints tokens/s (prefill included), each speculative method's ratio over AR with the
switch in the same position, and on/off ratios with a 95% cluster-bootstrap interval over prompts.

--forwards N,...: instead, the target's own forward over N new tokens (a 4-D mask, after a 150-token cache) with
the row plan measured for it against torch's linear, interleaved --repeats times (after one warm-up pair): the
median ms of each, their ratio and the plan's width for N.
"""
from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.cache import crop_to, new_cache
from specpilot.drafting.linear_kernels import describe, disable_small_row_linears, enable_small_row_linears
from specpilot.eval.stats import cluster_ratio_interval, verdict
from specpilot.eval.suites import load_suite
from specpilot.policies import FixedController


def forward_times(pair: ModelPair, tokens: list[int], repeats: int) -> None:
    """Print the target's forward time over each count of new tokens, with the measured row plan (turned layers)
    and with torch's linear (the layers switched back), interleaved."""
    model, context = pair.target, 150
    cache = new_cache(model)
    gen = torch.Generator().manual_seed(0)
    plan = describe([model])["measured"][0]["plan"] if describe([model])["enabled"] else []
    widths = dict(plan)

    def forward(n: int, turned: bool) -> float:
        (enable_small_row_linears if turned else disable_small_row_linears)(model)
        ids = torch.randint(5, pair.vocab_size, (1, n), generator=gen)
        mask = torch.ones(1, 1, n, context + n, dtype=torch.bool)
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(context, context + n)[None], cache=cache,
              use_cache=True)
        seconds = time.perf_counter() - t0
        crop_to(cache, context)
        return seconds

    with torch.inference_mode():
        model(input_ids=torch.randint(5, pair.vocab_size, (1, context), generator=gen), cache=cache, use_cache=True)
        for n in tokens:
            times = {True: [], False: []}
            for r in range(repeats + 1):
                for turned in ((True, False) if r % 2 else (False, True)):
                    t = forward(n, turned)
                    if r:  # the first pair warms up
                        times[turned].append(t)
            on, off = (float(np.median(times[k])) for k in (True, False))
            how = f"W @ x^T over {widths[n]} rows" if n in widths else "torch's linear either way"
            print(f"  {n:3d} tokens: planned {1e3 * on:6.2f} ms, torch's linear {1e3 * off:6.2f} ms, "
                  f"ratio {on / off:.3f} ({how})")
    enable_small_row_linears(model)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", choices=["eagle", "draft"], default="eagle")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", default="1x1,2x6,4x16", help="depth x size of each FixedController")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--suite", default="heldout_code")
    ap.add_argument("--forwards", default=None, help="comma-separated token counts: time target forwards instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = ModelPair.from_pretrained(**{args.drafter: "embedded"})
    if args.forwards:
        print(f"{pair.name} target, cpu {str(pair.dtype).replace('torch.', '')}, "
              f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; medians of "
              f"{args.repeats} interleaved forwards")
        forward_times(pair, [int(n) for n in args.forwards.split(",")], args.repeats)
        return 0
    models = [m for m in (pair.target, pair.draft, pair.eagle) if m is not None]
    prompts = [pair.encode(p.prompt) for p in load_suite(args.suite)][: args.prompts]
    decoder = SpeculativeDecoder(pair, TreeConfig(width=4, max_depth=8, max_size=32))
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    print(f"{pair.name} ({pair.drafter_kind}), cpu {str(pair.dtype).replace('torch.', '')}, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; row plans (rows, width) "
          f"{[m['plan'] for m in describe(models).get('measured', [])]}; {len(prompts)} {args.suite} prompts x "
          f"{args.repeats}, "
          f"{args.max_new_tokens} new tokens")

    def switch(on: bool) -> None:
        for m in models:
            (enable_small_row_linears if on else disable_small_row_linears)(m)

    for temperature in (float(t) for t in args.temperatures.split(",")):
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=temperature)
        methods = {"ar": None, **{f"d{d} V{v}": FixedController(d, v) for d, v in configs}}
        runs = [(name, on) for name in methods for on in (True, False)]
        rows = {run: [] for run in runs}  # (prompt index, tokens, seconds)
        for r in range(args.repeats + 1):
            for i, ids in enumerate(prompts):
                k = (i + r * len(prompts)) % len(runs)
                for name, on in runs[k:] + runs[:k]:
                    switch(on)
                    t0 = time.perf_counter()
                    if methods[name] is None:
                        out = autoregressive_generate(pair, ids, seed=i, **kw)
                    else:
                        out = decoder.generate(ids, controller=methods[name], seed=i, **kw)
                    if r > 0:  # the first pass is a warm-up
                        rows[(name, on)].append((i, out.num_tokens, time.perf_counter() - t0))
        switch(True)
        print(f"T={temperature:g}:")
        ar = {on: np.array(rows[("ar", on)])[:, 1].sum() / np.array(rows[("ar", on)])[:, 2].sum() for on in (1, 0)}
        for name in methods:
            a, b = np.array(rows[(name, True)]), np.array(rows[(name, False)])
            iv = cluster_ratio_interval(a[:, 1], a[:, 2], b[:, 1], b[:, 2], a[:, 0].astype(int))
            on_tps, off_tps = a[:, 1].sum() / a[:, 2].sum(), b[:, 1].sum() / b[:, 2].sum()
            print(f"  {name:8s} on {on_tps:6.1f} tok/s ({on_tps / ar[1]:.3f}x AR on), off {off_tps:6.1f} tok/s "
                  f"({off_tps / ar[0]:.3f}x AR off); on/off {iv.ratio:.3f} [{iv.low:.3f}, {iv.high:.3f}] {verdict(iv)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
