"""Where a decoding cycle's time goes (not a test): drafter forwards, the target's verify forward, and everything
else (masks, ranking, acceptance, cache crop, features, Python), per cycle, on held-out code prompts.

    .venv/bin/python benchmarks/bench_cycle.py [--eagle embedded | --draft embedded] [--width 4 --depth 4 --size 16]
        [--prompts 6] [--max-new-tokens 96] [--profile]

The model forwards are timed by wrapping the target's and the drafter's forward (perf_counter, synchronised on
CUDA), the cycle by the decoder's own CycleRecord. --profile also prints cProfile's top functions of the rest.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig
from specpilot.eval.suites import load_suite
from specpilot.policies import FixedController


class Timed:
    """Wraps a module's forward and sums the seconds spent in it."""

    def __init__(self, module, cuda: bool) -> None:
        self.module, self.cuda, self.seconds, self.calls = module, cuda, 0.0, 0
        self.inner = module.forward
        module.forward = self

    def __call__(self, *args, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = self.inner(*args, **kwargs)
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--eagle", default=None)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    pair = ModelPair.from_pretrained(draft=args.draft, eagle=args.eagle)
    cuda = pair.device.type == "cuda"
    decoder = SpeculativeDecoder(pair, TreeConfig(width=args.width, max_depth=args.depth, max_size=args.size))
    controller = FixedController(args.depth, args.size)
    prompts = [p.prompt for p in load_suite("heldout") if p.task == "code"][: args.prompts]
    decoder.generate(prompts[0], controller=controller, max_new_tokens=16)  # warm-up
    target = Timed(pair.target, cuda)
    drafter = Timed(pair.eagle if pair.eagle is not None else pair.draft, cuda)
    profiler = cProfile.Profile() if args.profile else None
    cycles = total = 0.0
    tokens = 0
    for prompt in prompts:
        if profiler:
            profiler.enable()
        out = decoder.generate(prompt, controller=controller, max_new_tokens=args.max_new_tokens)
        if profiler:
            profiler.disable()
        cycles += len(out.cycles)
        tokens += out.num_tokens
        total += sum(c.draft_s + c.verify_s + c.policy_s for c in out.cycles)
    rest = total - target.seconds - drafter.seconds
    print(f"{pair.name} ({pair.drafter_kind}), {pair.device}, threads {torch.get_num_threads()}, W{args.width} "
          f"D{args.depth} V{args.size}: {int(cycles)} cycles, tau {tokens / cycles:.2f}")
    for label, seconds in (("drafter forwards", drafter.seconds), ("target forwards", target.seconds),
                           ("everything else", rest)):
        print(f"  {label:<17} {1e3 * seconds / cycles:7.2f} ms/cycle  {100 * seconds / total:5.1f}%")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
