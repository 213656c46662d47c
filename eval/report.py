"""Write an evaluation report: report.json, report.md and PNG plots (`specpilot.eval.plots`).

report.json: {"meta", "summary", "comparisons", "groups", "decisions", "replay", "cost_check", "degeneracy",
"greedy_identity", "results"}; greedy_identity ({"dtype", "differing", "cause", "expected", "note"}, null when nothing
greedy was compared) says which methods' greedy output differs from ar's and why: "rounding" in bf16 / fp16
(expected), "bug" in fp32 (`specpilot.eval.exactness`);
summary and results carry every speedup with its 95% paired interval `speedup_ci`; comparisons are method pairs
per temperature {"method", "baseline", "temperature", "ratio", "ci", "verdict", "flags", "same_decisions", ...}:
the verdict comes from the interval alone; a flag ("same decisions", with the decision time of both and its
`cause`; "replay outside the interval", with greedy comparisons' `replay` ratio) explains a difference beside it
(`specpilot.eval.compare`).
report.md leads with the verdicts, then speedups with intervals, the deciding pair by task group, replay beside
live, the cost-model check, decision statistics and the per-group tables. Prompts whose greedy output is
degenerate (`specpilot.eval.degeneracy`: the target loops or emits junk) are left out of the verdicts and the
summary; report.md says how many and shows their numbers apart.

Every table and plot carries the label a reader needs to trust a number: models and hashes, precision, device,
sampling and prompt mix, taken from the meta block.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from specpilot.drafting.cliargs import dtype_label
from specpilot.drafting.files import atomic_write_text
from specpilot.eval.compare import describe, interval_verdict
from specpilot.eval.degeneracy import judged_count, nothing_judged, too_short_count, too_short_note
from specpilot.eval.exactness import ROUNDING, differing_cell, greedy_identity
from specpilot.eval.stats import MIN_PROMPTS_TO_CONCLUDE
from specpilot.eval.suites import chat_template_note

REQUIRED_ROW_KEYS = ("task", "language", "split", "method", "temperature", "speedup", "tau", "tokens_per_s",
                     "ttft_s", "itl_p50_s", "itl_p90_s", "itl_p99_s", "peak_mem_mb", "policy_overhead",
                     "draft_frac", "identical_to_ar", "n_prompts", "n_tokens")
# rows from `evaluate` also carry "speedup_ci" and "n_units"
MAX_FLAGGED_ROWS = 40  # flagged prompts listed in report.md (all of them are in report.json)


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


def ending_note(sampling: dict) -> str:
    """", stop ['\\ndef '], stop token ids [13], ignore_eos": the ending options every method was given, or ""."""
    parts = ([f"stop {sampling['stop_strings']!r}"] if sampling.get("stop_strings") else []) + (
        [f"stop token ids {sampling['stop_token_ids']}"] if sampling.get("stop_token_ids") else []) + (
        ["ignore_eos"] if sampling.get("ignore_eos") else [])
    return "".join(f", {p}" for p in parts)


def row_ranges(rows: list[int]) -> str:
    """[1, 2, 3, 5, 9, 10] -> "1-3, 5, 9-10"."""
    parts, start = [], None
    for i, r in enumerate(rows):
        start = r if start is None else start
        if i + 1 == len(rows) or rows[i + 1] != r + 1:
            parts.append(f"{start}-{r}" if r > start else f"{r}")
            start = None
    return ", ".join(parts)


def measurement_label(meta: dict) -> str:
    """What a number was measured on: models, precision, device and hardware, sampling, suite and prompt mix."""
    models = meta.get("models", {})
    hw = meta.get("gpu") or meta.get("cpu") or "?"
    s = meta.get("sampling", {})
    mix = meta.get("prompt_mix", {})
    threads = f", {meta['torch_threads']} threads" if meta.get("torch_threads") else ""
    turned = [m for m in (meta.get("small_row_linears") or {}).get("measured", []) if m.get("rows")]
    if turned:  # drafting/linear_kernels.py: the target's row plan (products of few rows taken as W @ x^T)
        threads += f", linears of {row_ranges(turned[0]['rows'])} rows as W @ x^T"
        if turned[0].get("source") == "cache":  # measured by an earlier process on this machine (plan_cache)
            threads += f" (plan cached {str(turned[0].get('measured_at'))[:16]})"
    temperatures = ",".join(f"{t:g}" for t in s.get("temperatures") or []) or "?"
    splits = mix.get("by_split") or {}
    return (f"{models.get('name', '?')} (target {models.get('target_hash', '?')}, draft {models.get('draft_hash', '?')})"
            f" | {meta.get('dtype', '?')} on {meta.get('device', '?')} ({hw}{threads})"
            f" | T={temperatures}, top_k={s.get('top_k')}, top_p={s.get('top_p')}, "
            f"max_new_tokens={s.get('max_new_tokens')}, seed {s.get('seed')}{ending_note(s)}"
            + (f" | suite {meta['suite']['name']}{chat_template_note(meta['suite'])}"
               if isinstance(meta.get("suite"), dict) else "")
            + f" | {mix.get('n_prompts', '?')} prompts: "
            + ", ".join(f"{k} {v}" for k, v in sorted(mix.get("by_task", {}).items()))
            + (" (splits " + ", ".join(f"{k} {v}" for k, v in sorted(splits.items())) + ")" if len(splits) > 1
               else ""))


def dtype_line(meta: dict) -> str:
    """"dtype auto: float32, this CPU has ...": the numbers' precision and why it was chosen (meta.dtype_reason)."""
    return f"dtype {dtype_label(meta.get('dtype', '?'), meta.get('dtype_reason'))}"


def report_identity(report: dict) -> dict | None:
    """report.json's `greedy_identity` (`specpilot.eval.exactness.greedy_identity`) from a report payload: a method
    is identical when every greedy comparison of it with ar (summary rows, every batch size) was; None when nothing
    greedy was compared."""
    sections = report.get("batch_sizes") or []
    rows = [*(report.get("summary") or []), *(row for s in sections for row in s.get("methods") or [])]
    identical: dict[str, bool] = {}
    for row in rows:
        if row.get("identical_to_ar") is not None:
            identical[row["method"]] = identical.get(row["method"], True) and bool(row["identical_to_ar"])
    return greedy_identity(identical, (report.get("meta") or {}).get("dtype") or "?")


def _identity_cell(identical, dtype, detail: str = "") -> str:
    """An "identical to ar" cell: yes / - as `_fmt`, a difference labelled with its cause (`differing_cell`)."""
    return differing_cell(dtype, detail) if identical is False else _fmt(identical)


def _identity_lines(block: dict | None) -> list[str]:
    """The note (half-precision rounding) or warning (a bug) under the verdicts when greedy output differs."""
    line = (block or {}).get("note")
    return [line if block["cause"] == ROUNDING else f"**{line}**", ""] if line else []


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


def _ci(low, high, spec: str = ".2f") -> str:
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return "[no interval]"
    return f"[{format(low, spec)}, {format(high, spec)}]"


def _with_ci(value, ci, spec: str = ".2f") -> str:
    """"1.19 [1.15, 1.22]"; the value alone when there is no interval (one unit)."""
    low, high = ci or [None, None]
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return _fmt(value, spec)
    return f"{_fmt(value, spec)} {_ci(low, high, spec)}"


def _rounds_lines(meta: dict) -> list[str]:
    rounds = meta.get("rounds")
    if not rounds:
        return []
    target = rounds.get("target_half_width")
    lines = [f"**Rounds** ({rounds.get('mode', '?')}; budget {_fmt(rounds.get('time_budget_s'), '.0f')} s, target "
             f"+-{_fmt(None if target is None else 100 * target, '.1f')}%, every method in the first "
             f"{rounds.get('full_rounds') or 'all'} round(s)):", ""]
    for t, r in rounds.get("by_temperature", {}).items():
        hw = r.get("decide_half_width")
        decided = (f", {r['decide'][0]} vs {r['decide'][1]} interval +-{100 * hw:.1f}%" if hw is not None
                   and math.isfinite(hw) and r.get("decide") else "")
        lines.append(f"- T={t}: {r['rounds']} rounds, {r['units']} units, {_fmt(r.get('seconds'), '.0f')} s; "
                     f"stopped: {r['stopped_by']}{decided}")
    return lines + [""]


def _verdict_lines(analysis: dict) -> list[str]:
    comps = analysis.get("comparisons") or []
    if not comps:
        return []
    lines = ["## Verdicts (live, paired 95% intervals)", ""]
    lines += [f"- {describe(c)}" + (f" [{c['baseline_role']}]" if c.get("baseline_role") not in (None, "decide")
                                    and c.get("baseline_role") != c["baseline"] else "") for c in comps]
    return lines + [""]


def _excluded_note(degeneracy: dict | None) -> list[str]:
    """The line under the verdicts saying how many prompts the degeneracy rule left out of them."""
    if not degeneracy:
        return []
    n, k, n_short = judged_count(degeneracy), len(degeneracy.get("flagged", [])), too_short_count(degeneracy)
    short = too_short_note(n_short)
    if not n and n_short:
        return [f"No prompt left out: {nothing_judged(n_short)}.", ""]
    if not k:
        return [f"No prompt left out: the target's greedy output is not degenerate on any of {n} judged prompts"
                f"{short}.", ""]
    return [f"**{k} of {n} judged prompts left out** of the verdicts and the speedup summary: the target's greedy "
            "output on them is degenerate (loops or junk; see \"Degenerate output\" below, where their numbers are "
            f"shown apart){short}.", ""]


def _degeneracy_lines(degeneracy: dict | None) -> list[str]:
    """Flagged groups and prompts with their measures, and the comparisons on them, apart from the verdicts."""
    if not degeneracy:
        return []
    flagged = degeneracy.get("flagged", [])
    lines = ["## Degenerate output (left out of the verdicts)", "",
             f"Rule: {degeneracy['rule']}. Measured on the target's own greedy output (the `ar` runs at T=0) of "
             f"{degeneracy['n_measured']} of {degeneracy['n_prompts']} prompts, {judged_count(degeneracy)} judged: "
             f"{len(flagged)} flagged{too_short_note(too_short_count(degeneracy))}.", "",
             "| task | language | prompts | judged | flagged | group degenerate |", "|---|---|---|---|---|---|"]
    for g in degeneracy.get("groups", []):
        lines.append(f"| {g['task']} | {g['language']} | {g['n_measured']} | {g.get('n_judged', g['n_measured'])} | "
                     f"{g['n_flagged']} | {'YES' if g['degenerate'] else 'no'} |")
    if flagged:
        lines += ["", "| prompt | repeated 4-grams | compression | distinct tokens | reason | output starts |",
                  "|---|---|---|---|---|---|"]
        for pid in flagged[:MAX_FLAGGED_ROWS]:
            m = degeneracy["prompts"][pid]
            sample = m.get("sample", "").replace("\n", "\\n").replace("|", "\\|").replace("`", "'")
            lines.append(f"| {pid} | {m['repeated_ngram_share']:.0%} | {m['compression_ratio']:.2f} | "
                         f"{m['distinct_token_ratio']:.2f} | {m['reason']} | {f'`{sample}`' if sample else '-'} |")
        if len(flagged) > MAX_FLAGGED_ROWS:
            lines.append(f"| ... {len(flagged) - MAX_FLAGGED_ROWS} more in report.json `degeneracy` | | | | | |")
    comps = degeneracy.get("comparisons") or []
    if comps:
        lines += ["", "On the flagged prompts only (not verdicts: speed on degenerate text):", ""]
        lines += [f"- {describe(c)}" for c in comps]
    return lines + [""]


def flagged_by_group(degeneracy: dict | None) -> dict:
    """{(task, language): prompts flagged degenerate} of a report's degeneracy block (groups with none left out)."""
    return {(g["task"], g["language"]): g["n_flagged"] for g in (degeneracy or {}).get("groups", [])
            if g.get("n_flagged")}


def _summary_scope(results: list[dict], meta: dict) -> str:
    """"Held-out" only when every prompt is; a suite that mixes splits is named with its split counts."""
    splits = (meta.get("prompt_mix") or {}).get("by_split") or {}
    if splits:
        if all("heldout" in str(k) for k in splits):
            return "Held-out"
        if len(splits) > 1:
            return "All-prompt (splits " + ", ".join(f"{k} {n}" for k, n in sorted(splits.items())) + ")"
        return "All-prompt"
    return "Held-out" if results and all("heldout" in str(r.get("split", "")) for r in results) else "All-prompt"


def _summary_lines(summary: list[dict], scope: str, dtype: str = "?") -> list[str]:
    if not summary:
        return []
    lines = [f"## {scope} speedup over ar (pooled over units, 95% paired interval)", ""]
    for t in sorted({s["temperature"] for s in summary}):
        units = {s.get("n_units") for s in summary if s["temperature"] == t}
        if len(units) > 1:  # --full-rounds: later rounds ran ar and the deciding pair only
            lines += [f"At T={t:g} the methods ran different numbers of units (later rounds ran `ar` and the "
                      "deciding pair only): each speedup is paired with `ar` on the method's own units, so rows "
                      "measured in different rounds are not ranked against each other; the comparisons pair them.",
                      ""]
    lines += ["| method | T | speedup [95% CI] | tau | policy overhead | identical to ar | units | prompts |",
              "|---|---|---|---|---|---|---|---|"]
    for s in sorted(summary, key=lambda s: (s["temperature"], -(s.get("speedup") or 0))):
        ci = s.get("speedup_ci")
        cell = _with_ci(s.get("speedup"), ci) if ci is not None else _fmt(s.get("mean_speedup"))
        lines.append(f"| {s['method']} | {s['temperature']:g} | {cell} | {_fmt(s.get('tau') or s.get('mean_tau'))} |"
                     f" {_fmt(s.get('policy_overhead'), '.4f')} | {_identity_cell(s.get('identical_to_ar'), dtype)} | "
                     f"{s.get('n_units', '-')} | {s.get('n_prompts', s.get('n_groups', '-'))} |")
    return lines + [""]


def _group_lines(groups: list[dict], flagged: dict | None = None) -> list[str]:
    """flagged: {(task, language): prompts flagged degenerate}: left out of the group's interval, said beside it."""
    if not groups:
        return []
    flagged = flagged or {}
    m, b = groups[0]["method"], groups[0]["baseline"]
    lines = [f"## {m} vs {b} by task group (live)", "",
             f"Groups with fewer than {MIN_PROMPTS_TO_CONCLUDE} prompts are too small to conclude: their intervals "
             "only cover timing noise on those few prompts.", "",
             "| T | task | language | ratio [95% CI] | verdict | prompts | units |", "|---|---|---|---|---|---|---|"]
    for g in groups:
        v = interval_verdict(g)
        v = f"too small to conclude ({v})" if g["too_small"] else v
        if g.get("same_decisions"):  # a flag beside the verdict, never instead of it
            v += f"; flag: same decisions ({g['cause']})" if g.get("cause") else "; flag: same decisions"
        ratio = _with_ci(g["ratio"], g["ci"], ".3f")
        if flagged.get((g["task"], g["language"])):
            v += f" ({flagged[(g['task'], g['language'])]} degenerate prompt(s) left out)"
        lines.append(f"| {g['temperature']:g} | {g['task']} | {g['language']} | {ratio} | {v} | {g['n_prompts']} |"
                     f" {g['n_units']} |")
    return lines + [""]


def _decision_charge(replay: dict) -> str:
    """How replay charged deciding: the profile's measured time per question a policy network answers."""
    charged = replay.get("decision_us") or {}
    if not charged:
        return "Decisions free (the profile did not time them)."
    shares = ", ".join(f"{m['method']} {100 * m['decision_share']:.1f}%" for m in replay["methods"]
                       if m.get("decision_share"))
    return ("Decision time charged to each question a policy network answers, as measured with the profile ("
            + ", ".join(f"{q} {us:.0f} us" for q, us in sorted(charged.items())) + "; rules, fixed configs and the "
            "oracle decide for free)" + (f": {shares} of the replayed time." if shares else "."))


def _replay_lines(replay: dict | None) -> list[str]:
    if not replay:
        return []
    prof = replay.get("profile") or {}
    lines = ["## Replay beside live (T=0)", "",
             f"Replay: every controller over greedy traces of the same {replay['n_prompts']} prompts"
             + (f" (the {replay['n_degenerate_left_out']} with degenerate output left out, as in the verdicts)"
                if replay.get("n_degenerate_left_out") else "") + ", exact accepted "
             f"lengths, time from the latency profile ({prof.get('source', '?')}; created {prof.get('created')}). "
             f"AR reference: decode time {replay.get('ar_source', 'of the live ar runs')}, "
             f"{1000 * replay['ar_seconds_per_token']:.2f} ms/token. {_decision_charge(replay)} "
             "Gap = replay / live - 1 (replay leaves out prefill, a rule's own time and load changes during the live "
             "rounds)."
             + (f" Replay only (not run live, to save time): {', '.join(replay['replay_only'])}."
                if replay.get("replay_only") else ""), "",
             "| method | live speedup [95% CI] | replay speedup [95% CI over prompts] | gap | share of oracle "
             "(throughput) | share of oracle's gain over ar |",
             "|---|---|---|---|---|---|"]
    share = replay.get("oracle", {}).get("share", {})
    gain = replay.get("oracle", {}).get("gain_share", {})  # (older reports lack it)
    for m in sorted(replay["methods"], key=lambda m: -m["speedup"]):
        gap = f"{100 * m['gap']:+.1f}%" if m.get("gap") is not None else "-"
        lines.append(f"| {m['method']} | {_with_ci(m.get('live_speedup'), m.get('live_speedup_ci'))} | "
                     f"{_with_ci(m['speedup'], m['speedup_ci'])} | {gap} | {_fmt(share.get(m['method']), '.0%')} | "
                     f"{_fmt(gain.get(m['method']), '.0%')} |")
    o = replay.get("oracle")
    if o:
        bs = o["best_static"]
        own = o.get("per_prompt_static_speedup")  # (older reports lack it)
        lines += ["", f"Hindsight oracle on these traces: {o['speedup']:.2f}x over ar (per-cycle greedy oracle "
                  f"{o['greedy_oracle_speedup']:.2f}x); best static config under replay d={bs['depth']}, "
                  f"V={bs['size']}: {bs['speedup']:.2f}x"
                  + (f"; each prompt at its own best static config (chosen in hindsight): {own:.2f}x, the most "
                     "that telling kinds of prompts apart can gain; the rest of the oracle's gain is within prompts"
                     if own is not None else "") + "."]
    if replay.get("comparisons"):
        lines += ["", "Under replay (no timing noise; intervals over prompts):", ""]
        lines += [f"- {describe({**c, 'n_units': c['n_units']})}" for c in replay["comparisons"]]
    if replay.get("skipped"):
        lines += ["", "Not replayed: " + "; ".join(f"`{k}`: {v}" for k, v in replay["skipped"].items())]
    return lines + [""]


def _check_table(check: dict) -> list[str]:
    lines = ["| config | predicted tok/s | measured tok/s | error | live spread | beyond tolerance |",
             "|---|---|---|---|---|---|"]
    for c in check.get("configs", []):
        name = c.get("method", c["config"]) + (f" ({c['config']})" if c.get("method") else "")
        lines.append(f"| {name} | {c['predicted_tokens_per_s']:.1f} | {c['measured_tokens_per_s']:.1f} | "
                     f"{100 * c['error']:+.1f}% | +-{100 * c['spread']:.1f}% | {'YES' if c['off'] else 'no'} |")
    return lines


def _cost_lines(cost: dict | None) -> list[str]:
    if not cost:
        return []
    lines = ["## Cost model check", "",
             "Replay's predicted tokens/s of static configs against live tokens/s (decode time) on the same prompts; "
             "the plain step (d0_s0: replay's autoregressive decoding) against live ar. "
             "A profile is stale when a prediction misses the live value by more than the live measurement's own "
             "spread plus the tolerance.", ""]
    for key, entry in cost.items():
        if not isinstance(entry, dict) or "configs" not in entry:
            continue
        age = entry.get("age_s")
        age_text = f"{age / 60:.1f} min" if age is not None else "unknown"
        state = "STALE" if entry["stale"] else "within tolerance"
        lines += [f"**{entry.get('title', key)}** (profile age {age_text}, tolerance "
                  f"{100 * entry['tolerance']:.0f}%): {state}"
                  + (f"; {entry['action']}" if entry.get("action") else ""), ""] + _check_table(entry) + [""]
    return lines


def _decision_lines(decisions: dict, reference: str = "grid") -> list[str]:
    """reference: the deciding pair's baseline, whose most frequent (depth, size) the other methods are compared to."""
    if not decisions:
        return []
    lines = ["## Decisions", "",
             "Per method: cycles, mean depth and size, their histograms (value:cycles), the share of cycles whose "
             f"(depth, size) differs from {reference}'s config, units decided exactly like {reference}, and the mean "
             f"over units of |tau - tau({reference})|.", "",
             f"| T | method | cycles | mean depth | mean size | depths | sizes | differs from {reference} | units "
             f"same as {reference} | mean abs tau diff |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t, per in decisions.items():
        for name, s in sorted(per.items()):
            hist = lambda h: " ".join(f"{k}:{v}" for k, v in h.items())  # noqa: E731
            lines.append(f"| {t} | {name} | {s['cycles']} | {s['mean_depth']:.2f} | {s['mean_size']:.1f} | "
                         f"{hist(s['depth_hist'])} | {hist(s['size_hist'])} | "
                         f"{_fmt(s.get('differs_from_reference'), '.0%')} | "
                         f"{_fmt(s.get('units_same_as_reference'), '.0%')} | "
                         f"{_fmt(s.get('mean_abs_tau_diff'), '.3f')} |")
    return lines + [""]


def _table(rows: list[dict], methods: list[str], key: str, spec: str, flagged: dict | None = None,
           dtype: str = "?") -> list[str]:
    """flagged: {(task, language): prompts flagged degenerate}; these per-group rows describe every prompt, so
    the group's label says how many of them loop or are junk. dtype: labels a greedy difference's cause."""
    flagged = flagged or {}
    cells = {(r["task"], r["language"], r["method"]): r for r in rows}
    groups = sorted({(r["task"], r["language"]) for r in rows})
    lines = ["| task | language | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for task, lang in groups:
        out = []
        for m in methods:
            r = cells.get((task, lang, m))
            if r is None:
                out.append("-")
            elif key == "speedup" and "speedup_ci" in r:
                out.append(_with_ci(r.get(key), r.get("speedup_ci"), spec))
            else:
                out.append(_identity_cell(r.get(key), dtype) if key == "identical_to_ar" else _fmt(r.get(key), spec))
        mark = f" ({flagged[(task, lang)]} degenerate)" if flagged.get((task, lang)) else ""
        lines.append(f"| {task}{mark} | {lang} | " + " | ".join(out) + " |")
    return lines


ROW_TABLES = (("speedup", "Speedup over ar [95% paired interval]", ".2f"), ("tau", "Mean accepted length tau", ".2f"),
              ("tokens_per_s", "Tokens/s", ".1f"), ("ttft_s", "TTFT (s)", ".4f"), ("itl_p50_s", "ITL p50 (s)", ".4f"),
              ("itl_p99_s", "ITL p99 (s)", ".4f"), ("policy_overhead", "Policy overhead (fraction of time)", ".4f"),
              ("draft_frac", "Draft time fraction", ".3f"), ("peak_mem_mb", "Peak memory (MiB)", ".0f"),
              ("identical_to_ar", "Identical to ar", ""))


def _row_tables(results: list[dict], flagged: dict | None = None, dtype: str = "?") -> list[str]:
    methods = list(dict.fromkeys(r["method"] for r in results))
    lines = []
    for temperature in sorted({r["temperature"] for r in results}):
        for c in sorted({r.get("concurrency", 1) for r in results}):
            rows = [r for r in results if r["temperature"] == temperature and r.get("concurrency", 1) == c]
            lines += [f"## Per group, temperature {temperature:g}" + (f", concurrency {c}" if c > 1 else ""), "",
                      "Tokens/s, TTFT and ITL: each method over the units it ran (`ar` over every round); the "
                      "speedup is paired with `ar` on the units both ran, so it need not equal the ratio of the "
                      "tokens/s cells.", ""]
            for key, label, spec in ROW_TABLES:
                if key == "identical_to_ar" and temperature != 0:
                    continue
                lines += [f"**{label}**", ""] + _table(rows, methods, key, spec, flagged, dtype) + [""]
    return lines


def batch_lines(sections: list[dict], dtype="?") -> list[str]:
    """Markdown of `specpilot.eval.batched.evaluate_batches`' sections: a heading per temperature (naming it, and
    how exactness stands there), one table per batch size (method, tokens/s, ms/token, speedup over batched ar
    [95% CI], verdict, exact: a greedy difference labelled with its cause in `dtype`), then its comparisons."""
    if not sections:
        return []

    def ci(pair) -> str:
        low, high = pair if pair else (None, None)
        ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (low, high))
        return f"[{low:.2f}, {high:.2f}]" if ok else "[n/a]"

    lines = []
    for i, section in enumerate(sections):
        temperature = float(section.get("temperature", 0.0))
        if i == 0 or temperature != float(sections[i - 1].get("temperature", 0.0)):  # a heading per temperature
            mode = "greedy" if temperature == 0 else f"sampled, T={temperature:g}"
            exact = ("exact: every sequence equals batched ar's" if temperature == 0 else
                     f"exact: {section.get('exactness', 'the target law per sequence')}; both sides sample with "
                     "per-sequence seeds, the same for every method of a batch")
            lines += [f"## Throughput by batch size ({mode}; reference: batched ar)", "",
                      "A unit is one batch of B prompts (in order, wrapping so every batch is full) in one round; "
                      "per unit every method decoded the same batch back to back, in a balanced order (Williams "
                      "design). tokens/s: all sequences' tokens over the calls' wall time (prefill included); "
                      "ms/token: per sequence, time to its last token over its tokens, averaged; intervals: 95% "
                      "paired bootstrap over batches "
                      f"(over (batch, round) units where there is one batch); {exact}.", ""]
        tag = "" if temperature == 0 else f", T={temperature:g}"
        lines += [f"### Batch size {section['batch_size']} ({section['units']} batches x "
                  f"{section['rounds']['rounds']} round(s){tag})", "",
                  "| method | tokens/s | ms/token | speedup vs ar [95% CI] | verdict | depth | size | exact |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in section["methods"]:
            depth = "-" if row["depth_mean"] is None else f"{row['depth_mean']:.1f}"
            size = "-" if row["size_mean"] is None else f"{row['size_mean']:.1f}"
            exact = ("law (sampled)" if row["identical_to_ar"] is None else
                     _identity_cell(row["identical_to_ar"], dtype, f"{row['mismatched_sequences']} sequences"))
            lines.append(f"| {row['method']} | {row['tokens_per_s']:.1f} | {row['per_token_ms']:.1f} | "
                         f"{row['speedup']:.3f} {ci(row['speedup_ci'])} | {row['verdict'] or '-'} | {depth} | "
                         f"{size} | {exact} |")
        for c in section["comparisons"]:
            lines.append(f"- {c['method']} vs {c['baseline']}: {c['ratio']:.3f} {ci(c['ci'])}, {c['verdict']}")
        lines.append("")
    return lines


def _markdown(results: list[dict], meta: dict, analysis: dict, plots: list[str],
              identity: dict | None = None) -> str:
    protocol = meta.get("protocol", {})
    dtype = meta.get("dtype") or "?"
    lines = ["# specpilot evaluation", "", f"**Measured on:** {measurement_label(meta)}", "",
             f"**Precision:** {dtype_line(meta)}", "",
             f"Date {meta.get('date')}; versions {meta.get('versions')}; tree {meta.get('tree')}; "
             f"protocol {protocol.get('interleaving')}; warm-up {protocol.get('warmup')}.", ""]
    lines += _rounds_lines(meta)
    if meta.get("skipped"):
        lines += ["**Skipped methods:**", ""] + [f"- `{k}`: {v}" for k, v in meta["skipped"].items()] + [""]
    lines += _verdict_lines(analysis)
    degeneracy = analysis.get("degeneracy")
    lines += _identity_lines(identity)
    lines += _excluded_note(degeneracy)
    scope = _summary_scope(results, meta)
    # with a degeneracy block an empty summary means every prompt was left out: no fallback to all groups' rows
    lines += _summary_lines(analysis.get("summary") or ([] if degeneracy else heldout_summary(results)), scope, dtype)
    flagged = flagged_by_group(degeneracy)
    lines += _group_lines(analysis.get("groups") or [], flagged)
    lines += _degeneracy_lines(degeneracy)
    lines += _replay_lines(analysis.get("replay"))
    lines += _cost_lines(analysis.get("cost_check"))
    decide = (meta.get("rounds") or {}).get("decide") or ["ltd", "grid"]
    lines += _decision_lines(analysis.get("decisions") or {}, decide[1])
    lines += batch_lines(analysis.get("batch_sizes") or [], dtype)
    lines += _row_tables(results, flagged, dtype)
    lines += ["## Definitions", ""] + [f"- {k}: {v}" for k, v in protocol.items()] + [
        "- tau: tokens emitted per target forward, bonus token included (1 for autoregressive decoding).",
        "- policy_overhead / draft_frac: controller / draft time over the wall time of the generations.",
        "- identical_to_ar: at temperature 0, every run's tokens equal `ar`'s; not defined when sampling. In fp32 a "
        "difference is a bug (NO); in bf16 / fp16 it is rounding (\"no (bfloat16 rounding)\": a tree forward and a "
        "one-token forward round differently, so a near tie can flip), expected, and the speedup is still reported.",
        "- verdicts: faster / slower when the 95% interval of the ratio excludes 1, indistinguishable when it "
        "contains 1. Flag \"same decisions\": both made the same (depth, size) on every cycle of every unit; "
        "the ratio still differs by each controller's decision time and by timing noise, so the flag gives both "
        "methods' decision time per generation, the ratio without it, and the cause of the difference.",
        "- intervals of the verdicts and speedups: 95% paired bootstrap over prompts (each prompt's rounds resampled "
        "together), so they cover the choice of prompts as well as timing noise.",
        "- degenerate output: " + (degeneracy or {}).get("rule", "not measured (no greedy ar run)") + ".", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def write_report(results: list[dict], meta: dict, out_dir: str | Path, *, plots: bool = True,
                 analysis: dict | None = None) -> dict[str, str]:
    """Write report.json, report.md and the PNG plots into `out_dir`; return {kind: path}.

    `analysis` (`EvalResult.analysis()`): summary, comparisons, groups, decisions, replay and cost_check blocks;
    without it the report has the rows and a mean-over-groups summary only."""
    from specpilot.eval.plots import write_plots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        missing = [k for k in REQUIRED_ROW_KEYS if k not in r]
        assert not missing, f"result row {r.get('method')}/{r.get('task')} lacks keys {missing}"
    analysis = dict(analysis or {})
    png = write_plots(results, analysis, measurement_label(meta), out) if plots and results else []
    summary = analysis.get("summary") or ([] if analysis.get("degeneracy") else heldout_summary(results))
    payload = {"meta": meta, "summary": summary,
               **{k: analysis.get(k) for k in ("comparisons", "groups", "decisions", "replay", "cost_check",
                                               "degeneracy")},
               "results": results}
    if analysis.get("batch_sizes"):  # `specpilot eval --batch-sizes`: one section per batch size
        payload["batch_sizes"] = analysis["batch_sizes"]
    payload["greedy_identity"] = report_identity(payload)  # which greedy outputs differ from ar's, and why
    # atomic: an interrupted or failing write never leaves a half-written report beside the old one
    atomic_write_text(out / "report.json", json.dumps(_clean(payload), indent=1, ensure_ascii=False))
    atomic_write_text(out / "report.md", _markdown(results, meta, analysis, png, payload["greedy_identity"]))
    return {"json": str(out / "report.json"), "md": str(out / "report.md"), **{Path(p).stem: p for p in png}}
