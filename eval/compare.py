"""Method comparisons over the units of an evaluation: paired speedup intervals, verdicts, group views and
decision statistics (the numbers `specpilot.eval.report` prints; the statistics themselves are in `stats.py`).

A unit is one (prompt, round) at one temperature and concurrency; `RunRecord.repeat` holds the round. Every
comparison pairs two methods on the units both ran (a method run only in the first rounds is compared on those).

Comparisons the report makes, per temperature:
- each method's speedup over `ar` (the `speedup_ci` of its rows and of the summary);
- the deciding pair (default ltd vs grid) and every learned policy against grid and against the best heuristic
  (the heuristic with the highest pooled speedup over `ar` at that temperature);
- the deciding pair per task x language group and per task, flagged `too_small` below
  `stats.MIN_PROMPTS_TO_CONCLUDE` distinct prompts.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from specpilot.eval.metrics import RunRecord
from specpilot.eval.stats import (MIN_PROMPTS_TO_CONCLUDE, cluster_ratio_interval, paired_ratio_interval,
                                  same_decisions, verdict)

LEARNED = ("ltd", "depth_only", "size_only")
HEURISTICS = ("ddd", "svip", "confidence", "hf_heuristic")
DECIDE = ("ltd", "grid")

UnitKey = tuple[str, int]  # (prompt id, round)


def unit_records(records: Iterable[RunRecord], *, temperature: float,
                 concurrency: int = 1) -> dict[str, dict[UnitKey, RunRecord]]:
    """method -> {(prompt id, round): record} at one temperature and concurrency level."""
    out: dict[str, dict[UnitKey, RunRecord]] = {}
    for r in records:
        if r.temperature == float(temperature) and r.concurrency == concurrency:
            out.setdefault(r.method, {})[(r.prompt_id, r.repeat)] = r
    return out


def common_units(by_method: dict[str, dict[UnitKey, RunRecord]], method: str, baseline: str,
                 prompt_ids: Iterable[str] | None = None) -> list[UnitKey]:
    """Sorted units both methods ran (restricted to `prompt_ids` when given)."""
    a, b = by_method.get(method, {}), by_method.get(baseline, {})
    keep = None if prompt_ids is None else set(prompt_ids)
    return sorted(k for k in a.keys() & b.keys() if keep is None or k[0] in keep)


def compare(by_method: dict[str, dict[UnitKey, RunRecord]], method: str, baseline: str, *, temperature: float,
            prompt_ids: Iterable[str] | None = None, seed: int = 0) -> dict | None:
    """`method` over `baseline`: pooled throughput ratio, its 95% interval over prompts (`ci`: each prompt's
    rounds resampled together, `stats.cluster_ratio_interval`), same_decisions and the verdict on that interval
    (None when the two share no unit). Time is the runner's wall time around each call. `ci_units` and
    `half_width` are the (prompt, round) unit interval's: timing noise on these prompts, which more rounds shrink
    (the rounds' stopping rule watches it)."""
    keys = common_units(by_method, method, baseline, prompt_ids)
    if not keys:
        return None
    a = [by_method[method][k] for k in keys]
    b = [by_method[baseline][k] for k in keys]
    arrays = ([r.n_tokens for r in a], [r.wall_s for r in a], [r.n_tokens for r in b], [r.wall_s for r in b])
    interval = paired_ratio_interval(*arrays, seed=seed)
    prompts = cluster_ratio_interval(*arrays, [k[0] for k in keys], seed=seed)
    same = same_decisions([r.cycles for r in a], [r.cycles for r in b])
    return {"method": method, "baseline": baseline, "temperature": float(temperature),
            "ratio": interval.ratio, "ci": prompts.ci(), "ci_units": interval.ci(), "interval": "prompts",
            "same_decisions": same, "verdict": verdict(prompts, same=same), "n_units": interval.n_units,
            "n_prompts": len({k[0] for k in keys}), "half_width": interval.half_width,
            "half_width_prompts": prompts.half_width}


def best_heuristic(by_method: dict[str, dict[UnitKey, RunRecord]], *, temperature: float) -> str | None:
    """The heuristic with the highest pooled speedup over `ar` (None when no heuristic ran)."""
    scored = [(c["ratio"], name) for name in HEURISTICS
              if (c := compare(by_method, name, "ar", temperature=temperature)) is not None
              and np.isfinite(c["ratio"])]
    return max(scored)[1] if scored else None


def comparison_pairs(present: Sequence[str], best: str | None,
                     decide: tuple[str, str] = DECIDE) -> list[tuple[str, str]]:
    """(method, baseline) pairs to report: the deciding pair, then each learned policy vs grid and vs `best`."""
    pairs: list[tuple[str, str]] = []
    candidates = [decide] + [(m, b) for m in LEARNED for b in ("grid", best)]
    for m, b in candidates:
        if b is not None and m != b and m in present and b in present and (m, b) not in pairs:
            pairs.append((m, b))
    return pairs


def comparisons(records: Sequence[RunRecord], temperatures: Iterable[float], *,
                decide: tuple[str, str] = DECIDE, seed: int = 0) -> list[dict]:
    """Every pair of `comparison_pairs` at every temperature (concurrency 1)."""
    out = []
    for temperature in temperatures:
        by_method = unit_records(records, temperature=temperature)
        best = best_heuristic(by_method, temperature=temperature)
        for m, b in comparison_pairs(list(by_method), best, decide):
            c = compare(by_method, m, b, temperature=temperature, seed=seed)
            if c is not None:
                c["baseline_role"] = "decide" if (m, b) == decide else ("best heuristic" if b == best else b)
                out.append(c)
    return out


def task_groups(prompts: Sequence) -> dict[tuple[str, str], list[int]]:
    """(task, language) -> positions in `prompts`, sorted; plus (task, "all") for tasks in several languages."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault((p.task, p.language), []).append(i)
    for task in sorted({t for t, _ in groups}):
        langs = [k for k in groups if k[0] == task]
        if len(langs) > 1:
            groups[(task, "all")] = sorted(i for k in langs for i in groups[k])
    return dict(sorted(groups.items()))


def group_comparisons(records: Sequence[RunRecord], prompts: Sequence, *, temperature: float,
                      method: str = DECIDE[0], baseline: str = DECIDE[1], seed: int = 0) -> list[dict]:
    """`method` vs `baseline` per task x language group and per task (language "all"), each with its own
    interval; `too_small` when a group has fewer than MIN_PROMPTS_TO_CONCLUDE distinct prompts."""
    by_method = unit_records(records, temperature=temperature)
    out = []
    for (task, language), idx in task_groups(prompts).items():
        ids = [prompts[i].id for i in idx]
        c = compare(by_method, method, baseline, temperature=temperature, prompt_ids=ids, seed=seed)
        if c is not None:
            out.append({"task": task, "language": language, **c,
                        "too_small": c["n_prompts"] < MIN_PROMPTS_TO_CONCLUDE})
    return out


def _tau(record: RunRecord) -> float:
    return sum(c[2] for c in record.cycles) / len(record.cycles) if record.cycles else float("nan")


def decision_stats(records: Sequence[RunRecord], *, temperature: float, reference: str = "grid") -> dict[str, dict]:
    """Per speculative method: depth and size histograms over all cycles, the fraction of cycles whose
    (depth, size) differs from the reference's configuration (its most frequent choice: a fixed config's only
    one, up to size clipping), the fraction of units decided exactly like the reference, and the mean over
    common units of |tau(method) - tau(reference)|. Compact: histograms, never per-cycle logs."""
    by_method = unit_records(records, temperature=temperature)
    ref = by_method.get(reference, {})
    ref_cycles = Counter((c[0], c[1]) for r in ref.values() for c in r.cycles)
    ref_config = ref_cycles.most_common(1)[0][0] if ref_cycles else None
    out = {}
    for name, units in by_method.items():
        cycles = [c for r in units.values() for c in r.cycles]
        if not cycles:
            continue
        stats = {"cycles": len(cycles),
                 "depth_hist": {str(k): v for k, v in sorted(Counter(c[0] for c in cycles).items())},
                 "size_hist": {str(k): v for k, v in sorted(Counter(c[1] for c in cycles).items())},
                 "mean_depth": float(np.mean([c[0] for c in cycles])),
                 "mean_size": float(np.mean([c[1] for c in cycles]))}
        if ref_config is not None:
            keys = sorted(units.keys() & ref.keys())
            stats.update({
                "reference": reference, "reference_config": list(ref_config),
                "differs_from_reference": sum((c[0], c[1]) != ref_config for c in cycles) / len(cycles),
                "units_same_as_reference": (sum(same_decisions([units[k].cycles], [ref[k].cycles]) for k in keys)
                                            / len(keys)) if keys else None,
                "mean_abs_tau_diff": (float(np.mean([abs(_tau(units[k]) - _tau(ref[k])) for k in keys]))
                                      if keys else None)})
        out[name] = stats
    return out
