"""What the compiled decision kernel saves (not a test): a learned controller deciding through `policies.kernel`
(numba) against the same controller deciding through numpy, chosen per cycle at random within the same live
generations, so load drift hits both alike.

    PYTHONPATH=<tree parent> .venv/bin/python benchmarks/bench_kernel.py [RUN_DIR] [--eagle embedded]
        [--dtype bf16] [--width 4 --depth 6 --size 32] [--prompts 10] [--rounds 3] [--max-new-tokens 96]

RUN_DIR: a demo or train run whose deployed policies decide (`load_run_controllers(RUN_DIR)["ltd"]`); without it,
the latency profile's probe (random actors of the demo's [64, 64] layers) decides and the cycles follow a random
depth in 2..5 and size 12. Prints per-question medians (skip / stop / size), the mean decision time per cycle and
the decision share of generation time (CycleRecord.policy_s over draft + verify + policy time) for each path. The
first round is a warm-up and is not counted.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig
from specpilot.drafting.cycle import run_cycle
from specpilot.eval.suites import load_suite
from specpilot.policies import kernel
from specpilot.drafting.control import Controller
from specpilot.policies.learned import LearnedController, probe_controller
from specpilot.policies.observation import default_size_actions


class Timed(Controller):
    """Answers with `inner` and keeps each answer's time per question."""

    def __init__(self, inner: LearnedController, times: dict, rule: tuple[int, int] | None) -> None:
        self.inner, self.times, self.rule = inner, times, rule  # rule: (depth, size) the cycle follows, or None

    def _timed(self, question, fn, state):
        t0 = _now()
        answer = fn(state)
        self.times[question].append(_now() - t0)
        return answer

    def skip_drafting(self, state):
        answer = self._timed("skip", self.inner.skip_drafting, state)
        return False if self.rule else answer

    def should_stop(self, state):
        answer = self._timed("stop", self.inner.should_stop, state)
        return state.depth >= self.rule[0] if self.rule else answer

    def choose_size(self, state):
        answer = self._timed("size", self.inner.choose_size, state)
        return self.rule[1] if self.rule else answer


def _now() -> float:
    return time.perf_counter()


def numpy_twin(controller: LearnedController) -> LearnedController:
    """A copy of `controller` whose actors fold without the kernel (they decide through numpy)."""
    twin = copy.deepcopy(controller)
    saved, kernel.KERNEL = kernel.KERNEL, None
    try:
        for actor, spec in ((twin.depth_actor, twin.depth_spec), (twin.size_actor, twin.size_spec)):
            if actor is not None:
                actor.prepare(spec)
    finally:
        kernel.KERNEL = saved
    return twin


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="?")
    ap.add_argument("--eagle", default="embedded")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--width", type=int, default=None, help="default: the run's tree, else 4")
    ap.add_argument("--depth", type=int, default=None, help="default: the run's tree, else 6")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if kernel.KERNEL is None:
        raise SystemExit("numba is not available: nothing to compare")
    torch.set_num_threads(args.threads)
    pair = ModelPair.from_pretrained(eagle=args.eagle, dtype=args.dtype)
    compiled = None
    if args.run_dir:  # the tree the run's policies were trained on (they observe scores laid out for it)
        from specpilot.policies.ppo import load_run_controllers

        compiled = load_run_controllers(args.run_dir)["ltd"]
        spec = compiled.depth_spec or compiled.size_spec
        args.width = args.width if args.width is not None else spec.width
        args.depth = args.depth if args.depth is not None else spec.max_depth
    args.width, args.depth = args.width or 4, args.depth or 6
    tree = TreeConfig(width=args.width, max_depth=args.depth, max_size=args.size)
    decoder = SpeculativeDecoder(pair, tree)
    if compiled is None:
        compiled = probe_controller(tree.width, tree.max_depth, default_size_actions("cpu"))
    compiled.check_tree(tree)  # the timed decisions run through run_cycle directly, which does not ask it
    paths = {"kernel": compiled, "numpy": numpy_twin(compiled)}
    assert compiled.depth_actor.compiled and not paths["numpy"].depth_actor.compiled
    times = {name: {q: [] for q in ("skip", "stop", "size")} for name in paths}
    cycles = {name: [0.0, 0.0, 0] for name in paths}  # policy_s, draft + verify + policy, cycles
    rng = np.random.default_rng(args.seed)
    prompts = [p.prompt for p in load_suite("heldout_code")][:args.prompts]
    for r in range(args.rounds + 1):
        for prompt in prompts:
            session = decoder.start(pair.encode(prompt), max_new_tokens=args.max_new_tokens)
            for path in paths.values():
                path.reset()
            while not session.done:
                name = "kernel" if rng.random() < 0.5 else "numpy"
                scratch = {q: [] for q in ("skip", "stop", "size")}
                rule = None if args.run_dir else (int(rng.integers(2, 6)), 12)
                record = run_cycle(session, Timed(paths[name], scratch, rule))
                if r == 0:
                    continue  # warm-up round
                for q, v in scratch.items():
                    times[name][q].extend(v)
                c = cycles[name]
                c[0] += record.policy_s
                c[1] += record.draft_s + record.verify_s + record.policy_s
                c[2] += 1
    print(f"{pair.name} ({pair.drafter_kind}, {str(pair.dtype).replace('torch.', '')}), {args.threads} threads, "
          f"W{args.width} D{args.depth} V{args.size}, {len(prompts)} held-out code prompts x {args.rounds} rounds, "
          f"{'policies of ' + args.run_dir if args.run_dir else 'the profile probe'}")
    for name in paths:
        parts = ", ".join(f"{q} {1e6 * statistics.median(v):5.1f} us (n={len(v)})" for q, v in times[name].items()
                          if v)
        policy_s, total_s, n = cycles[name]
        print(f"  {name:6s} medians: {parts}; per cycle {1e6 * policy_s / max(n, 1):6.1f} us over {n} cycles, "
              f"{100 * policy_s / max(total_s, 1e-12):.2f}% of generation time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
