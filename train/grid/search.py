"""Grid search: the best static (width, depth, size) configuration, the baseline a learned policy must beat.

Two phases:
1. **Exact replay sweep.** Every (depth, size) cell of every recorded trace (one trace per beam width W) is
   replayed on the training task (`specpilot.envs.replay.replay_oracle`, all cells at once): exact accepted lengths
   under greedy decoding, times from the latency profile. This ranks all cells in seconds.
2. **Live re-measurement.** The top `live_top` cells are run with the real decoder
   (`SpeculativeDecoder.generate` + `FixedController`) on *validation* prompts, interleaved per prompt in a balanced
   order (`eval.rounds.method_order`) after a warm-up, with our autoregressive baseline alongside; the best live
   cell wins (replay predicts, the clock decides). Without a pair (or with live_top=0) the replay best wins.

Output (`out`, default grid.json) and a heat map of replay tokens/s over depth x size per width (grid.png):

    {"best": {"width", "depth", "size", "source": "live"|"replay", ...}, "best_drafting": {"width", "depth", "size"},
     "table": [{"width", "depth", "size", "tokens_per_s", "mean_accepted_length", "speedup", ...}, ...],
     "live": [{"width", "depth", "size", "tokens_per_s", "mean_accepted_length", "speedup", ...}, ...],
     "oracle": {"<W>": {"oracle": ..., "greedy_oracle": ...}}, "meta": {...}}

`table[*].speedup` is replay tokens/s over replay autoregressive tokens/s (`replay_ar`); `live[*].speedup` is live
tokens/s over live autoregressive tokens/s on the same prompts. `specpilot eval --grid grid.json` reads `best`.

    specpilot grid --traces RUN/traces --out RUN/grid.json --live-top 3
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from specpilot.artifacts.common import json_digest
from specpilot.artifacts.contract import check_pair, check_profile_belongs
from specpilot.artifacts.grid import save_grid
from specpilot.artifacts.trace import ARRAYS_FILE, is_trace
from specpilot.drafting.control import FixedController
from specpilot.drafting.errors import InputFileError, one_line
from specpilot.drafting.executor import as_executor
from specpilot.drafting.files import atomic_path, check_writable
from specpilot.drafting.folder_lock import holds_output
from specpilot.drafting.types import TreeConfig
from specpilot.envs.batch_replay import batch_static_sweep, best_per_batch_size
from specpilot.envs.oracle import replay_oracle
from specpilot.envs.profile import LatencyProfile, measure_batch_profile
from specpilot.envs.record import Trace
from specpilot.envs.replay import ReplayModel, load_profile, load_trace
from specpilot.policies.observation import default_size_actions
from specpilot.train.rl.validation import replay_ar


def default_sizes(trace: Trace) -> list[int]:
    """The sizes a grid sweeps by default: 1 and the size policy's actions for the trace's device, <= max_size."""
    sizes = {1, *default_size_actions(trace.header.get("device"))}
    return sorted(s for s in sizes if s <= trace.max_size) or [trace.max_size]


def measure_live(pair, configs: Sequence[dict], prompts: Sequence, *, max_new_tokens: int = 64, repeats: int = 1,
                 warmup: int = 1, progress: bool = False, executor=None) -> tuple[list[dict], dict]:
    """Run each static config ({"width", "depth", "size"}) and AR live on `prompts`, with the evaluation runner's
    interleaved loop and clock (`specpilot.eval.runner.measure_controllers`), on `pair` or on `executor`'s
    workers. Returns (rows in `configs` order, the AR row)."""
    from specpilot.eval.runner import measure_controllers

    if not prompts:
        raise ValueError("measure_live needs at least one prompt")
    controllers = {}
    for k, cfg in enumerate(configs):
        tree = TreeConfig(width=int(cfg["width"]), max_depth=max(1, int(cfg.get("max_depth", cfg["depth"]))),
                          max_size=max(1, int(cfg.get("max_size", cfg["size"]))))
        controllers[f"cfg{k}"] = (FixedController(int(cfg["depth"]), int(cfg["size"])), tree)
    res = measure_controllers(pair, controllers, prompts, tree=next(iter(controllers.values()))[1],
                              max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup, progress=progress,
                              executor=executor)
    rows = [{"width": int(cfg["width"]), "depth": int(cfg["depth"]), "size": int(cfg["size"]), **res[f"cfg{k}"]}
            for k, cfg in enumerate(configs)]
    return rows, res["ar"]


# ---------------------------------------------------------------------------------------------------------------------
# the search


def _as_list(traces) -> list:
    if isinstance(traces, (str, Path, Trace)):
        return [traces]
    return list(traces)


def check_cells(trace: Trace, depths: Sequence[int] | None, sizes: Sequence[int] | None) -> None:
    """Depths / sizes asked for that the trace cannot replay are refused (never quietly dropped or clipped),
    naming the values, the trace and its range."""
    where = f"the width-{trace.width} trace{f' {trace.path}' if trace.path else ''}"
    bad = sorted({int(d) for d in depths or () if not 0 <= int(d) <= trace.max_depth})
    if bad:
        raise ValueError(f"--depths {_span(bad)}: {where} was recorded to depth {trace.max_depth}; give depths in "
                         f"0..{trace.max_depth} (or record deeper: `specpilot record --max-depth N`)")
    bad = sorted({int(v) for v in sizes or () if not 1 <= int(v) <= trace.max_size})
    if bad:
        raise ValueError(f"--sizes {_span(bad)}: {where} was recorded with max_size {trace.max_size}; give sizes in "
                         f"1..{trace.max_size} (or record larger trees: `specpilot record --max-size N`)")


def _span(values: list[int]) -> str:
    return ",".join(map(str, values)) if len(values) <= 4 else f"{values[0]}..{values[-1]} ({len(values)} values)"


def _prompts_digest(prompts) -> str | None:
    """A short digest of a trace's prompts (their texts and token counts): equal digests, equal prompts."""
    if not isinstance(prompts, list):
        return None
    return json_digest(prompts)


def check_comparable(sources: list[dict]) -> None:
    """Traces of several widths are ranked in one table: they must be replays of one pair, in one dtype, on the same
    prompts with the same budget, or the best cell is picked across different workloads (ValueError naming both)."""
    first = sources[0]
    for other in sources[1:]:
        where = f"traces {first['trace']} (W={first['width']}) and {other['trace']} (W={other['width']})"
        check_pair(first["pair"], other["pair"], expected_from=f"trace {first['trace']}",
                   got_from=f"trace {other['trace']}", fix="give one trace per width, all recorded with one pair")
        for key, what in (("dtype", "dtypes"), ("prompts", "prompts"), ("max_new_tokens", "token budgets")):
            if first.get(key) is not None and other.get(key) is not None and first[key] != other[key]:
                shown = "" if key == "prompts" else f" ({first[key]} vs {other[key]})"
                raise ValueError(f"{where} were recorded with different {what}{shown}: their replay speeds are not "
                                 "comparable; record every width with the same pair, dtype, --suite/--limit and "
                                 "--max-new-tokens")


def _replay_sweep(item, profile, depths, sizes, max_new_tokens, progress) -> tuple[list[dict], dict, dict]:
    """Every (depth, size) cell of one trace under replay: (table rows, ceilings, source description)."""
    trace = load_trace(item)
    model = ReplayModel(trace, load_profile(profile, trace), max_new_tokens=max_new_tokens)
    width = trace.width
    check_cells(trace, depths, sizes)
    cell_depths = sorted({int(d) for d in (range(0, trace.max_depth + 1) if depths is None else depths)
                          if 0 <= int(d) <= trace.max_depth})
    cell_sizes = sorted({min(int(s), trace.max_size) for s in (sizes or default_sizes(trace)) if int(s) >= 1})
    if not cell_depths or not cell_sizes:
        raise ValueError(f"empty grid for the width-{width} trace: depths {depths} / sizes {sizes} fall outside "
                         f"0..{trace.max_depth} / 1..{trace.max_size}")
    result = replay_oracle(model, depths=cell_depths, sizes=cell_sizes)
    ar = replay_ar(model)
    rows: list[dict] = []
    for row in result["static"]:
        if row["depth"] == 0:  # a plain step verifies nothing: one cell, whatever the size
            if any(r["depth"] == 0 for r in rows):
                continue
            row = {**row, "size": 0}
        rows.append({"width": width, **row, "speedup": row["tokens_per_s"] / ar["tokens_per_s"]})
    ceilings = {"oracle": result["oracle"], "greedy_oracle": result["greedy_oracle"], "ar": ar,
                "max_depth": trace.max_depth, "max_size": trace.max_size}
    source = {"trace": str(trace.path) if trace.path else None, "width": width, "max_depth": trace.max_depth,
              "max_size": trace.max_size, "pair": trace.header.get("pair"), "device": trace.header.get("device"),
              "positions": trace.header.get("positions"), "max_new_tokens": model.max_new_tokens,
              "depths": cell_depths, "sizes": cell_sizes, "dtype": trace.header.get("dtype"),
              "prompts": _prompts_digest(trace.header.get("prompts"))}
    if progress:
        best = result["best_static"]
        print(f"  replay grid W={width}: {len(rows)} cells, best d={best['depth']} V={best['size']} "
              f"{best['tokens_per_s']:.1f} tok/s (oracle {result['oracle']['tokens_per_s']:.1f})", flush=True)
    return rows, ceilings, source


def _batch_profile(trace: Trace, profile, batch_profile, batch_sizes: Sequence[int], pair, *,
                   prompts: int, max_new_tokens: int, out: Path | None, progress: bool) -> LatencyProfile:
    """A profile covering `batch_sizes` for `trace`: `batch_profile` when given, else the trace's own when it has
    them, else measured now with `pair` (drafting/batch.py's batched forwards) on the trace's first `prompts`
    prompts, saved beside grid.json (<stem>.profile_w<W>.json)."""
    if batch_profile is not None and not isinstance(batch_profile, LatencyProfile):
        check_profile_belongs(trace, batch_profile, given=f"--batch-profile {batch_profile}",
                              fix="leave --batch-profile out to measure the batch sizes with the trace's pair now")
    given = load_profile(batch_profile if batch_profile is not None else profile, trace)
    if given.batch_sizes and max(batch_sizes) <= given.batch_sizes[-1]:
        return given
    if batch_profile is not None:
        raise ValueError(f"--batch-profile {batch_profile} measured batch sizes {given.batch_sizes or [1]}, not up to "
                         f"{max(batch_sizes)}: measure it again, or leave --batch-profile out to measure now")
    if pair is None:
        raise ValueError(f"the width-{trace.width} trace's profile has no batch sizes up to {max(batch_sizes)}: give "
                         "a pair to measure them (--target/--draft, the trace's pair) or --batch-profile FILE")
    check_pair(trace.header.get("pair"), pair.identity(), expected_from=f"trace {trace.path}",
               got_from="the batch profile's pair", fix="give the pair the trace was recorded with")
    tree = TreeConfig(width=trace.width, max_depth=trace.max_depth, max_size=trace.max_size)
    ids = [list(trace.prompt(i)) for i in range(min(trace.num_prompts, max(prompts, 1)))]
    measured = measure_batch_profile(pair, tree, ids, sorted(set(batch_sizes)), base=given,
                                     max_new_tokens=max_new_tokens, progress=progress)
    if out is not None:
        measured.save(out.with_name(f"{out.stem}.profile_w{trace.width}.json"))
    return measured


def _batch_phase(traces: list, profile, batch_profile, batch_sizes: Sequence[int], table: list[dict], pair, *,
                 max_new_tokens: int | None, batch_prompts: int, out: Path | None, progress: bool
                 ) -> tuple[list[dict], list[dict], list[dict]]:
    """Every drafting cell of the replay table at every batch size, in batch replay (`envs/batch_replay.py`), with
    batched AR (depth 0) as each size's baseline. Returns (per-batch-size best rows, every row, profiles used)."""
    rows: list[dict] = []
    used: list[dict] = []
    for item in traces:
        trace = load_trace(item)
        measured = _batch_profile(trace, profile, batch_profile, batch_sizes, pair, prompts=batch_prompts,
                                  max_new_tokens=max_new_tokens or min(trace.max_new_tokens, 64), out=out,
                                  progress=progress)
        model = ReplayModel(trace, measured, max_new_tokens=max_new_tokens)
        cells = [(r["depth"], r["size"]) for r in table if r["width"] == trace.width and r["depth"] >= 1]
        swept = batch_static_sweep(model, cells, list(batch_sizes))
        rows += [{"width": trace.width, **{k: r[k] for k in ("batch_size", "depth", "size", "tokens_per_s",
                                                              "mean_accepted_length", "speedup_vs_ar")}}
                 for r in swept]
        used.append({"width": trace.width, "batch_sizes": measured.batch_sizes,
                     "measured": {b: measured.batch[str(b)].get("meta", {}).get("cycles") for b in
                                  measured.batch_sizes}})
    best = []
    for row in best_per_batch_size(rows):
        ar = next(r for r in rows if r["batch_size"] == row["batch_size"] and r["depth"] == 0)
        best.append({**row, "ar_tokens_per_s": ar["tokens_per_s"], "source": "replay"})
        if progress:
            print(f"  batch replay B={row['batch_size']}: best W={row['width']} d={row['depth']} V={row['size']} "
                  f"{row['tokens_per_s']:.1f} tok/s ({row['speedup_vs_ar']:.2f}x batched AR)", flush=True)
    return best, rows, used


BATCH_LIVE_RULE = ("live-best of the top cells and batched AR at B (generate_batch, interleaved): a cell only when "
                   "it beats batched AR live and its paired 95% interval over AR does not lie below 1; else depth 0")


def pick_batch_live(live: list[dict]) -> dict | None:
    """BATCH_LIVE_RULE over one batch size's live cells: the live-best cell, or None (use depth 0, batched AR) when
    batched AR measured faster than it, or its paired interval over batched AR lies below 1 (never slower)."""
    chosen = max(live, key=lambda r: r["live_tokens_per_s"])
    high = (chosen.get("live_speedup_ci") or [None, None])[1]
    below = high is not None and high == high and high < 1.0
    return None if below or not chosen["live_speedup_vs_ar"] > 1.0 else chosen


def _batch_live_phase(per_batch: list[dict], batch_rows: list[dict], sources: list[dict], pair, val_prompts, *,
                      live_top: int, live_sizes: Sequence[int], repeats: int, max_new_tokens: int, warmup: int,
                      progress: bool) -> list[dict]:
    """The top `live_top` drafting cells of the batch replay at each B of `live_sizes` re-measured live with
    `generate_batch` (`specpilot.eval.batched.evaluate_batches`, interleaved with batched AR, greedy identity
    checked) on the validation prompts; each such per_batch_size row gets live fields and its choice corrected
    by BATCH_LIVE_RULE. Returns the live rows measured (every cell, every B)."""
    from specpilot.eval.batched import evaluate_batches
    from specpilot.eval.rounds import RoundPlan

    max_dims = {s["width"]: (s["max_depth"], s["max_size"]) for s in sources}
    ids = [pair.encode(p) for p in val_prompts]
    measured: list[dict] = []
    for row in per_batch:
        size = row["batch_size"]
        if size not in live_sizes:
            continue
        at_b = sorted((r for r in batch_rows if r["batch_size"] == size and r["depth"] >= 1),
                      key=lambda r: -r["tokens_per_s"])[:live_top]
        cells = {f"w{r['width']}_d{r['depth']}_s{r['size']}": r for r in at_b}
        controllers = {name: (FixedController(r["depth"], r["size"]),
                              TreeConfig(width=r["width"], max_depth=max_dims[r["width"]][0],
                                         max_size=max_dims[r["width"]][1])) for name, r in cells.items()}
        result = evaluate_batches(ids, pair=pair, batch_sizes=[size], tree=next(iter(controllers.values()))[1],
                                  controllers=controllers, max_new_tokens=max_new_tokens,
                                  plan=RoundPlan.make(repeats), warmup=warmup)
        section = {r["method"]: r for r in result["batch_sizes"][0]["methods"]}
        if not all(r["identical_to_ar"] for r in section.values()):
            raise RuntimeError(f"batch size {size}: a live cell's greedy output differs from batched AR's")
        ar = section["ar"]["tokens_per_s"]
        live = []
        for name, cell in cells.items():
            got = section[name]
            live.append({**{k: cell[k] for k in ("width", "depth", "size", "batch_size")},
                         "live_tokens_per_s": got["tokens_per_s"], "live_speedup_vs_ar": got["speedup"],
                         "live_speedup_ci": got["speedup_ci"], "replay_tokens_per_s": cell["tokens_per_s"]})
        measured += live
        chosen = max(live, key=lambda r: r["live_tokens_per_s"])
        slower = pick_batch_live(live) is None
        replay_choice = {k: row[k] for k in ("width", "depth", "size")}
        if slower:
            row.update(depth=0, size=0, live_tokens_per_s=ar, live_speedup_vs_ar=1.0, live_speedup_ci=[1.0, 1.0])
        else:
            row.update({k: chosen[k] for k in ("width", "depth", "size", "live_tokens_per_s", "live_speedup_vs_ar",
                                                "live_speedup_ci")})
        # the row's replay numbers follow the cell it now holds (batched AR's row for depth 0)
        rep = next((r for r in batch_rows if r["batch_size"] == size and r["depth"] == row["depth"]
                    and (row["depth"] == 0 or (r["width"], r["size"]) == (row["width"], row["size"]))), None)
        if rep is not None:
            row.update({k: rep[k] for k in ("tokens_per_s", "speedup_vs_ar", "mean_accepted_length") if k in rep})
        row.update(source="live", live_ar_tokens_per_s=ar, replay_choice=replay_choice, live_rule=BATCH_LIVE_RULE,
                   live_cells=len(live))
        if progress:
            ci = [float("nan") if v is None else float(v) for v in chosen["live_speedup_ci"]]
            print(f"  batch live B={size}: best of {len(live)} W={chosen['width']} d={chosen['depth']} "
                  f"V={chosen['size']} {chosen['live_speedup_vs_ar']:.2f}x batched AR [{ci[0]:.2f}, {ci[1]:.2f}]"
                  f"{' -> depth 0 (not faster than batched AR)' if slower else ''}", flush=True)
    return measured


def _live_phase(table: list[dict], sources: list[dict], executor, val_prompts, *, live_top: int, repeats: int,
                max_new_tokens: int | None, warmup: int, progress: bool) -> tuple[list[dict], dict]:
    """The top `live_top` replay cells re-measured live on the validation prompts (with AR alongside)."""
    top = table[:live_top]
    max_dims = {s["width"]: (s["max_depth"], s["max_size"]) for s in sources}
    configs = [{**{k: r[k] for k in ("width", "depth", "size")}, "max_depth": max_dims[r["width"]][0],
                "max_size": max_dims[r["width"]][1]} for r in top]
    rows, ar = measure_live(None, configs, val_prompts, max_new_tokens=max_new_tokens or sources[0]["max_new_tokens"],
                            repeats=repeats, warmup=warmup, progress=progress, executor=executor)
    for row, rep in zip(rows, top):
        row["replay_tokens_per_s"] = rep["tokens_per_s"]
        row["replay_rank"] = table.index(rep) + 1
    return rows, ar


def sampled_candidates(table: list[dict], max_depth: int = 3) -> list[dict]:
    """Cells worth measuring at a sampling temperature, where greedy replay cannot rank them: plain steps (depth 0)
    and, for each depth 1..max_depth, the replay-best size at that depth (shallow trees: sampled text is less
    predictable)."""
    picked = [next(r for r in table if r["depth"] == 0)] if any(r["depth"] == 0 for r in table) else []
    for depth in range(1, max_depth + 1):
        rows = [r for r in table if r["depth"] == depth]
        if rows:
            picked.append(rows[0])  # the table is sorted by replay tokens/s
    return picked


def _sampled_phase(table: list[dict], sources: list[dict], executor, val_prompts, temperature: float, *,
                   max_new_tokens: int | None, repeats: int, warmup: int, progress: bool) -> tuple[dict, list[dict]]:
    """The best of `sampled_candidates`, measured live at `temperature` (best cell, measured rows)."""
    from specpilot.eval.runner import measure_controllers

    cells = sampled_candidates(table)
    max_dims = {s["width"]: (s["max_depth"], s["max_size"]) for s in sources}
    controllers = {f"cell{k}": (FixedController(r["depth"], r["size"]),
                                TreeConfig(width=r["width"], max_depth=max_dims[r["width"]][0],
                                           max_size=max_dims[r["width"]][1])) for k, r in enumerate(cells)}
    plain = next((f"cell{k}" for k, r in enumerate(cells) if r["depth"] == 0), "ar")
    res = measure_controllers(None, controllers, val_prompts, tree=next(iter(controllers.values()))[1],
                              max_new_tokens=max_new_tokens or sources[0]["max_new_tokens"], repeats=repeats,
                              warmup=warmup, temperature=temperature, progress=progress, baseline=plain,
                              executor=executor)
    rows = [{**{key: r[key] for key in ("width", "depth", "size")}, **res[f"cell{k}"]} for k, r in enumerate(cells)]
    best = pick_sampled(rows)
    return {**{key: best[key] for key in ("width", "depth", "size", "tokens_per_s", "speedup")},
            "rule": SAMPLED_RULE}, rows


SAMPLED_RULE = "fastest cell whose paired 95% interval over plain steps lies above 1, else plain steps"


def pick_sampled(rows: list[dict]) -> dict:
    """The cell to use at a sampling temperature: speculation only where it measurably beats plain target steps.

    Each row's `vs_baseline` is its paired ratio over the plain-step cell (depth 0). Picking the fastest point
    estimate would pick noise when every cell is within a few percent of plain decoding (as at T=1 on a small
    target), and a user who turns speculation on must never end up slower than without it."""
    plain = next((r for r in rows if r["depth"] == 0), None)
    proven = [r for r in rows if r["depth"] > 0 and (r.get("vs_baseline") or {}).get("ci", [float("nan")])[0] > 1.0]
    if proven or plain is None:
        return max(proven or rows, key=lambda r: r["tokens_per_s"])
    return plain


@holds_output("out", what="grid result", kind="file")
def grid_search(
    traces: str | Path | Trace | Sequence[str | Path | Trace],
    *,
    profile: str | Path | None = None,
    depths: Sequence[int] | None = None,
    sizes: Sequence[int] | None = None,
    max_new_tokens: int | None = None,
    pair=None,
    executor=None,
    val_prompts: Sequence | None = None,
    live_top: int = 3,
    live_repeats: int = 1,
    live_max_new_tokens: int | None = None,
    live_warmup: int = 1,
    sampled_temperatures: Sequence[float] = (),
    batch_sizes: Sequence[int] | None = None,
    batch_profile: str | Path | LatencyProfile | None = None,
    batch_prompts: int = 8,
    batch_live_sizes: Sequence[int] | None = None,
    out: str | Path | None = None,
    heatmap: bool = True,
    progress: bool = False,
) -> dict:
    """Sweep (width, depth, size) exactly on replay, re-measure the top `live_top` live, return (and write) the result.

    traces: one trace (dir / trace.npz / Trace) per beam width, recorded on the *training* task; each carries its
        profile.json unless `profile` is given (only sensible with one trace).
    depths: default 0..max_depth of each trace (0: plain target steps, never drafting); sizes: default
        `default_sizes(trace)` (clipped to max_size).
    pair, val_prompts: the live phase (skipped when either is missing or live_top == 0). val_prompts must be
        validation prompts (never held-out ones: the result selects a baseline). executor: instead of pair, run the
        live phases on its workers (`specpilot.drafting.executor`, e.g. a Ray WorkerPool), each on its share of
        the prompts, pooled over all (prompt, round) units: the same result, plus meta["workers"].
    live_max_new_tokens: default the trace's max_new_tokens.
    sampled_temperatures: temperatures > 0 at which `sampled_candidates` are also measured live (greedy replay
        cannot rank cells for sampled decoding); the best per temperature goes to `best_by_temperature`.
    batch_sizes: also rank every drafting cell at these batch sizes in batch replay (`envs/batch_replay.py`: the
        traces' rows batched, each accepting its own recorded length, cycles timed per batch size) with batched AR
        as each size's baseline -> `per_batch_size` (the best cell per size) and `batch_table`. The per-batch-size
        profile: `batch_profile`, else the trace's profile when it has those sizes, else measured now with `pair`
        (the executor's local pair) on `batch_prompts` of the trace's prompts. With a live phase (pair or
        executor, val_prompts, live_top > 0) the top `live_top` drafting cells at each B of `batch_live_sizes`
        (default: the smallest and the largest batch size) are re-measured live with `generate_batch`, interleaved
        with batched AR, on val_prompts: those per_batch_size rows get live_tokens_per_s, live_speedup_vs_ar and
        live_speedup_ci (paired 95% interval) and take the live-best cell, or depth 0 where it is slower than AR
        (`BATCH_LIVE_RULE`); `batch_live` holds every cell measured.
    out: path of grid.json; the heat map goes next to it as <stem>.png (heatmap=False skips it).
    """
    if out is not None:
        check_writable(out, kind="file", what="grid result")  # before the sweep, not after it
    started = time.perf_counter()
    executor = as_executor(pair, executor)
    table: list[dict] = []
    oracle: dict[str, dict] = {}
    sources: list[dict] = []
    for item in _as_list(traces):
        rows, oracle_w, source = _replay_sweep(item, profile, depths, sizes, max_new_tokens, progress)
        if str(source["width"]) in oracle:
            raise ValueError(f"two traces with width {source['width']}: give one trace per width")
        table += rows
        oracle[str(source["width"])], sources = oracle_w, sources + [source]
    check_comparable(sources)
    table.sort(key=lambda r: -r["tokens_per_s"])
    if executor is not None and val_prompts and (live_top > 0 or any(t > 0 for t in sampled_temperatures)):
        identity = executor.workers[0]["pair"]  # the live phase must measure the pair the replay table was recorded with
        for source in sources:
            check_pair(source["pair"], identity, expected_from=f"trace {source['trace']}",
                       got_from="the live phase's pair",
                       fix="give traces recorded with this pair, or load the traces' pair for the live phase")
    live_rows, live_ar = [], None
    if executor is not None and val_prompts and live_top > 0:
        live_rows, live_ar = _live_phase(table, sources, executor, val_prompts, live_top=live_top,
                                         repeats=live_repeats, max_new_tokens=live_max_new_tokens,
                                         warmup=live_warmup, progress=progress)
        chosen = max(live_rows, key=lambda r: r["tokens_per_s"])
        best = {k: chosen[k] for k in ("width", "depth", "size")}
        best.update(source="live", live_tokens_per_s=chosen["tokens_per_s"], live_speedup=chosen.get("speedup"))
    else:
        best = {**{k: table[0][k] for k in ("width", "depth", "size")}, "source": "replay"}
    by_temperature, sampled_rows = {}, {}
    if executor is not None and val_prompts:
        for temperature in (t for t in sampled_temperatures if t > 0):
            by_temperature[f"{temperature:g}"], sampled_rows[f"{temperature:g}"] = _sampled_phase(
                table, sources, executor, val_prompts, float(temperature), max_new_tokens=live_max_new_tokens,
                repeats=live_repeats, warmup=live_warmup, progress=progress)
    rb = next(r for r in table if (r["width"], r["depth"], r["size"]) == (best["width"], best["depth"], best["size"]))
    best.update(replay_tokens_per_s=rb["tokens_per_s"], replay_speedup=rb["speedup"],
                mean_accepted_length=rb["mean_accepted_length"])

    per_batch, batch_rows, batch_meta = [], [], []
    if batch_sizes:
        per_batch, batch_rows, batch_meta = _batch_phase(
            _as_list(traces), profile, batch_profile, sorted({int(b) for b in batch_sizes}), table,
            getattr(executor, "pair", None), max_new_tokens=max_new_tokens, batch_prompts=batch_prompts,
            out=Path(out) if out is not None else None, progress=progress)
    batch_live: list[dict] = []
    local = getattr(executor, "pair", None)
    if per_batch and local is not None and val_prompts and live_top > 0:
        sizes_b = [r["batch_size"] for r in per_batch]
        wanted = sorted({min(sizes_b), max(sizes_b)} if batch_live_sizes is None else
                        {int(b) for b in batch_live_sizes})
        batch_live = _batch_live_phase(per_batch, batch_rows, sources, local, val_prompts, live_top=live_top,
                                       live_sizes=wanted, repeats=max(2, live_repeats),
                                       max_new_tokens=live_max_new_tokens or sources[0]["max_new_tokens"],
                                       warmup=live_warmup, progress=progress)

    result = {
        "best": best,
        "best_by_temperature": by_temperature,
        "sampled_live": sampled_rows,
        # the partner config of training stages: the best cell that drafts (the best may be plain steps, depth 0)
        "best_drafting": next({k: r[k] for k in ("width", "depth", "size")} for r in table if r["depth"] >= 1),
        "table": table,
        "live": live_rows,
        "live_ar": live_ar,
        "oracle": oracle,
        # the best static cell per batch size in batch replay (speedup over batched AR at that size)
        "per_batch_size": per_batch,
        "batch_table": batch_rows,
        "batch_live": batch_live,
        "meta": {"traces": sources, "batch_profiles": batch_meta, "live_top": live_top if live_rows else 0, "live_repeats": live_repeats,
                 "live_prompts": len(val_prompts or []) if live_rows else 0,
                 "pair": executor.workers[0]["pair"] if executor is not None and live_rows else None,
                 "workers": executor.workers if executor is not None else [],
                 "elapsed_s": time.perf_counter() - started, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "notes": "table: exact replay on the training trace(s); live: top cells re-measured on validation "
                          "prompts, interleaved; best = best live cell (replay best when no live phase)"},
    }
    if out is not None:
        out = Path(out)
        save_grid(out, result)  # first: the sweep is never lost to its figure
        if heatmap:
            result["meta"]["heatmap"] = str(plot_heatmap(result, out.with_suffix(".png")).name)
            save_grid(out, result)
    return result


def plot_heatmap(result: dict, path: str | Path) -> Path:
    """Replay tokens/s over depth x size, one panel per width; the chosen best cell is outlined."""
    from specpilot.eval.plots import pyplot

    plt = pyplot()

    path = Path(path)
    widths = sorted({r["width"] for r in result["table"]})
    fig, axes = plt.subplots(1, len(widths), figsize=(5.5 * len(widths), 4.2), squeeze=False)
    best = result["best"]
    for ax, w in zip(axes[0], widths):
        rows = [r for r in result["table"] if r["width"] == w]
        ds = sorted({r["depth"] for r in rows})
        vs = sorted({r["size"] for r in rows})
        grid = np.full((len(ds), len(vs)), np.nan)
        for r in rows:
            grid[ds.index(r["depth"]), vs.index(r["size"])] = r["tokens_per_s"]
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(vs)), [str(v) for v in vs])
        ax.set_yticks(range(len(ds)), [str(d) for d in ds])
        ax.set_xlabel("verification size V")
        ax.set_ylabel("draft depth D")
        ax.set_title(f"replay tokens/s, W={w}")
        if len(ds) * len(vs) <= 160:
            top = np.nanmax(grid)
            for a in range(len(ds)):
                for b in range(len(vs)):
                    if np.isfinite(grid[a, b]):
                        ax.text(b, a, f"{grid[a, b]:.0f}", ha="center", va="center", fontsize=6,
                                color="black" if grid[a, b] > 0.6 * top else "white")
        if best["width"] == w and best["depth"] in ds and best["size"] in vs:
            ax.add_patch(plt.Rectangle((vs.index(best["size"]) - 0.5, ds.index(best["depth"]) - 0.5), 1, 1,
                                       fill=False, edgecolor="red", linewidth=2))
        fig.colorbar(im, ax=ax, label="tokens/s")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# CLI: specpilot grid


def _live_text(row: dict) -> str:
    ci = [float("nan") if v is None else float(v) for v in row.get("live_speedup_ci") or [None, None]]
    replay = row.get("replay_choice") or {}
    moved = (f", replay chose d={replay.get('depth')} V={replay.get('size')}"
             if (replay.get("depth"), replay.get("size")) != (row["depth"], row["size"]) else "")
    return (f"; live {float(row['live_tokens_per_s']):.1f} tok/s {float(row['live_speedup_vs_ar']):.2f}x batched AR "
            f"[{ci[0]:.2f}, {ci[1]:.2f}]{moved}")


def summary_lines(result: dict) -> list[str]:
    """The grid's result as lines: the live cells (tokens/s and speedup over AR with its interval, like replay), then
    the best config. Numbers are formatted, never printed as numpy reprs."""
    lines = []
    if result["live"]:
        lines.append("live (validation prompts, interleaved with AR):")
        for row in result["live"]:
            ci = (row.get("vs_baseline") or {}).get("ci") or [float("nan")] * 2
            lines.append(f"  W={row['width']} depth={row['depth']} size={row['size']}: "
                         f"{float(row['tokens_per_s']):.1f} tok/s, {float(row['speedup']):.2f}x AR "
                         f"[{float(ci[0]):.2f}, {float(ci[1]):.2f}] (replay rank {row.get('replay_rank')}, "
                         f"{float(row.get('replay_tokens_per_s', float('nan'))):.1f} tok/s on replay)")
    best = result["best"]
    live = (f", live {float(best['live_tokens_per_s']):.1f} tok/s ({float(best['live_speedup']):.2f}x AR)"
            if best["source"] == "live" else "")
    lines.append(f"best static config ({best['source']}): W={best['width']} depth={best['depth']} size={best['size']}, "
                 f"replay {float(best['replay_tokens_per_s']):.1f} tok/s ({float(best['replay_speedup']):.2f}x AR)"
                 + live)
    per_batch = result.get("per_batch_size") or []
    if per_batch:
        first = per_batch[0]
        lines.append(f"best static per batch size (batch replay; x = over batched AR at that size; last column: the "
                     f"B={first['batch_size']} best W={first['width']} d={first['depth']} V={first['size']} there):")
        for row in per_batch:
            same = next((r for r in result.get("batch_table") or [] if r["batch_size"] == row["batch_size"]
                         and (r["width"], r["depth"], r["size"]) == (first["width"], first["depth"], first["size"])),
                        None)
            lines.append(f"  B={row['batch_size']}: W={row['width']} depth={row['depth']} size={row['size']}, "
                         f"{float(row['tokens_per_s']):.1f} tok/s ({float(row['speedup_vs_ar']):.2f}x)"
                         + (f"; B={first['batch_size']} best {float(same['speedup_vs_ar']):.2f}x" if same else "")
                         + (_live_text(row) if row.get("source") == "live" else ""))
    for t, cell in (result.get("best_by_temperature") or {}).items():
        lines.append(f"best at T={t}: W={cell['width']} depth={cell['depth']} size={cell['size']}, "
                     f"{float(cell['tokens_per_s']):.1f} tok/s ({float(cell['speedup']):.2f}x)")
    return lines


def resolve_train_trace(path: str | Path) -> Path:
    """A trace directory, or a traces directory holding `train/` (as `specpilot train` lays out RUN/traces)."""
    path = Path(path)
    if is_trace(path) or path.suffix == ".npz":
        return path
    if is_trace(path / "train"):
        return path / "train"
    raise FileNotFoundError(f"no trace under {path}: expected {ARRAYS_FILE} there or in {path / 'train'} "
                            "(record one with `specpilot record --suite train --out DIR`)")


def int_list(text: str | list[int] | None) -> list[int] | None:
    """"0-12" / "2,4,6" -> a list of ints (a list, already parsed by the CLI, is returned as it is)."""
    if not text or isinstance(text, list):
        return text or None
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specpilot.train.cli_args import grid_arguments

    grid_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from specpilot.drafting.folder_lock import output_lock

    with output_lock(args.out, what="--out", kind="file"):  # held from before the traces load to the result
        check_replaceable_grid(args.out)
        return _run(args)


def check_replaceable_grid(out: str | Path) -> None:
    """InputFileError when `out` exists and is not a grid result: --out replaces an older grid.json, never a file of
    another kind (a run's policies.json, a trace's header, a user's file), which would be lost."""
    from specpilot.artifacts.grid import GridResult

    path = Path(out)
    if not path.is_file():
        return
    try:
        GridResult.load(path)
    except (InputFileError, OSError, ValueError) as err:
        raise InputFileError(f"--out {path} exists and is not a grid result ({one_line(err)}): it would be "
                             "replaced; choose another path for the grid (e.g. RUN/grid.json), or move that file "
                             "away") from None


def _run(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from specpilot.drafting.cliargs import given_options
    from specpilot.train.scale.cluster_cli import open_executor

    live_only = [o for o in ("--val-suite", "--val-limit", "--live-repeats") if o in given_options(args)]
    if args.live_top == 0 and live_only:
        raise ValueError(f"{', '.join(live_only)} shape(s) the live phase, which --live-top 0 skips: drop "
                         f"{'them' if len(live_only) > 1 else 'it'}, or give --live-top K > 0")
    traces = [resolve_train_trace(t) for t in args.traces]
    loaded = [load_trace(trace) for trace in traces]
    for trace in loaded:  # every trace (and its profile) readable, every cell asked for in range, before the sweep
        load_profile(None, trace)
        check_cells(trace, args.depths, args.sizes)
    prompts = None
    if args.live_top > 0:
        from specpilot.eval.suites import load_suite

        suite = load_suite(args.val_suite)
        held = sorted({p.split for p in suite} & {"heldout"})
        if args.val_suite == "heldout" or held:
            raise ValueError(f"--val-suite {args.val_suite}: the grid's live phase selects the baseline, and "
                             "held-out prompts are never used for selection; use validation prompts (the default)")
        chosen = list(suite)[: args.val_limit or None]
        prompts = [p.prompt for p in chosen]
    pair = None
    batch_sizes = getattr(args, "batch_sizes", None)
    unmeasured = bool(batch_sizes) and getattr(args, "batch_profile", None) is None and any(
        max(batch_sizes) > max(load_profile(None, t).batch_sizes or [1]) for t in loaded)
    if unmeasured and getattr(args, "ray", None):  # said now, not after the live phase ran on the workers
        raise ValueError(f"--batch-sizes up to {max(batch_sizes)} go beyond the traces' latency profiles, and with "
                         "--ray no pair runs here to measure them where the workers decode: give --batch-profile "
                         "FILE (a profile measured at those batch sizes on the workers' hardware, e.g. by this "
                         "command without --ray there), or run without --ray")
    if unmeasured and args.live_top == 0:
        from specpilot.drafting.cliargs import load_pair

        pair = load_pair(args)  # the traces' profiles lack these batch sizes: measured now with the pair
    with open_executor(args) if args.live_top > 0 else nullcontext() as executor:
        if executor is not None:  # prompts too long for the context refused now, as eval does (the runner would
            # keep their last tokens: a baseline chosen on other text than asked); counted by a worker, also on Ray
            from specpilot.drafting.checks import check_prompt_lengths
            from specpilot.drafting.executor import prompt_lengths

            deepest = max(loaded, key=lambda t: t.max_depth)
            lengths, context = prompt_lengths(executor, [p.prompt for p in chosen])
            check_prompt_lengths(chosen, lengths, context=context, max_depth=deepest.max_depth, truncate=False,
                                 options=("--max-new-tokens",),
                                 max_new_tokens=args.max_new_tokens or deepest.max_new_tokens)
        result = grid_search(traces, depths=args.depths, sizes=args.sizes, max_new_tokens=args.max_new_tokens,
                             pair=pair, executor=executor, val_prompts=prompts, live_top=args.live_top,
                             live_repeats=args.live_repeats, batch_sizes=batch_sizes,
                             batch_profile=getattr(args, "batch_profile", None), out=args.out, progress=True)
    print("\n".join(summary_lines(result)))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")
    return 0
