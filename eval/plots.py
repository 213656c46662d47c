"""The report's PNG plots (matplotlib, Agg), each readable at a glance:

- forest_speedup_T<t>.png: one row per method, speedup over `ar` with its 95% interval (filled dot), replay's
  speedup beside it (hollow diamond, T=0), AR marked at 1 and the grid config's speedup and interval shaded;
- forest_groups_T<t>.png: the deciding ratio (ltd / grid) per task x language group and per task, with its
  interval; groups too small to conclude drawn grey;
- decisions_T<t>.png: depth and size histograms per speculative method (does a policy adapt at all?);
- time_split_T<t>.png: draft / verify / policy / other share of wall time per method;
- choices_T<t>.png: depth x size choices, coloured by mean accepted length.
"""
from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from pathlib import Path

import numpy as np

from specpilot.drafting.files import atomic_path, printable
from specpilot.eval.stats import MIN_PROMPTS_TO_CONCLUDE


def pyplot():
    """matplotlib.pyplot drawing to files (Agg). MPLBACKEND is set first: matplotlib validates it on import, so an
    unusable value in the environment (MPLBACKEND=garbage) would fail a grid or an evaluation after its work."""
    import os
    import sys

    fresh, previous = "matplotlib" not in sys.modules, os.environ.get("MPLBACKEND")
    if fresh:
        os.environ["MPLBACKEND"] = "Agg"
    try:
        import matplotlib
    finally:  # processes started later (Ray workers, subprocesses) keep the user's setting
        if fresh and previous is None:
            os.environ.pop("MPLBACKEND", None)
        elif fresh:
            os.environ["MPLBACKEND"] = previous
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def _errbars(ax, y: np.ndarray, rows: list[dict], key: str, ci_key: str, **style) -> None:
    """Points at row[key] with horizontal bars over row[ci_key] (rows without an interval get a point only)."""
    x = np.array([r[key] if _finite(r.get(key)) else np.nan for r in rows])
    lo = np.array([r[ci_key][0] if r.get(ci_key) and _finite(r[ci_key][0]) else np.nan for r in rows])
    hi = np.array([r[ci_key][1] if r.get(ci_key) and _finite(r[ci_key][1]) else np.nan for r in rows])
    err = np.vstack([np.where(np.isnan(lo), 0, x - lo), np.where(np.isnan(hi), 0, hi - x)])
    ax.errorbar(x, y, xerr=np.nan_to_num(err), fmt=style.pop("fmt", "o"), capsize=3, **style)


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    with atomic_path(path) as tmp:  # no half-written PNG after a crash
        fig.savefig(tmp, dpi=110)
    pyplot().close(fig)
    return str(path)


def forest_speedup(summary: list[dict], replay: dict | None, temperature: float, label: str, path: Path) -> str:
    plt = pyplot()
    rows = sorted([s for s in summary if s["temperature"] == temperature and s["method"] != "ar"],
                  key=lambda s: s["speedup"] if _finite(s["speedup"]) else -1)
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.35 * max(1, len(rows))))
    y = np.arange(len(rows))
    grid = next((s for s in rows if s["method"] == "grid"), None)
    if grid and grid.get("speedup_ci") and all(_finite(v) for v in grid["speedup_ci"]):
        ax.axvspan(*grid["speedup_ci"], color="tab:orange", alpha=0.15, lw=0)
    if grid and _finite(grid["speedup"]):
        ax.axvline(grid["speedup"], color="tab:orange", ls="--", lw=1, label=f"grid {grid['speedup']:.2f}x")
    ax.axvline(1.0, color="k", lw=1, label="ar (1x)")
    _errbars(ax, y, rows, "speedup", "speedup_ci", color="tab:blue", label="live, 95% interval")
    replayed = {m["method"]: m for m in (replay or {}).get("methods", [])} if temperature == 0.0 else {}
    if replayed:
        ry = [i + 0.2 for i, s in enumerate(rows) if s["method"] in replayed]
        rx = [replayed[s["method"]]["speedup"] for s in rows if s["method"] in replayed]
        ax.plot(rx, ry, "D", mfc="none", color="tab:green", label="replay (exact tau, modelled time)")
    ax.set_yticks(y, [f"{s['method']} ({s['n_units']} units)" for s in rows], fontsize=8)
    ax.set_xlabel("speedup over ar (pooled tokens/s ratio)")
    ax.set_title(f"Speedup over ar, T={temperature:g}\n{label}", fontsize=6)
    ax.legend(fontsize=6, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def forest_groups(groups: list[dict], replay_groups: list[dict], temperature: float, label: str,
                  path: Path) -> str | None:
    plt = pyplot()
    rows = [g for g in groups if g["temperature"] == temperature]
    if not rows:
        return None
    rows = sorted(rows, key=lambda g: (g["task"], g["language"] != "all", g["language"]))[::-1]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.35 * len(rows)))
    y = np.arange(len(rows))
    ax.axvline(1.0, color="k", lw=1)
    kinds = (("conclusive", "tab:blue", "o", "live, 95% interval"),
             ("small", "0.55", "o", f"live, fewer than {MIN_PROMPTS_TO_CONCLUDE} prompts: too small to conclude"),
             ("same", "0.55", "x", "live, same decisions on every cycle (the difference: decision time and timing noise)"))
    for kind, color, marker, name in kinds:
        idx = [i for i, g in enumerate(rows) if _group_kind(g) == kind]
        if idx:
            _errbars(ax, y[idx], [rows[i] for i in idx], "ratio", "ci", color=color, fmt=marker, label=name)
    replayed = {(g["task"], g["language"]): g for g in replay_groups} if temperature == 0.0 else {}
    hits = [(i, replayed[(g["task"], g["language"])]["ratio"]) for i, g in enumerate(rows)
            if (g["task"], g["language"]) in replayed]
    if hits:
        ax.plot([h[1] for h in hits], [h[0] + 0.2 for h in hits], "D", mfc="none", color="tab:green",
                label="replay")
    names = [f"{g['task']}/{g['language']} ({g['n_prompts']} prompts, {g['n_units']} units)" for g in rows]
    ax.set_yticks(y, names, fontsize=7)
    m, b = rows[0]["method"], rows[0]["baseline"]
    ax.set_xlabel(f"{m} / {b} throughput ratio (> 1: {m} faster)")
    ax.set_title(f"{m} vs {b} by task group, T={temperature:g}\n{label}", fontsize=6)
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.1 - 0.6 / len(rows)), ncol=2, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _group_kind(group: dict) -> str:
    if group["same_decisions"]:
        return "same"
    return "small" if group["too_small"] else "conclusive"


def decision_histograms(decisions: dict, temperature: float, label: str, path: Path) -> str | None:
    plt = pyplot()
    methods = sorted(decisions)
    if not methods:
        return None
    fig, axes = plt.subplots(len(methods), 2, figsize=(7.5, 0.6 + 0.9 * len(methods)), squeeze=False, sharex="col")
    depths = sorted({int(k) for s in decisions.values() for k in s["depth_hist"]})
    sizes = sorted({int(k) for s in decisions.values() for k in s["size_hist"]})
    for row, name in zip(axes, methods):
        stats = decisions[name]
        for ax, key, keys, color in ((row[0], "depth_hist", depths, "tab:blue"),
                                     (row[1], "size_hist", sizes, "tab:purple")):
            counts = np.array([stats[key].get(str(k), 0) for k in keys], dtype=float)
            ax.bar(range(len(keys)), counts / max(1.0, counts.sum()), color=color)
            ax.set_xticks(range(len(keys)), keys, fontsize=6)
            ax.set_ylim(0, 1)
            ax.tick_params(axis="y", labelsize=5)
        differs = stats.get("differs_from_reference")
        note = f"\n{100 * differs:.0f}% of cycles\nunlike grid" if _finite(differs) and name != "grid" else ""
        row[0].set_ylabel(name + note, fontsize=6, rotation=0, ha="right", va="center")
    axes[-1][0].set_xlabel("depth (fraction of cycles)")
    axes[-1][1].set_xlabel("verified size (fraction of cycles)")
    fig.suptitle(f"Decisions per method, T={temperature:g}\n{textwrap.shorten(label, 160)}", fontsize=6)
    return _save(fig, path)


def time_split(rows: list[dict], temperature: float, label: str, path: Path) -> str | None:
    """Draft / verify / policy / other fraction of wall time, pooled over groups (weighted by time); only our
    decoder's methods (transformers' generate exposes no draft/verify split)."""
    plt = pyplot()
    methods = list(dict.fromkeys(r["method"] for r in rows if r.get("choices")))
    if not methods:
        return None
    fig, ax = plt.subplots(figsize=(6, 1.5 + 0.35 * len(methods)))
    split = []
    for m in methods:
        mrows = [r for r in rows if r["method"] == m and r.get("total_s")]
        tot = sum(r["total_s"] for r in mrows) or 1.0
        d, v, p = (sum((r.get(k) or 0) * r["total_s"] for r in mrows) / tot
                   for k in ("draft_frac", "verify_frac", "policy_overhead"))
        split.append((d, v, p, max(0.0, 1 - d - v - p)))
    arr = np.array(split)
    left = np.zeros(len(methods))
    for j, (name, color) in enumerate((("draft", "tab:blue"), ("verify", "tab:orange"), ("policy", "tab:red"),
                                       ("other", "tab:gray"))):
        ax.barh(methods, arr[:, j], left=left, color=color, label=name)
        left += arr[:, j]
    ax.set_xlabel("fraction of wall time (other: prefill, bookkeeping outside cycles)")
    ax.set_title(f"Time split, T={temperature:g}\n{label}", fontsize=6)
    ax.legend(fontsize=6)
    return _save(fig, path)


def choices(rows: list[dict], temperature: float, meta_label: str, path: Path) -> str | None:
    """Depth x size choices coloured by mean accepted length (cell text: cycles), one panel per method."""
    plt = pyplot()
    chosen = list(dict.fromkeys(r["method"] for r in rows if r.get("choices")))
    if not chosen:
        return None
    fig, axes = plt.subplots(1, len(chosen), figsize=(3.2 * len(chosen), 3.6), squeeze=False)
    for ax, m in zip(axes[0], chosen):
        cells: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0, 0.0])
        for r in rows:
            if r["method"] == m:
                for d, s, n, tau in r.get("choices") or []:
                    cells[(d, s)][0] += n
                    cells[(d, s)][1] += n * tau
        depths = sorted({d for d, _ in cells})
        sizes = sorted({s for _, s in cells})
        grid = np.full((len(sizes), len(depths)), np.nan)
        for (d, s), (n, e) in cells.items():
            grid[sizes.index(s), depths.index(d)] = e / n
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
        for (d, s), (n, _) in cells.items():
            ax.text(depths.index(d), sizes.index(s), str(n), ha="center", va="center", fontsize=5, color="w")
        ax.set_xticks(range(len(depths)), depths, fontsize=6)
        ax.set_yticks(range(len(sizes)), sizes, fontsize=6)
        ax.set_xlabel("depth")
        ax.set_ylabel("size")
        ax.set_title(m, fontsize=7)
        fig.colorbar(im, ax=ax, label="mean accepted length")
    narrow = "\n".join(textwrap.wrap(meta_label, 50 * len(chosen)))
    fig.suptitle(f"Depth x size choices (cell text: cycles), T={temperature:g}\n{narrow}", fontsize=6)
    return _save(fig, path)


def write_plots(results: list[dict], analysis: dict, label: str, out_dir: Path) -> list[str]:
    """Every plot of the module docstring for every temperature; returns the paths written."""
    label = printable(label, errors="replace")  # a suite path of undecodable bytes: matplotlib refuses them
    wrapped = "\n".join(textwrap.wrap(label, 120))
    base = [r for r in results if r.get("concurrency", 1) == 1]
    written: list[str | None] = []
    for t in sorted({r["temperature"] for r in base}):
        rows = [r for r in base if r["temperature"] == t]
        if analysis.get("summary"):
            written.append(forest_speedup(analysis["summary"], analysis.get("replay"), t, wrapped,
                                          out_dir / f"forest_speedup_T{t:g}.png"))
        written.append(forest_groups(analysis.get("groups") or [], (analysis.get("replay") or {}).get("groups", []),
                                     t, "\n".join(textwrap.wrap(label, 100)), out_dir / f"forest_groups_T{t:g}.png"))
        written.append(decision_histograms((analysis.get("decisions") or {}).get(f"{t:g}", {}), t, label,
                                           out_dir / f"decisions_T{t:g}.png"))
        written.append(time_split(rows, t, wrapped, out_dir / f"time_split_T{t:g}.png"))
        written.append(choices(rows, t, label, out_dir / f"choices_T{t:g}.png"))
    return [p for p in written if p]
