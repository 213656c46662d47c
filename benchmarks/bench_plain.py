"""Plain target steps through the decoder vs our AR (not a test): what a controller that never drafts (depth 0 on
every cycle, `FixedController(0)`) costs against autoregressive decoding, side by side, interleaved.

    .venv/bin/python benchmarks/bench_plain.py [--drafter eagle|draft] [--temperature 1.0] [--prompts 6]
        [--max-new-tokens 64] [--repeats 3] [--suite heldout_code]

Three methods: `ar`; `depth0`, what `generate` runs for such a controller (`Controller.may_draft` False: a
target-only session, no drafter prefill and no EAGLE features); `depth0_drafting`, the same plain steps in a session
that keeps the drafter ready (its prompt prefill and the head's features), as every session did before 2605dab. All
run the same prompts with the same seeds, the order rotating per prompt and repeat. Prints tokens/s and the ratios
over AR with the model, precision, sampling, hardware and prompt mix; time includes the prefill.
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.cycle import run_generation
from specpilot.eval.suites import load_suite
from specpilot.policies import FixedController


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", choices=["eagle", "draft"], default="eagle")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--suite", default="heldout_code", help="bundled suite or file (heldout_code: what the "
                    "embedded code pair answers sensibly)")
    args = ap.parse_args(argv)
    pair = ModelPair.from_pretrained(**{args.drafter: "embedded"})
    prompts = [p.prompt for p in load_suite(args.suite)][: args.prompts]
    decoder = SpeculativeDecoder(pair, TreeConfig(width=4, max_depth=6, max_size=32))
    never_draft = FixedController(0)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=1)
    methods = {"ar": lambda p: autoregressive_generate(pair, p, **kw),
               "depth0": lambda p: decoder.generate(p, controller=never_draft, **kw),
               "depth0_drafting": lambda p: _drafting_session(decoder, p, never_draft, kw)}
    for run in methods.values():  # warm-up
        run(prompts[0])
    totals = {name: [0, 0.0] for name in methods}
    for r in range(args.repeats):
        for i, prompt in enumerate(prompts):
            k = (i + r * len(prompts)) % len(methods)
            order = list(methods)[k:] + list(methods)[:k]
            for name in order:
                t0 = time.perf_counter()
                out = methods[name](prompt)
                totals[name][0] += out.num_tokens
                totals[name][1] += time.perf_counter() - t0
    ar, plain, drafting = (totals[n][0] / totals[n][1] for n in ("ar", "depth0", "depth0_drafting"))
    print(f"{pair.name} ({args.drafter}), cpu {str(pair.dtype).replace('torch.', '')}, "
          f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}; "
          f"T={args.temperature:g}; {len(prompts)} prompts of {args.suite} x {args.repeats}, "
          f"{args.max_new_tokens} tokens")
    print(f"ar {ar:.1f} tok/s; depth-0 decoder {plain:.1f} tok/s, ratio {plain / ar:.3f}; in a drafting session "
          f"{drafting:.1f} tok/s, ratio {drafting / ar:.3f}")
    return 0


def _drafting_session(decoder, prompt, controller, kw):
    session = decoder.start(prompt, **kw)  # drafting=True: the drafter prefilled, the head's features kept
    run_generation(session, controller)
    return session.output()


if __name__ == "__main__":
    raise SystemExit(main())
