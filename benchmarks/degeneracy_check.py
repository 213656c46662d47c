"""The degeneracy flag on bundled suites (not a test): the target's own greedy output per prompt, measured and
flagged by `specpilot.eval.degeneracy`, counted per suite and per (task, language) group.

    .venv/bin/python benchmarks/degeneracy_check.py [--suites heldout,heldout_code] [--max-new-tokens 64]
        [--target T --draft D] [--show]

With the embedded pair (a code model) the flag should fire on the prose of `heldout` and stay quiet on most of
`heldout_code`. --show prints every prompt's measures and the start of its output.
"""
from __future__ import annotations

import argparse
import time

import torch

from specpilot.drafting import ModelPair, autoregressive_generate
from specpilot.eval.degeneracy import degeneracy_report, rule_text
from specpilot.eval.suites import load_suite


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suites", default="heldout,heldout_code")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--show", action="store_true")
    args = ap.parse_args(argv)
    pair = ModelPair.from_pretrained(args.target, args.draft)
    print(f"{pair.name} on {pair.device} ({torch.get_num_threads()} threads), greedy, {args.max_new_tokens} new "
          f"tokens; rule: {rule_text()}")
    for suite in args.suites.split(","):
        prompts = load_suite(suite)
        started = time.perf_counter()
        outputs = {p.id: autoregressive_generate(pair, p.prompt, max_new_tokens=args.max_new_tokens).tokens
                   for p in prompts}
        report = degeneracy_report(outputs, prompts, decode=pair.decode)
        if args.show:
            for pid, m in report["prompts"].items():
                print(f"  {pid:48s} repeated {m['repeated_ngram_share']:.2f} zlib {m['compression_ratio']:.2f} "
                      f"{'FLAG' if m['degenerate'] else '    '} {m['sample'][:60]!r}")
        groups = ", ".join(f"{g['task']}/{g['language']} {g['n_flagged']}/{g['n_measured']}"
                           + ("*" if g["degenerate"] else "") for g in report["groups"])
        print(f"{suite}: {len(report['flagged'])} of {report['n_measured']} prompts flagged "
              f"({time.perf_counter() - started:.0f} s); groups (* degenerate): {groups}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
