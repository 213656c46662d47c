"""Sampled decoding benchmark (not a test): at temperature T, tau and speed over autoregressive decoding of trees with
sampled children (recursive rejection sampling) vs deterministic top-W children, side by side, interleaved.

    .venv/bin/python benchmarks/bench_sampling.py [--temperature 1.0] [--prompts 8] [--max-new-tokens 64]
        [--configs 1x2,2x2,4x2,4x3] [--repeats 2] [--draft embedded | --eagle embedded]

configs: WIDTHxDEPTH (size = all candidates). Prints per config: tau and tokens/s ratio over our AR for both rules,
with the model, precision, sampling, hardware and prompt mix.
"""
from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.cycle_math import num_candidates
from specpilot.eval.suites import load_suite
from specpilot.policies import FixedController


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", default="1x2,2x2,4x2,4x3")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--eagle", default=None)
    args = ap.parse_args(argv)
    pair = ModelPair.from_pretrained(draft=args.draft, eagle=args.eagle)
    prompts = [p.prompt for p in load_suite("heldout") if p.task == "code"][: args.prompts]
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    methods = {"ar": None}
    for width, depth in configs:
        size = num_candidates(width, depth)
        for sampled in (True, False):
            tree = TreeConfig(width=width, max_depth=depth, max_size=size, sampled_children=sampled)
            methods[f"W{width} D{depth} {'sampled' if sampled else 'top-W'}"] = (SpeculativeDecoder(pair, tree),
                                                                               FixedController(depth, size))
    totals = {name: [0, 0.0, 0] for name in methods}  # tokens, seconds, cycles
    names = list(methods)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    for name in names:  # warm-up
        run(pair, methods[name], prompts[0], sampling, seed=0)
    turn = 0
    for r in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                out, seconds = run(pair, methods[name], prompt, sampling, seed=1000 * r + i)
                t = totals[name]
                t[0], t[1], t[2] = t[0] + out.num_tokens, t[1] + seconds, t[2] + (len(out.cycles) or out.num_tokens)
            turn += 1
    ar_tps = totals["ar"][0] / totals["ar"][1]
    print(f"pair {pair.name} ({pair.drafter_kind}), {pair.device} {str(pair.dtype).replace('torch.', '')}, "
          f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}; T={args.temperature}, "
          f"{len(prompts)} held-out code prompts x {args.repeats}, {args.max_new_tokens} new tokens; "
          f"AR {ar_tps:.1f} tok/s")
    print(f"{'config':<22} {'tau':>6} {'speedup':>8}")
    for name in names[1:]:
        tokens, seconds, cycles = totals[name]
        print(f"{name:<22} {tokens / cycles:>6.2f} {tokens / seconds / ar_tps:>7.2f}x")
    return 0


def run(pair, method, prompt, sampling, seed):
    start = time.perf_counter()
    if method is None:
        out = autoregressive_generate(pair, prompt, **sampling, seed=seed)
    else:
        decoder, controller = method
        out = decoder.generate(prompt, controller=controller, **sampling, seed=seed)
    return out, time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
