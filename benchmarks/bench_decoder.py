"""Decoder benchmark (not a test): our AR vs transformers generate(), the best static speculative config vs our AR,
and vs transformers assisted generation with the same draft — measured side by side, interleaved, in one run.

    .venv/bin/python benchmarks/bench_decoder.py [--target T --draft D] [--prompts 8] [--max-new-tokens 128]

The static config is chosen on *validation* prompts (a small sweep), then timed on held-out code prompts.
Prints model, precision, sampling, hardware and prompt mix with the numbers.
"""
from __future__ import annotations

import argparse
import itertools
import platform
import time

import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.eval.hf_baselines import HFGenerate, configure_assistant
from specpilot.eval.suites import load_suite
from specpilot.policies import FixedController


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def sweep(pair, prompts, max_new_tokens, widths, depths, sizes):
    """Tokens/s of each static (width, depth, size) on the tuning prompts; sorted best first."""
    rows = []
    for width, depth in itertools.product(widths, depths):
        for size in ([depth] if width == 1 else sizes):
            if width > 1 and size < depth:
                continue
            dec = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=depth, max_size=size))
            ctrl = FixedController(depth, size)
            tokens = seconds = 0.0
            taus = []
            for ids in prompts:
                out = dec.generate(ids, controller=ctrl, max_new_tokens=max_new_tokens)
                tokens += len(out.tokens)
                seconds += out.total_s
                taus.append(out.mean_accepted_length)
            rows.append({"width": width, "depth": depth, "size": size, "tok_s": tokens / seconds,
                         "tau": sum(taus) / len(taus)})
    return sorted(rows, key=lambda r: -r["tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tune-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument("--quick", action="store_true", help="a tiny sweep (smoke run)")
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--depths", default="1,2,3,4,5,6,8")
    ap.add_argument("--sizes", default="2,4,6,8,12,16,24,32")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    pair = ModelPair.from_pretrained(args.target, args.draft, device=args.device)
    encode = pair.encode
    tune = [encode(p.prompt) for p in load_suite("validation")[: args.tune_prompts]]
    heldout = [encode(p.prompt) for p in load_suite("heldout") if p.task == "code"][: args.prompts]
    n_new = args.max_new_tokens
    print(f"pair {pair.name} ({pair.identity()['target_hash']}/{pair.identity()['draft_hash']}), "
          f"{pair.device.type} {str(pair.dtype).replace('torch.', '')}, {_cpu_name() if pair.device.type == 'cpu' else torch.cuda.get_device_name(pair.device)}, "
          f"torch threads {torch.get_num_threads()}, greedy, max_new_tokens {n_new}, "
          f"{len(heldout)} held-out code prompts (tuning: {len(tune)} validation prompts)")

    for ids in tune[:1]:  # warm-up
        autoregressive_generate(pair, ids, max_new_tokens=16)
        SpeculativeDecoder(pair, TreeConfig(width=4, max_depth=4)).generate(ids, max_new_tokens=16)
    t0 = time.perf_counter()
    grid = (dict(widths=[1, 4], depths=[2, 4], sizes=[4, 8]) if args.quick else
            dict(widths=[int(x) for x in args.widths.split(",")], depths=[int(x) for x in args.depths.split(",")],
                 sizes=[int(x) for x in args.sizes.split(",")]))
    table = sweep(pair, tune, n_new, **grid)
    print(f"\nstatic sweep on validation prompts ({time.perf_counter() - t0:.0f}s), top 8:")
    for r in table[:8]:
        print(f"  W={r['width']} D={r['depth']} V={r['size']}: {r['tok_s']:.1f} tok/s, tau {r['tau']:.2f}")
    best = table[0]
    best_chain = next(r for r in table if r["width"] == 1)

    decoder = SpeculativeDecoder(pair, TreeConfig(width=best["width"], max_depth=best["depth"], max_size=best["size"]))
    controller = FixedController(best["depth"], best["size"])
    hf_ar = HFGenerate(pair, assisted=False, name="hf_generate")
    hf_assisted = HFGenerate(pair, assisted=True, name="hf_assisted")
    assisted_cfgs = {"hf_assisted(const K=%d)" % best_chain["depth"]:
                     dict(num_assistant_tokens=best_chain["depth"], schedule="constant", confidence_threshold=0.4),
                     "hf_assisted(heuristic, default)":
                     dict(num_assistant_tokens=20, schedule="heuristic", confidence_threshold=0.4)}

    def run_ours_ar(ids):
        out = autoregressive_generate(pair, ids, max_new_tokens=n_new)
        return out.tokens, out.total_s

    def run_spec(ids):
        out = decoder.generate(ids, controller=controller, max_new_tokens=n_new)
        return out.tokens, out.total_s

    def timed_hf(method, cfg=None):
        def call(ids):
            if cfg is not None:
                configure_assistant(pair.draft, **cfg)
            if pair.device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            rec = method(ids, max_new_tokens=n_new, temperature=0.0, top_k=0, top_p=1.0, seed=None)
            if pair.device.type == "cuda":
                torch.cuda.synchronize()
            return rec.tokens, time.perf_counter() - t
        return call

    # Our methods time decoding only (prefill excluded); transformers' generate() can only be timed whole, so
    # our AR is also timed whole ("ar(whole call)") for the like-for-like comparison with generate().
    def run_ours_ar_whole(ids):
        t = time.perf_counter()
        out = autoregressive_generate(pair, ids, max_new_tokens=n_new)
        return out.tokens, time.perf_counter() - t

    def run_spec_whole(ids):
        t = time.perf_counter()
        out = decoder.generate(ids, controller=controller, max_new_tokens=n_new)
        return out.tokens, time.perf_counter() - t

    methods = {"ar": run_ours_ar, "ar(whole call)": run_ours_ar_whole, "hf_generate": timed_hf(hf_ar),
               f"spec W={best['width']} D={best['depth']} V={best['size']}": run_spec,
               "spec(whole call)": run_spec_whole}
    for name, cfg in assisted_cfgs.items():
        methods[name] = timed_hf(hf_assisted, cfg)
    for call in methods.values():  # warm-up every method
        call(heldout[0])
    totals = {name: [0, 0.0] for name in methods}
    outputs: dict[tuple[str, int], list[int]] = {}
    names = list(methods)
    for rep in range(args.repeats):
        for i, ids in enumerate(heldout):
            k = (i + rep) % len(names)
            for name in names[k:] + names[:k]:  # rotate the order per prompt
                tokens, seconds = methods[name](ids)
                totals[name][0] += len(tokens)
                totals[name][1] += seconds
                outputs[name, i] = tokens
    identical = {name: all(outputs[name, i] == outputs["ar", i] for i in range(len(heldout))) for name in names}

    def tps(name):
        return totals[name][0] / totals[name][1]

    print(f"\n{'method':42s} {'tokens':>7s} {'seconds':>8s} {'tok/s':>8s}  ratio  identical")
    for name in names:
        base = "ar(whole call)" if name.startswith("hf") or "whole" in name else "ar"
        print(f"{name:42s} {totals[name][0]:7d} {totals[name][1]:8.2f} {tps(name):8.1f}  "
              f"{tps(name) / tps(base):5.2f}x vs {base:14s} {identical[name]}")
    spec_whole = tps("spec(whole call)")
    print("\nratios (side by side, this run):")
    print(f"  our AR time / generate() time:        {tps('hf_generate') / tps('ar(whole call)'):.3f}  (goal <= 1.05)")
    print(f"  best static spec vs our AR:           {tps(names[3]) / tps('ar'):.2f}x (goal >= 1.6)")
    for name in assisted_cfgs:
        print(f"  best static spec vs {name}: {spec_whole / tps(name):.2f}x (goal >= 1.3)")


if __name__ == "__main__":
    main()
