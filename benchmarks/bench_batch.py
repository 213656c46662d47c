"""Batched decoding throughput (not a test): tokens/s vs batch size for our batched AR
(`drafting.batch.autoregressive_generate_batch`, target only), transformers' batched greedy `generate()`
(left-padded), and one static speculative config through `generate_batch`, on the embedded pair with its draft LM,
interleaved.

    .venv/bin/python benchmarks/bench_batch.py [--batch-sizes 1,2,4,8] [--max-new-tokens 48] [--repeats 2]
        [--depth 4] [--size 12]

Greedy. Each round runs every method on the same batch of held-out prompts, the method order rotating per round
and batch size; wall time of the whole call (prefill included, for every method alike), tokens counted up to and
including each row's EOS. Prints tokens/s per method and batch size, each method's ratio to HF generate, and
whether our batched AR emitted exactly HF's tokens.
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig
from specpilot.drafting.batch import autoregressive_generate_batch
from specpilot.eval.suites import load_suite
from specpilot.policies import FixedController


def hf_generate(pair: ModelPair, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' batched greedy generate, left-padded; each row's tokens up to and including its EOS."""
    eos = pair.eos_token_id
    width = max(len(p) for p in prompts)
    pad = eos if eos is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=pair.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=pair.device)
    with torch.inference_mode():
        out = pair.target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                   do_sample=False, pad_token_id=pad, eos_token_id=eos)
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos is not None and eos in row else row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--size", type=int, default=12)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    pair = ModelPair.from_pretrained(draft="embedded")
    suite = [pair.encode(p.prompt) for p in load_suite("heldout")]
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
    totals = {(name, b): [0, 0.0] for name in methods for b in sizes}
    same_as_hf = {b: True for b in sizes}
    for r in range(args.repeats):
        for j, b in enumerate(sizes):
            batch = [suite[(r * 7 + i) % len(suite)] for i in range(b)]
            names = list(methods)
            shift = (r + j) % len(names)
            outputs = {}
            for name in names[shift:] + names[:shift]:
                t0 = time.perf_counter()
                outputs[name] = methods[name](batch)
                totals[name, b][1] += time.perf_counter() - t0
                totals[name, b][0] += sum(len(t) for t in outputs[name])
            same_as_hf[b] &= outputs["batched_ar"] == outputs["hf_generate"]
    print(f"{pair.name} (draft LM), cpu {str(pair.dtype).replace('torch.', '')}, "
          f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}; greedy; "
          f"{args.repeats} rounds, {n} new tokens, tree width 4")
    print(f"{'batch':>5}  " + "  ".join(f"{name:>18}" for name in methods) + "   ratios to hf_generate   AR==HF")
    for b in sizes:
        rates = {name: totals[name, b][0] / totals[name, b][1] for name in methods}
        ratios = " ".join(f"{rates[name] / rates['hf_generate']:.2f}" for name in methods if name != "hf_generate")
        print(f"{b:>5}  " + "  ".join(f"{rates[name]:>12.1f} tok/s" for name in methods)
              + f"   {ratios:>20}   {same_as_hf[b]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
