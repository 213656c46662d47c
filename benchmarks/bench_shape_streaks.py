"""Do repeated tree shapes run cheaper than switched ones? (not a test). The latency profile draws a random
(depth, size) every cycle, so nearly all its samples follow a different shape; a static config repeats one shape
every cycle. If repeats are cheaper, replay under-prices static configs against a policy that switches.

    PYTHONPATH=<tree parent> .venv/bin/python benchmarks/bench_shape_streaks.py [--eagle embedded] [--dtype auto]
        [--prompts 24] [--rounds 3] [--max-new-tokens 48] [--repeat 0.5]

One controller decodes --suite's first --prompts with a config drawn from CONFIGS at each cycle, keeping the
previous one with probability --repeat, so repeats and switches interleave within the same generations. Each
cycle's draft and verify time (the decoder's own clock) goes to a cell (config, context length // 64) as "same" or
"switched"; cells with >= 5 of each give a median ratio same / switched. Prints each cell, and the mean over cells
weighted by the smaller count with a 95% bootstrap interval over cells. The first round is a warm-up.
"""
from __future__ import annotations

import argparse
import collections

import numpy as np
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig
from specpilot.drafting.control import Controller
from specpilot.drafting.cycle import run_cycle
from specpilot.eval.suites import load_suite

CONFIGS = [(2, 8), (3, 12), (4, 16), (4, 24), (6, 24), (8, 32)]


class StreakyController(Controller):
    """A random config from CONFIGS per cycle, the previous one kept with probability `repeat`."""

    name = "streaky"

    def __init__(self, rng: np.random.Generator, repeat: float) -> None:
        self.rng, self.repeat, self.current = rng, repeat, None

    def reset(self) -> None:
        self.current = None

    def skip_drafting(self, state) -> bool:
        if self.current is None or self.rng.random() >= self.repeat:
            self.current = CONFIGS[self.rng.integers(len(CONFIGS))]
        return False

    def should_stop(self, state) -> bool:
        return state.depth >= self.current[0]

    def choose_size(self, state) -> int:
        return self.current[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eagle", default="embedded")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--suite", default="heldout_code")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeat", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = ModelPair.from_pretrained(eagle=args.eagle, dtype=args.dtype)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=4, max_depth=8, max_size=32))
    prompts = load_suite(args.suite)[:args.prompts]
    rng = np.random.default_rng(args.seed)
    controller = StreakyController(rng, args.repeat)
    cells = collections.defaultdict(lambda: {True: [], False: []})
    for r in range(args.rounds + 1):
        for prompt in prompts:
            session = decoder.start(pair.encode(prompt.prompt), max_new_tokens=args.max_new_tokens)
            controller.reset()
            previous = None
            while not session.done:
                cycle = run_cycle(session, controller)
                shape = (cycle.depth, cycle.size)
                if r > 0:  # round 0 warms up
                    cells[(shape, cycle.context_len // 64)][shape == previous].append((cycle.draft_s, cycle.verify_s))
                previous = shape
    print(f"{pair.name} ({pair.drafter_kind}, {str(pair.dtype).replace('torch.', '')}), {args.threads} threads, "
          f"{len(prompts)} {args.suite} prompts x {args.rounds} rounds, repeat probability {args.repeat}")
    ratios, weights = [], []
    for (shape, ctx), group in sorted(cells.items()):
        same, switched = np.array(group[True]), np.array(group[False])
        if len(same) < 5 or len(switched) < 5:
            continue
        draft = np.median(same[:, 0]) / np.median(switched[:, 0])
        verify = np.median(same[:, 1]) / np.median(switched[:, 1])
        step = np.median(same.sum(1)) / np.median(switched.sum(1))
        ratios.append((draft, verify, step))
        weights.append(min(len(same), len(switched)))
        print(f"  d{shape[0]} V{shape[1]} context {64 * ctx}-{64 * ctx + 63}: {len(same)} same, {len(switched)} "
              f"switched; same / switched: draft {draft:.3f}, verify {verify:.3f}, step {step:.3f}")
    if not ratios:
        print("no cell with >= 5 cycles of each kind: add prompts or rounds")
        return 1
    ratios, weights = np.array(ratios), np.array(weights, dtype=float)
    boot = np.random.default_rng(args.seed + 1)
    draws = [np.average(ratios[i], axis=0, weights=weights[i])
             for i in (boot.integers(len(ratios), size=len(ratios)) for _ in range(2000))]
    low, high = np.percentile(draws, [2.5, 97.5], axis=0)
    mean = np.average(ratios, axis=0, weights=weights)
    for k, name in enumerate(("draft", "verify", "step")):
        print(f"{name} same / switched: {mean[k]:.3f} [{low[k]:.3f}, {high[k]:.3f}] over {len(ratios)} cells")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
