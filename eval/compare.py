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

A comparison's verdict comes from its interval alone (faster / slower / indistinguishable). Flags sit beside it
and explain a difference, never replace it: "same decisions" when the two chose the same (depth, size) on every
cycle of every unit. Identical decisions do not make identical speed (each method pays its own controller's
decision time on every cycle), so such a comparison also carries the decision time per generation of both, the
ratio with decision time taken out of both, and `cause`: "decision time" (the verdict is faster / slower but
without decision time the interval contains 1), "timing noise" (the interval contains 1) or "timing beyond
decision time" (the difference remains without decision time).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from specpilot.eval.metrics import RunRecord
from specpilot.eval.stats import (MIN_PROMPTS_TO_CONCLUDE, Interval, cluster_ratio_interval, paired_ratio_interval,
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
    rounds resampled together, `stats.cluster_ratio_interval`), the verdict from that interval, same_decisions and
    the flags (module docstring; None when the two share no unit). Time is the runner's wall time around each call.
    `ci_units` and `half_width` are the (prompt, round) unit interval's: timing noise on these prompts, which more
    rounds shrink (the rounds' stopping rule watches it)."""
    keys = common_units(by_method, method, baseline, prompt_ids)
    if not keys:
        return None
    a = [by_method[method][k] for k in keys]
    b = [by_method[baseline][k] for k in keys]
    arrays = ([r.n_tokens for r in a], [r.wall_s for r in a], [r.n_tokens for r in b], [r.wall_s for r in b])
    interval = paired_ratio_interval(*arrays, seed=seed)
    clusters = [k[0] for k in keys]
    prompts = cluster_ratio_interval(*arrays, clusters, seed=seed)
    same = same_decisions([r.cycles for r in a], [r.cycles for r in b])
    out = {"method": method, "baseline": baseline, "temperature": float(temperature),
           "ratio": interval.ratio, "ci": prompts.ci(), "ci_units": interval.ci(), "interval": "prompts",
           "same_decisions": same, "verdict": verdict(prompts), "flags": ["same decisions"] if same else [],
           "n_units": interval.n_units, "n_prompts": len(set(clusters)), "half_width": interval.half_width,
           "half_width_prompts": prompts.half_width}
    if same:
        out.update(decision_cost(a, b, out["verdict"], clusters, seed=seed))
    return out


def decision_cost(a: Sequence[RunRecord], b: Sequence[RunRecord], verdict_: str, clusters: Sequence[str], *,
                  seed: int = 0) -> dict:
    """Where a difference between two methods with the same decisions comes from: each one's controller time
    per generation (ms, mean over the paired units), the difference as a share of A's time, the pooled ratio
    with decision time taken out of both (interval over prompts) and the `cause` (module docstring)."""
    pol_a = np.array([r.policy_s for r in a], dtype=np.float64)
    pol_b = np.array([r.policy_s for r in b], dtype=np.float64)
    wall_a = np.array([r.wall_s for r in a], dtype=np.float64)
    wall_b = np.array([r.wall_s for r in b], dtype=np.float64)
    without = cluster_ratio_interval([r.n_tokens for r in a], wall_a - pol_a, [r.n_tokens for r in b],
                                     wall_b - pol_b, clusters, seed=seed)
    if verdict_ == "indistinguishable":
        cause = "timing noise"
    elif verdict(without) == "indistinguishable":
        cause = "decision time"
    else:
        cause = "timing beyond decision time"
    return {"decision_ms_per_generation": {"method": 1e3 * float(pol_a.mean()), "baseline": 1e3 * float(pol_b.mean()),
                                           "difference": 1e3 * float((pol_a - pol_b).mean())},
            "decision_share": float((pol_a.sum() - pol_b.sum()) / wall_a.sum()) if wall_a.sum() > 0 else math.nan,
            "without_decision": {"ratio": without.ratio, "ci": without.ci()}, "cause": cause}


def _ci_text(ci) -> str:
    low, high = ci if ci is not None else (None, None)
    ok = all(isinstance(x, (int, float)) and math.isfinite(x) for x in (low, high))
    return f"[{low:.3f}, {high:.3f}]" if ok else "[no interval]"


CAUSES = {"decision time": "the difference is decision time",
          "timing noise": "the difference is within timing noise",
          "timing beyond decision time": "decision time does not explain the whole difference"}


REPLAY_OUTSIDE = "replay outside the interval"


def flag_replay_outside(live: Sequence[dict], replayed: Sequence[dict]) -> None:
    """Flag each greedy live comparison whose interval leaves out what exact replay of the same prompts gives for the
    same pair. Every greedy comparison with a replayed counterpart keeps it under "replay" ({"ratio", "ci",
    "inside"}: one schema whether flagged or not). Replay knows each cycle's acceptance exactly and
    prices it with a profile measured in the same evaluation, so a live interval that misses it says that the live
    rounds' load (or a stale profile) moved one method more than the other: the verdict stands as measured, and the
    flag says to measure again before trusting its margin. Replay leaves the prefill out, so it reads ~1 point above
    a live ratio (README, "Reading the report"), which this test does not correct for."""
    by_pair = {(c["method"], c["baseline"]): c for c in replayed if float(c.get("temperature", 0.0)) == 0.0}
    for c in live:
        r = by_pair.get((c["method"], c["baseline"]))
        low, high = c.get("ci") or (None, None)
        if r is None or float(c.get("temperature", 0.0)) != 0.0:
            continue
        values = (r.get("ratio"), low, high)
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in values):
            continue
        inside = bool(low <= r["ratio"] <= high)
        c["replay"] = {"ratio": float(r["ratio"]), "ci": r.get("ci"), "inside": inside}
        c["flags"] = [f for f in c.get("flags") or [] if f != REPLAY_OUTSIDE] + ([] if inside else [REPLAY_OUTSIDE])


def _replay_text(comparison: dict) -> str:
    r = comparison.get("replay") or {}
    if REPLAY_OUTSIDE not in (comparison.get("flags") or []) or not isinstance(r.get("ratio"), (int, float)):
        return ""
    # the ratio alone (its interval is in the replay section): a flag that timing noise raises must not change the
    # shape of the report's rows (their bracketed intervals)
    return (f"exact replay of these prompts gives {r['ratio']:.3f}x, outside the live interval: load during the live "
            "rounds (or a stale profile) moved one method more than the other; measure again before trusting the "
            "margin")


def flag_text(comparison: dict) -> str:
    """The flags of a comparison as one clause ("" without flags): "same decisions on every cycle: the
    difference is decision time (ltd 0.61 vs grid 0.19 ms deciding per generation, +1.9% of ltd's time;
    without decision time 1.002x [0.990, 1.013])", and/or the replay clause of `flag_replay_outside`."""
    replay = _replay_text(comparison)
    same = comparison.get("same_decisions") or "same decisions" in (comparison.get("flags") or [])
    if not same:
        return replay
    text = "same decisions on every cycle"
    cause = comparison.get("cause")
    if cause:
        text += f": {CAUSES.get(cause, cause)}"
    ms = comparison.get("decision_ms_per_generation")
    if ms:
        share = comparison.get("decision_share")
        share_text = (f", {100 * share:+.1f}% of {comparison['method']}'s time"
                      if isinstance(share, (int, float)) and math.isfinite(share) else "")
        without = comparison.get("without_decision") or {}
        ratio = without.get("ratio")
        without_text = (f"; without decision time {ratio:.3f}x {_ci_text(without.get('ci'))}"
                        if isinstance(ratio, (int, float)) and math.isfinite(ratio) else "")
        text += (f" ({comparison['method']} {ms['method']:.2f} vs {comparison['baseline']} {ms['baseline']:.2f} ms "
                 f"deciding per generation{share_text}{without_text})")
    return f"{text}; {replay}" if replay else text


def interval_verdict(comparison: dict) -> str:
    """The verdict from the comparison's interval alone (also for dicts written before flags existed, whose
    verdict could read "same decisions")."""
    if comparison.get("verdict") in ("faster", "slower", "indistinguishable"):
        return comparison["verdict"]
    low, high = comparison.get("ci") or (None, None)
    fin = [x if isinstance(x, (int, float)) else math.nan for x in (comparison.get("ratio"), low, high)]
    return verdict(Interval(*fin, comparison.get("n_units") or 0))


def describe(comparison: dict) -> str:
    """One line for a summary: "ltd vs grid (T=1): 0.981x (-1.9%) [0.970, 0.992], slower, 34 units; flag: same
    decisions on every cycle: the difference is decision time (...)". The ratio and its interval are always
    printed; a flag only explains them."""
    head = f"{comparison['method']} vs {comparison['baseline']} (T={comparison['temperature']:g})"
    ratio = comparison.get("ratio")
    if isinstance(ratio, (int, float)) and math.isfinite(ratio):
        value = f"{ratio:.3f}x ({100.0 * (ratio - 1.0):+.1f}%) {_ci_text(comparison.get('ci'))}"
    else:
        value = "no ratio"
    flag = flag_text(comparison)
    return (f"{head}: {value}, {interval_verdict(comparison)}, {comparison['n_units']} units"
            + (f"; flag: {flag}" if flag else ""))


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
