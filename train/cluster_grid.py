"""Grid search on a WorkerPool: replay sweeps as Ray tasks, the live re-measurement of the top cells on the workers.

    result = grid_search_sharded(pool, ["traces/w4", "traces/w8"], val_prompts=prompts, live_top=20, out="grid.json")

1. Replay: one Ray task per trace (beam width) runs `specpilot.train.grid.grid_search` (replay phase) on the
   trace's files, shipped through the object store (no shared filesystem needed). A width is the unit because the
   hindsight oracle of a width needs all of its cells at once. The tasks run on the pool's reserved cores.
2. Live: every worker runs `measure_live` on its share of the validation prompts for ALL top cells plus the
   autoregressive baseline, interleaved on its own device. Each cell's speedup is a ratio within each worker;
   the merged speedup is the token-weighted mean of those, and the best cell is the one with the best merged
   speedup (with one worker that is the single-process choice: the best live tokens/s). Rows keep each
   worker's numbers under `workers`; `tokens_per_s` is pooled over workers.

The result has grid_search's layout (best, table, live, live_ar, oracle, meta) plus meta["workers"].
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable, Sequence

from specpilot.train.cluster import ShardTask, WorkerPool, import_ray, run_replay_grid

TRACE_FILES = ("trace.npz", "trace.json", "profile.json", "ar.json")


def trace_files(trace: str | Path, profile: str | Path | None = None) -> dict[str, bytes]:
    """{name: bytes} of a trace directory (or trace.npz path), `profile` replacing its profile.json."""
    path = Path(getattr(trace, "path", None) or trace)
    folder = path if path.is_dir() else path.parent
    if not (folder / "trace.npz").is_file():
        raise FileNotFoundError(f"no trace.npz in {folder}: record it with `specpilot record --out {folder}`")
    files = {name: (folder / name).read_bytes() for name in TRACE_FILES if (folder / name).is_file()}
    if profile is not None:
        files["profile.json"] = Path(profile).read_bytes()
    return files


def replay_sweeps(pool: WorkerPool, traces: Sequence, *, profile=None, **kwargs) -> list[dict]:
    """grid_search's replay phase for each trace, one Ray task each, on the pool's cores (retried once)."""
    ray = import_ray()
    task = ray.remote(run_replay_grid).options(num_cpus=1, max_retries=1, retry_exceptions=True,
                                               scheduling_strategy=pool.task_strategy())
    refs = [task.remote(ray.put(trace_files(t, profile)), kwargs) for t in traces]
    return ray.get(refs)


def _merge_live(results: list[tuple[list[dict], dict]], workers: list[dict]) -> tuple[list[dict], dict]:
    """Per-cell rows over workers: summed tokens/time/cycles, token-weighted mean of within-worker speedups."""
    rows = []
    for k in range(len(results[0][0])):
        parts = [(res[0][k], w) for res, w in zip(results, workers)]
        tokens = sum(p["tokens"] for p, _ in parts)
        seconds = sum(p["time_s"] for p, _ in parts)
        cycles = sum(p["cycles"] for p, _ in parts)
        row = {key: parts[0][0][key] for key in ("width", "depth", "size")}
        row.update(tokens=tokens, time_s=seconds, cycles=cycles,
                   tokens_per_s=tokens / seconds if seconds > 0 else float("nan"),
                   mean_accepted_length=tokens / cycles if cycles else float("nan"),
                   speedup=sum(p["tokens"] * p["speedup"] for p, _ in parts) / max(tokens, 1),
                   workers=[{"worker": w["worker"], "device": w["device"], "tokens": p["tokens"],
                             "tokens_per_s": p["tokens_per_s"], "speedup": p["speedup"]} for p, w in parts])
        rows.append(row)
    ars = [res[1] for res in results]
    tokens, seconds = sum(a["tokens"] for a in ars), sum(a["time_s"] for a in ars)
    ar = {"tokens": tokens, "time_s": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
          "workers": [{"worker": w["worker"], "device": w["device"], **a} for a, w in zip(ars, workers)]}
    return rows, ar


def live_measure(pool: WorkerPool, configs: list[dict], prompts: Sequence, *, max_new_tokens: int, repeats: int,
                 warmup: int, progress: Callable[[str], None] | None = None) -> tuple[list[dict], dict]:
    """measure_live of all `configs` (+ AR) on every worker, each on a contiguous share of `prompts`."""
    items = [getattr(p, "prompt", p) for p in prompts]
    n = min(len(pool), len(items))
    size = math.ceil(len(items) / n)
    kwargs = {"max_new_tokens": max_new_tokens, "repeats": repeats, "warmup": warmup}
    tasks = [ShardTask(i, "live", {"configs": configs, "prompts": items[lo:lo + size], "kwargs": kwargs},
                       list(range(lo, min(lo + size, len(items)))))
             for i, lo in enumerate(range(0, len(items), size))]
    outcomes = pool.run_shards(tasks, progress=progress)
    return _merge_live([o.result for o in outcomes], [o.worker for o in outcomes])


def grid_search_sharded(pool: WorkerPool, traces, *, profile=None, depths=None, sizes=None,
                        max_new_tokens: int | None = None, val_prompts: Sequence | None = None, live_top: int = 3,
                        live_repeats: int = 1, live_max_new_tokens: int | None = None, live_warmup: int = 1,
                        out: str | Path | None = None, heatmap: bool = True,
                        progress: Callable[[str], None] | None = None) -> dict:
    """`specpilot.train.grid.grid_search` on a pool (same arguments but `pair`; see the module docstring)."""
    from specpilot.train.grid import plot_heatmap

    started = time.perf_counter()
    items = [traces] if isinstance(traces, (str, Path)) or hasattr(traces, "arrays") else list(traces)
    sweeps = replay_sweeps(pool, items, profile=profile, depths=depths, sizes=sizes, max_new_tokens=max_new_tokens)
    table = sorted((row for s in sweeps for row in s["table"]), key=lambda r: -r["tokens_per_s"])
    oracle, sources = {}, []
    for s in sweeps:
        dup = set(oracle) & set(s["oracle"])
        if dup:
            raise ValueError(f"two traces with width {sorted(dup)}: give one trace per width")
        oracle.update(s["oracle"])
        sources.extend(s["meta"]["traces"])
    if progress:
        progress(f"replay: {len(table)} cells over {len(sweeps)} traces, best {table[0]}")
    live_rows, live_ar = [], None
    if val_prompts and live_top > 0:
        top = table[:live_top]
        dims = {s["width"]: (s["max_depth"], s["max_size"]) for s in sources}
        configs = [{"width": r["width"], "depth": r["depth"], "size": r["size"], "max_depth": dims[r["width"]][0],
                    "max_size": dims[r["width"]][1]} for r in top]
        live_rows, live_ar = live_measure(pool, configs, val_prompts, repeats=live_repeats, warmup=live_warmup,
                                          max_new_tokens=live_max_new_tokens or sources[0]["max_new_tokens"],
                                          progress=progress)
        for row, rep in zip(live_rows, top):
            row.update(replay_tokens_per_s=rep["tokens_per_s"], replay_rank=table.index(rep) + 1)
        chosen = max(live_rows, key=lambda r: r["speedup"])
        best = {k: chosen[k] for k in ("width", "depth", "size")}
        best.update(source="live", live_tokens_per_s=chosen["tokens_per_s"], live_speedup=chosen["speedup"])
    else:
        best = {k: table[0][k] for k in ("width", "depth", "size")}
        best["source"] = "replay"
    rb = next(r for r in table if (r["width"], r["depth"], r["size"]) == (best["width"], best["depth"], best["size"]))
    best.update(replay_tokens_per_s=rb["tokens_per_s"], replay_speedup=rb["speedup"],
                mean_accepted_length=rb["mean_accepted_length"])
    result = {"best": best, "table": table, "live": live_rows, "live_ar": live_ar, "oracle": oracle,
              "meta": {"traces": sources, "live_top": live_top if live_rows else 0, "live_repeats": live_repeats,
                       "live_prompts": len(val_prompts or []) if live_rows else 0,
                       "pair": sources[0].get("pair"), "workers": pool.workers,
                       "elapsed_s": time.perf_counter() - started, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "notes": "table: exact replay (one Ray task per trace); live: top cells re-measured on every "
                                "worker's share of the validation prompts, interleaved with AR on its device; "
                                "speedup = token-weighted mean of within-worker speedups; best = best live speedup"}}
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if heatmap:
            result["meta"]["heatmap"] = str(plot_heatmap(result, out.with_suffix(".png")).name)
        out.write_text(json.dumps(result, indent=1, default=float))
    return result
