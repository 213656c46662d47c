"""A short verdict-first summary of a report.json, for the demo's last screen and `specpilot eval`'s output.

`summarise_report(report)` keeps what a reader needs to answer "does the learned policy beat the grid config?":
greedy speedups over ar with their intervals, the verdicts of the compared pairs (always the ratio and its interval;
"same decisions" is a flag beside them that names where the difference comes from), how many rounds and units
were used, which task groups can be concluded on, replay beside live, the cost-model checks, the suite evaluated,
and how many prompts were left out of the verdicts because the target's greedy output on them is degenerate
(`specpilot.eval.degeneracy`). `format_summary_lines(summary)` prints it. `report_metrics(report)` gives the
report's numbers as the nested scalars a wandb run summary holds (`specpilot eval --wandb`).
"""
from __future__ import annotations

import math

from specpilot.eval.compare import describe
from specpilot.eval.degeneracy import judged_count, nothing_judged, too_short_count, too_short_note
from specpilot.eval.exactness import ROUNDING, difference_cause, dtype_name, identity_line
from specpilot.eval.report import dtype_line, flagged_by_group, measurement_label, report_identity
from specpilot.eval.suites import chat_template_note


def _ok(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def summarise_report(report: dict, *, temperature: float = 0.0) -> dict:
    """The summary dict (JSON-able) of a report.json payload; speedups at `temperature`, verdicts at all."""
    methods = {s["method"]: {"speedup": s.get("speedup", s.get("mean_speedup")), "speedup_ci": s.get("speedup_ci"),
                             "tau": s.get("tau", s.get("mean_tau")), "policy_overhead": s.get("policy_overhead"),
                             "identical_to_ar": s.get("identical_to_ar"), "n_units": s.get("n_units")}
               for s in report.get("summary") or [] if s["temperature"] == temperature}
    comps = report.get("comparisons") or []
    decide = next((c for c in comps if c.get("baseline_role") == "decide" and c["temperature"] == temperature), None)
    groups = [g for g in report.get("groups") or [] if g["temperature"] == temperature and g["language"] != "all"]
    replay = report.get("replay") or {}
    degeneracy = report.get("degeneracy")
    flagged_in = flagged_by_group(degeneracy)
    meta = report.get("meta") or {}
    return {
        "label": measurement_label(report["meta"]) if meta.get("models") else None,
        "dtype": dtype_line(meta) if meta.get("dtype") else None,
        # computed, not read: a report written before the block existed is explained the same way
        "greedy_identity": report_identity(report),
        "suite": (report.get("meta") or {}).get("suite"),
        "degeneracy": {"n_measured": degeneracy.get("n_measured"), "n_judged": judged_count(degeneracy),
                       "n_too_short": too_short_count(degeneracy), "n_flagged": len(degeneracy.get("flagged", [])),
                       "groups": [f"{g['task']}/{g['language']}" for g in degeneracy.get("groups", [])
                                  if g["degenerate"] and g["language"] != "all"],
                       "comparisons": [c for c in degeneracy.get("comparisons") or []
                                       if c.get("baseline_role") == "decide"]} if degeneracy else None,
        "methods": methods,
        "comparisons": comps,
        "ltd_vs_grid": decide,
        "rounds": (report.get("meta") or {}).get("rounds"),
        "groups": {"n": len(groups), "too_small": sum(g["too_small"] for g in groups),
                   "conclusive": [{**{k: g[k] for k in ("task", "language", "ratio", "ci", "verdict")},
                                   "n_flagged": flagged_in.get((g["task"], g["language"]), 0)}
                                  for g in groups if not g["too_small"]]},
        "replay": {"methods": {m["method"]: {"speedup": m["speedup"], "live_speedup": m.get("live_speedup"),
                                             "gap": m.get("gap")} for m in replay.get("methods", [])},
                   "comparisons": replay.get("comparisons", []), "oracle": replay.get("oracle"),
                   "decision_us": replay.get("decision_us") or {}} if replay else None,
        "cost_check": {k: {"stale": v["stale"], "max_abs_error": v.get("max_abs_error"), "age_s": v.get("age_s"),
                           "worst_spread": v.get("worst_spread"), "tolerance": v.get("tolerance"),
                           "title": v.get("title", k)}
                       for k, v in (report.get("cost_check") or {}).items()},
    }


def _interval(prefix: str, ci) -> dict:
    low, high = ci if isinstance(ci, (list, tuple)) and len(ci) == 2 else (None, None)
    return {f"{prefix}_low": low, f"{prefix}_high": high}


def _comparison_metrics(comparisons: list[dict]) -> dict:
    return {f"{c['method']}_vs_{c['baseline']}": {"ratio": c.get("ratio"), **_interval("ratio", c.get("ci")),
                                                  "verdict": c.get("verdict"), "n_prompts": c.get("n_prompts"),
                                                  "same_decisions": c.get("same_decisions")}
            for c in comparisons}


def _method_metrics(rows: list[dict], keys: tuple[str, ...]) -> dict:
    return {row["method"]: {**{k: row.get(k) for k in keys}, **_interval("speedup", row.get("speedup_ci"))}
            for row in rows}


def report_metrics(report: dict) -> dict:
    """A report.json payload's numbers, nested by temperature ("T=0", "T=1"; with batch sizes "T=0/B=4"): each
    method's speedup over ar with its interval, tau, decision overhead and token identity; each comparison's ratio,
    interval over prompts and verdict; replay's speedups and the oracle's; the suite and how many prompts the
    degeneracy flag left out; why greedy output differs from ar's, and why the pair runs in its dtype. Lists are
    flattened into named keys so that a wandb run summary (`RunLogger.summarize`) keeps every number."""
    meta = report.get("meta") or {}
    suite = meta.get("suite") or {}
    out: dict = {"suite": suite.get("name") if isinstance(suite, dict) else suite,
                 "models": (meta.get("models") or {}).get("name"), "dtype": meta.get("dtype"),
                 "device": meta.get("device"), "hardware": meta.get("gpu") or meta.get("cpu"),
                 "max_new_tokens": (meta.get("sampling") or {}).get("max_new_tokens")}
    sampling = meta.get("sampling") or {}
    for key in ("stop_strings", "stop_token_ids"):  # flattened as the lists below; absent when none was given
        out.update({f"{key}/{i}": v for i, v in enumerate(sampling.get(key) or [])})
    if sampling.get("ignore_eos"):
        out["ignore_eos"] = True
    keys = ("speedup", "tau", "policy_overhead", "identical_to_ar", "n_units")
    for t in sorted({row["temperature"] for row in report.get("summary") or []}):
        rows = [{**row, "speedup": row.get("speedup", row.get("mean_speedup")),
                 "tau": row.get("tau", row.get("mean_tau"))} for row in report["summary"] if row["temperature"] == t]
        comps = [c for c in report.get("comparisons") or [] if c.get("temperature") == t]
        out[f"T={t:g}"] = {"methods": _method_metrics(rows, keys), "comparisons": _comparison_metrics(comps)}
    for section in report.get("batch_sizes") or []:
        out.setdefault(f"T={section['temperature']:g}", {})[f"B={section['batch_size']}"] = {
            "methods": _method_metrics(section.get("methods") or [], ("speedup", "tokens_per_s", "identical_to_ar",
                                                                      "depth_mean", "size_mean", "n_units")),
            "comparisons": _comparison_metrics(section.get("comparisons") or [])}
    replay = report.get("replay")
    if replay:
        out["replay"] = {"methods": {m["method"]: {"speedup": m.get("speedup"), "live_speedup": m.get("live_speedup"),
                                                   "gap": m.get("gap")} for m in replay.get("methods", [])},
                         "comparisons": _comparison_metrics(replay.get("comparisons") or []),
                         "oracle": replay.get("oracle") if isinstance(replay.get("oracle"), dict) else None}
    degeneracy = report.get("degeneracy")
    if degeneracy:
        out["degeneracy"] = {"n_measured": degeneracy.get("n_measured"), "n_judged": judged_count(degeneracy),
                             "n_too_short": too_short_count(degeneracy),
                             "n_flagged": len(degeneracy.get("flagged") or [])}
    identity = report.get("greedy_identity")
    if identity:  # why greedy output differs from ar's: half-precision rounding (expected) or a bug (fp32)
        out["greedy_identity"] = {"cause": identity.get("cause"), "expected": identity.get("expected"),
                                  "n_differing": len(identity.get("differing") or [])}
    out["dtype_reason"] = meta.get("dtype_reason")
    return out


def _speedup_cell(m: dict) -> str:
    sp, ci = m.get("speedup"), m.get("speedup_ci") or [None, None]
    if not _ok(sp):
        return "-"
    interval = f"[{ci[0]:.2f}, {ci[1]:.2f}]" if _ok(ci[0]) and _ok(ci[1]) else "[no interval]"
    return f"{sp:.2f}x {interval}"


def _identical_cell(identical, dtype) -> str:
    """True / None / False as they are, False labelled in half precision ("False (bfloat16 rounding)"); in fp32 the
    WARNING under the table says what a False is."""
    if identical is False and difference_cause(dtype) == ROUNDING:
        return f"False ({dtype_name(dtype)} rounding)"
    return str(identical)


def _method_lines(methods: dict, dtype: str = "?") -> list[str]:
    lines = [f"{'method':14s} {'speedup over ar [95% CI]':>26s} {'tau':>6s} {'overhead':>9s} {'units':>6s}  identical"]
    for name, m in sorted(methods.items(), key=lambda kv: -(kv[1]["speedup"] or 0)):
        tau = f"{m['tau']:6.2f}" if _ok(m.get("tau")) else f"{'-':>6s}"
        over = f"{100 * m['policy_overhead']:8.2f}%" if _ok(m.get("policy_overhead")) else f"{'-':>9s}"
        lines.append(f"{name:14s} {_speedup_cell(m):>26s} {tau} {over} {m.get('n_units') or '-':>6}  "
                     f"{_identical_cell(m.get('identical_to_ar'), dtype)}")
    return lines


def _rounds_line(rounds: dict | None) -> list[str]:
    if not rounds:
        return []
    parts = []
    for t, r in rounds.get("by_temperature", {}).items():
        hw = r.get("decide_half_width")
        pair = " vs ".join(r.get("decide") or rounds.get("decide") or ("ltd", "grid"))
        width = f", {pair} +-{100 * hw:.1f}%" if _ok(hw) else ""
        parts.append(f"T={t}: {r['rounds']} rounds, {r['units']} units, stopped: {r['stopped_by']}{width}")
    return ["rounds: " + "; ".join(parts)]


def _replay_lines(replay: dict | None) -> list[str]:
    if not replay:
        return []
    cells = []
    for name in ("ltd", "grid", "depth_only", "size_only"):
        m = replay["methods"].get(name)
        if m and _ok(m["speedup"]):
            gap = f", gap {100 * m['gap']:+.1f}%" if _ok(m.get("gap")) else ""
            live = f"live {m['live_speedup']:.2f}x" if _ok(m.get("live_speedup")) else "live -"
            cells.append(f"{name} {m['speedup']:.2f}x ({live}{gap})")
    oracle = replay.get("oracle") or {}
    charged = replay.get("decision_us") or {}
    asked = [q for q in ("skip", "stop", "size") if q in charged]
    deciding = (f"policy decisions charged {'/'.join(f'{charged[q]:.0f}' for q in asked)} us ({'/'.join(asked)})"
                if asked else "decisions free")
    gains = oracle.get("gain_share") or {}
    captured = ", ".join(f"{name} {100 * gains[name]:.0f}%" for name in ("ltd", "grid") if _ok(gains.get(name)))
    lines = [f"replay of the held-out traces (exact tau, modelled time, {deciding}): " + ", ".join(cells)
             + (f"; hindsight oracle {oracle['speedup']:.2f}x" if _ok(oracle.get("speedup")) else "")
             + (f" (share of its gain over AR: {captured})" if captured else "")
             + (f"; each prompt at its own best static config {oracle['per_prompt_static_speedup']:.2f}x"
                if _ok(oracle.get("per_prompt_static_speedup")) else "")]
    if _ok(oracle.get("speedup")) and oracle["speedup"] < 1:
        lines.append("  the hindsight oracle is below AR: the latency profile's plain step costs more than AR measured "
                     "now (see the cost check), so these replay numbers are no ceiling: re-measure the profile")
    lines += [f"  replay {describe(c)}" for c in replay.get("comparisons", [])[:1]]
    return lines


def _cost_lines(checks: dict) -> list[str]:
    out = []
    for c in checks.values():
        age = f", profile age {c['age_s'] / 60:.1f} min" if _ok(c.get("age_s")) else ""
        err = f"max error {100 * c['max_abs_error']:.0f}%" if _ok(c.get("max_abs_error")) else "no fixed config"
        spread = _ok(c.get("max_abs_error")) and _ok(c.get("worst_spread")) and c["worst_spread"] > 0
        if spread:
            err += f" where the live rounds spread +-{100 * c['worst_spread']:.0f}%"
        if _ok(c.get("max_abs_error")) and _ok(c.get("tolerance")):
            # the rule (costcheck.compare_rates): stale past the live spread plus the tolerance, so say it: a 9%
            # error called "within the noise" beside a +-1% spread read as a contradiction
            err += f"; stale past {'that spread + ' if spread else ''}{100 * c['tolerance']:.0f}%"
        out.append(f"cost model ({c['title']}): {'STALE' if c['stale'] else 'within tolerance'} ({err}{age})")
    return out


def _suite_lines(summary: dict) -> list[str]:
    lines = [f"measured on: {summary['label']}"] if summary.get("label") else []
    lines += [summary["dtype"]] if summary.get("dtype") else []
    suite = summary.get("suite")
    if isinstance(suite, dict):
        lines.append(f"suite: {suite.get('name')} ({suite.get('chosen_by')})" + chat_template_note(suite))
    d = summary.get("degeneracy")
    if d:
        groups = f"; degenerate groups: {', '.join(d['groups'])}" if d["groups"] else ""
        judged, n_short = d.get("n_judged", d["n_measured"]), d.get("n_too_short", 0)
        short = too_short_note(n_short)
        lines.append(f"degenerate output: {d['n_flagged']} of {judged} judged prompts left out of the verdicts and "
                     f"speedups{groups}{short}" if d["n_flagged"] else
                     f"degenerate output: {nothing_judged(n_short)}" if not judged and n_short else
                     f"degenerate output: none of {judged} judged prompts (all in the verdicts){short}")
        lines += [f"  on those prompts only (not a verdict): {describe(c)}" for c in d.get("comparisons") or []]
        if d["n_flagged"] and d["n_flagged"] == d["n_measured"]:
            lines.append("no verdict: the target's greedy output is degenerate on every prompt (pick a suite that "
                         "matches the model: --suite)")
    return lines


def format_summary_lines(summary: dict) -> list[str]:
    """The summary as printable lines (verdicts first after the method table)."""
    identity = summary.get("greedy_identity") or {}
    lines = _suite_lines(summary) + _method_lines(summary.get("methods") or {}, identity.get("dtype", "?"))
    lines += [identity_line(identity)] if identity_line(identity) else []
    comps = summary.get("comparisons") or []
    if comps:
        lines.append("verdicts (live, paired 95% intervals):")
        lines += [f"  {describe(c)}" + (f" [{c['baseline_role']}]" if c.get("baseline_role") == "best heuristic"
                                        else "") for c in comps]
    lines += _rounds_line(summary.get("rounds"))
    groups = summary.get("groups") or {}
    if groups.get("n"):
        concl = "; ".join(f"{g['task']}/{g['language']} {g['verdict']}"
                          + (f" ({g['n_flagged']} degenerate prompt(s) left out)" if g.get("n_flagged") else "")
                          for g in groups["conclusive"])
        lines.append(f"task groups: {groups['n']}, {groups['too_small']} too small to conclude (< 5 prompts)"
                     + (f"; {concl}" if concl else ""))
    lines += _replay_lines(summary.get("replay"))
    lines += _cost_lines(summary.get("cost_check") or {})
    return lines
