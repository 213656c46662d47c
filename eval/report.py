"""Write an evaluation report: report.json (rows + meta), report.md (tables, summary, definitions) and PNG plots.

Every table and plot carries the label a reader needs to trust a number: models and hashes, precision, device,
sampling and prompt mix, taken from the meta block.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

REQUIRED_ROW_KEYS = ("task", "language", "split", "method", "temperature", "speedup", "tau", "tokens_per_s",
                     "ttft_s", "itl_p50_s", "itl_p90_s", "itl_p99_s", "peak_mem_mb", "policy_overhead",
                     "draft_frac", "identical_to_ar", "n_prompts", "n_tokens")


def _clean(value):
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _fmt(value, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec)


def _label(meta: dict) -> str:
    models = meta.get("models", {})
    hw = meta.get("gpu") or meta.get("cpu") or "?"
    s = meta.get("sampling", {})
    mix = meta.get("prompt_mix", {})
    return (f"{models.get('name', '?')} (target {models.get('target_hash', '?')}, draft {models.get('draft_hash', '?')})"
            f" | {meta.get('dtype', '?')} on {meta.get('device', '?')} ({hw})"
            f" | top_k={s.get('top_k')}, top_p={s.get('top_p')}, max_new_tokens={s.get('max_new_tokens')}"
            f" | {mix.get('n_prompts', '?')} prompts: "
            + ", ".join(f"{k} {v}" for k, v in sorted(mix.get("by_task", {}).items())))


def heldout_summary(results: list[dict]) -> list[dict]:
    """Mean speedup (and tau) by method and temperature over held-out groups at concurrency 1 (over all groups
    when the suite has no held-out split, e.g. a user suite)."""
    acc: dict[tuple, list[dict]] = defaultdict(list)
    any_heldout = any("heldout" in str(r.get("split", "")) for r in results)
    for r in results:
        if (not any_heldout or "heldout" in str(r.get("split", ""))) and r.get("concurrency", 1) == 1:
            acc[(r["method"], r["temperature"])].append(r)
    out = []
    for (method, temperature), rows in sorted(acc.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        sp = [r["speedup"] for r in rows if r["speedup"] is not None and math.isfinite(r["speedup"])]
        tau = [r["tau"] for r in rows if r["tau"] is not None and math.isfinite(r["tau"])]
        ident = [r["identical_to_ar"] for r in rows if r["identical_to_ar"] is not None]
        out.append({"method": method, "temperature": temperature,
                    "mean_speedup": sum(sp) / len(sp) if sp else None,
                    "mean_tau": sum(tau) / len(tau) if tau else None,
                    "identical_to_ar": all(ident) if ident else None, "n_groups": len(rows)})
    return out


def _table(rows: list[dict], methods: list[str], key: str, spec: str) -> list[str]:
    cells = {(r["task"], r["language"], r["method"]): r.get(key) for r in rows}
    groups = sorted({(r["task"], r["language"]) for r in rows})
    lines = ["| task | language | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for task, lang in groups:
        lines.append(f"| {task} | {lang} | " + " | ".join(_fmt(cells.get((task, lang, m)), spec) for m in methods)
                     + " |")
    return lines


def _markdown(results: list[dict], meta: dict, plots: list[str]) -> str:
    methods = list(dict.fromkeys(r["method"] for r in results))
    lines = ["# specpilot evaluation", "", f"**Measured on:** {_label(meta)}", "",
             f"Date {meta.get('date')}; versions {meta.get('versions')}; tree {meta.get('tree')}; "
             f"protocol {meta.get('protocol', {}).get('interleaving')}, repeats {meta.get('protocol', {}).get('repeats')},"
             f" warm-up {meta.get('protocol', {}).get('warmup')}.", ""]
    if meta.get("skipped"):
        lines += ["**Skipped methods:**", ""] + [f"- `{k}`: {v}" for k, v in meta["skipped"].items()] + [""]
    summary = heldout_summary(results)
    if summary:
        scope = "Held-out" if any("heldout" in str(r.get("split", "")) for r in results) else "All-prompt"
        lines += [f"## {scope} summary (mean over task x language groups, concurrency 1)", "",
                  "| method | temperature | mean speedup | mean tau | identical to ar | groups |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {s['method']} | {s['temperature']:g} | {_fmt(s['mean_speedup'])} | {_fmt(s['mean_tau'])} | "
                  f"{_fmt(s['identical_to_ar'])} | {s['n_groups']} |" for s in summary]
        lines.append("")
    levels = sorted({r.get("concurrency", 1) for r in results})
    for temperature in sorted({r["temperature"] for r in results}):
        for c in levels:
            rows = [r for r in results if r["temperature"] == temperature and r.get("concurrency", 1) == c]
            title = f"## Temperature {temperature:g}" + (f", concurrency {c}" if c > 1 else "")
            lines += [title, ""]
            for key, label, spec in (("speedup", "Speedup over ar", ".2f"), ("tau", "Mean accepted length tau", ".2f"),
                                     ("tokens_per_s", "Tokens/s", ".1f"), ("ttft_s", "TTFT (s)", ".4f"),
                                     ("itl_p50_s", "ITL p50 (s)", ".4f"), ("itl_p99_s", "ITL p99 (s)", ".4f"),
                                     ("policy_overhead", "Policy overhead (fraction of time)", ".4f"),
                                     ("draft_frac", "Draft time fraction", ".3f"),
                                     ("peak_mem_mb", "Peak memory (MiB)", ".0f"),
                                     ("identical_to_ar", "Identical to ar", "")):
                if key == "identical_to_ar" and temperature != 0:
                    continue
                lines += [f"**{label}**", ""] + _table(rows, methods, key, spec) + [""]
    lines += ["## Definitions", ""] + [f"- {k}: {v}" for k, v in meta.get("protocol", {}).items()] + [
        "- tau: tokens emitted per target forward, bonus token included (1 for autoregressive decoding).",
        "- policy_overhead / draft_frac: controller / draft time over the wall time of the generations.",
        "- identical_to_ar: at temperature 0, every run's tokens equal `ar`'s; not defined when sampling.", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def _plots(results: list[dict], meta: dict, out_dir: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    import textwrap

    label = "\n".join(textwrap.wrap(_label(meta), 120))
    base = [r for r in results if r.get("concurrency", 1) == 1]
    methods = list(dict.fromkeys(r["method"] for r in base))
    written = []
    for temperature in sorted({r["temperature"] for r in base}):
        rows = [r for r in base if r["temperature"] == temperature]
        groups = sorted({(r["task"], r["language"]) for r in rows})
        # speedup by task/language and method
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(groups) * max(1, len(methods)) / 3), 4))
        cell = {(r["task"], r["language"], r["method"]): r["speedup"] for r in rows}
        x = np.arange(len(groups))
        w = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            ys = [cell.get((t, lang, m)) for t, lang in groups]
            ax.bar(x + i * w, [y if y is not None and math.isfinite(y) else 0 for y in ys], w, label=m)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x + 0.4 - w / 2, [f"{t}/{lang}" for t, lang in groups], rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("speedup over ar")
        ax.set_title(f"Speedup, T={temperature:g}\n{label}", fontsize=6)
        ax.legend(fontsize=6, ncol=3)
        fig.tight_layout()
        path = out_dir / f"speedup_T{temperature:g}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))

        # draft / verify / other split of wall time, pooled over groups (weighted by time)
        # only our decoder's methods: transformers' generate exposes no draft/verify split
        split_methods = [m for m in methods if any(r["method"] == m and r.get("choices") for r in rows)]
        fig, ax = plt.subplots(figsize=(6, 1.5 + 0.35 * len(split_methods)))
        split = []
        for m in split_methods:
            mrows = [r for r in rows if r["method"] == m and r.get("total_s")]
            tot = sum(r["total_s"] for r in mrows) or 1.0
            d = sum((r["draft_frac"] or 0) * r["total_s"] for r in mrows) / tot
            v = sum((r.get("verify_frac") or 0) * r["total_s"] for r in mrows) / tot
            p = sum((r["policy_overhead"] or 0) * r["total_s"] for r in mrows) / tot
            split.append((d, v, p, max(0.0, 1 - d - v - p)))
        arr = np.array(split) if split else np.zeros((0, 4))
        left = np.zeros(len(split_methods))
        for j, (name, color) in enumerate((("draft", "tab:blue"), ("verify", "tab:orange"),
                                           ("policy", "tab:red"), ("other", "tab:gray"))):
            ax.barh(split_methods, arr[:, j], left=left, color=color, label=name)
            left += arr[:, j]
        ax.set_xlabel("fraction of wall time (other: prefill, bookkeeping outside cycles)")
        ax.set_title(f"Time split, T={temperature:g}\n{label}", fontsize=6)
        ax.legend(fontsize=6)
        fig.tight_layout()
        path = out_dir / f"time_split_T{temperature:g}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))

        # depth x size choices coloured by mean accepted length (tau of the cells), one panel per method
        chosen = [m for m in methods if any(r["method"] == m and r.get("choices") for r in rows)]
        if chosen:
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
            narrow = "\n".join(textwrap.wrap(_label(meta), 50 * len(chosen)))
            fig.suptitle(f"Depth x size choices (cell text: cycles), T={temperature:g}\n{narrow}", fontsize=6)
            fig.tight_layout()
            path = out_dir / f"choices_T{temperature:g}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(str(path))
    return written


def write_report(results: list[dict], meta: dict, out_dir: str | Path, *, plots: bool = True) -> dict[str, str]:
    """Write report.json, report.md and the PNG plots into `out_dir`; return {kind: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        missing = [k for k in REQUIRED_ROW_KEYS if k not in r]
        assert not missing, f"result row {r.get('method')}/{r.get('task')} lacks keys {missing}"
    png = _plots(results, meta, out) if plots and results else []
    payload = {"meta": meta, "summary": heldout_summary(results), "results": results}
    (out / "report.json").write_text(json.dumps(_clean(payload), indent=1, ensure_ascii=False))
    (out / "report.md").write_text(_markdown(results, meta, png), encoding="utf-8")
    return {"json": str(out / "report.json"), "md": str(out / "report.md"), **{Path(p).stem: p for p in png}}
