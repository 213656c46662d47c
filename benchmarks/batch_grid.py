"""Per-batch-size grid on a real pair: record a trace, measure the batched latency profile (drafting/batch.py's own
forwards at each batch size), rank every static (depth, size) cell per batch size in batch replay, and optionally
re-check a few batch sizes live (batched AR vs the batch-1 best vs that size's best, interleaved per round).

    PYTHONPATH=.. python benchmarks/batch_grid.py --batch-sizes 1,2,4,8,16 --out /tmp/batch_grid --live 1,16

Prints the replay table (best static per batch size, its speedup over batched AR in the model, and where the batch-1
best lands at each size) and writes result.json + profile.json under --out.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    from specpilot.drafting import ModelPair, TreeConfig
    from specpilot.drafting.batch_ar import autoregressive_generate_batch
    from specpilot.drafting.control import FixedController
    from specpilot.drafting.decoder import SpeculativeDecoder
    from specpilot.envs.batch_replay import batch_static_sweep, best_per_batch_size
    from specpilot.envs.profile import measure_batch_profile
    from specpilot.envs.record import record_trace
    from specpilot.envs.replay import ReplayModel
    from specpilot.eval.suites import load_suite

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--max-size", type=int, default=32)
    ap.add_argument("--sizes", default="1,2,4,8,16,32")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--min-batches", type=int, default=1, help="batches per batch size in the profile (at least)")
    ap.add_argument("--live", default="", help="batch sizes to re-check live, e.g. 1,16 (default: none)")
    ap.add_argument("--live-rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    pair = ModelPair.from_pretrained(draft="embedded", device=args.device)
    tree = TreeConfig(width=args.width, max_depth=args.max_depth, max_size=args.max_size)
    prompts = [p.prompt for p in load_suite("train")][: args.prompts]
    started = time.perf_counter()
    trace = record_trace(pair, tree, prompts, max_new_tokens=args.max_new_tokens)
    trace.save(out / "trace")
    print(f"trace: {trace.num_prompts} prompts, {time.perf_counter() - started:.0f}s", flush=True)
    started = time.perf_counter()
    profile = measure_batch_profile(pair, tree, prompts, batch_sizes, max_new_tokens=args.max_new_tokens,
                                    min_batches=args.min_batches, progress=True)
    profile.save(out / "profile.json")
    print(f"batch profile: {time.perf_counter() - started:.0f}s", flush=True)
    model = ReplayModel(trace, profile)
    sizes = [s for s in (int(v) for v in args.sizes.split(",")) if s <= tree.max_size]
    cells = [(d, v) for d in range(1, tree.max_depth + 1) for v in sizes]
    rows = batch_static_sweep(model, cells, batch_sizes)
    best = best_per_batch_size(rows)
    b1 = best[0]
    print(f"\nreplay (model): best static per batch size; x = speedup over batched AR at that size; "
          f"B={b1['batch_size']} best d={b1['depth']} V={b1['size']} at each size")
    print("| B | best d | best V | tok/s | x AR | AR tok/s | B1-best x AR |")
    print("|---|---|---|---|---|---|---|")
    table = []
    for row in best:
        ar = next(r for r in rows if r["batch_size"] == row["batch_size"] and r["depth"] == 0)
        same = next(r for r in rows if r["batch_size"] == row["batch_size"]
                    and (r["depth"], r["size"]) == (b1["depth"], b1["size"]))
        table.append({"batch_size": row["batch_size"], "depth": row["depth"], "size": row["size"],
                      "tokens_per_s": row["tokens_per_s"], "speedup_vs_ar": row["speedup_vs_ar"],
                      "ar_tokens_per_s": ar["tokens_per_s"], "b1_best_speedup_vs_ar": same["speedup_vs_ar"]})
        print(f"| {row['batch_size']} | {row['depth']} | {row['size']} | {row['tokens_per_s']:.0f} | "
              f"{row['speedup_vs_ar']:.2f} | {ar['tokens_per_s']:.0f} | {same['speedup_vs_ar']:.2f} |", flush=True)
    live = []
    if args.live:
        decoder = SpeculativeDecoder(pair, tree)
        ids = [pair.encode(p) for p in prompts]
        for b in (int(x) for x in args.live.split(",")):
            cell = next(r for r in best if r["batch_size"] == b)
            batch = [ids[j % len(ids)] for j in range(b)]
            methods = {"ar": lambda: autoregressive_generate_batch(pair, batch, max_new_tokens=args.max_new_tokens),
                       "b1_best": lambda: decoder.generate_batch(batch, controller=FixedController(
                           b1["depth"], b1["size"]), max_new_tokens=args.max_new_tokens)}
            if cell["depth"]:
                methods["b_best"] = lambda: decoder.generate_batch(batch, controller=FixedController(
                    cell["depth"], cell["size"]), max_new_tokens=args.max_new_tokens)
            for fn in methods.values():  # warm-up, not kept
                fn()
            rates = {m: [] for m in methods}
            for r in range(args.live_rounds):
                order = list(methods)[r % len(methods):] + list(methods)[: r % len(methods)]
                for m in order:
                    t0 = time.perf_counter()
                    outs = methods[m]()
                    if pair.device.type == "cuda":
                        torch.cuda.synchronize()
                    rates[m].append(sum(len(o.tokens) for o in outs) / (time.perf_counter() - t0))
            ratios = {m: np.array(rates[m]) / np.array(rates["ar"]) for m in methods if m != "ar"}
            entry = {"batch_size": b, "tokens_per_s": {m: float(np.mean(v)) for m, v in rates.items()},
                     "vs_ar": {m: [float(v.mean()), float(v.min()), float(v.max())] for m, v in ratios.items()},
                     "b_best": [cell["depth"], cell["size"]]}
            live.append(entry)
            print(f"live B={b}: " + ", ".join(f"{m} {entry['tokens_per_s'][m]:.0f} tok/s" for m in methods)
                  + "; vs AR (mean [min, max] over rounds): "
                  + ", ".join(f"{m} {v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]" for m, v in entry["vs_ar"].items()),
                  flush=True)
    (out / "result.json").write_text(json.dumps({"table": table, "rows": rows, "live": live,
                                                 "device": str(pair.device), "dtype": str(pair.dtype),
                                                 "args": vars(args)}, indent=1, default=float))


if __name__ == "__main__":
    main()
