"""Exact replay evaluation beside live: the evaluated controllers replayed over greedy traces of the same prompts.

Under greedy decoding the output does not depend on (depth, size), so a trace of the held-out prompts
(`specpilot.envs.record.record_trace`, recorded once and reused) gives every controller's exact accepted lengths,
and a latency profile its time (`specpilot.envs.replay.replay_controller`: the controller sees the recorded
DraftStates through the same Controller interface the live decoder calls). Replay ratios between methods have no
timing noise; their intervals (units: prompts) show only how the ratio varies over prompts.

What is compared with what:
- replay speedup of a method = its replayed tokens/s over autoregressive tokens/s: the AR decode time measured
  with the profile (profile.meta["ar_seconds_per_token"], interleaved with it, so a change of load between the
  profile and the live rounds cancels), else this run's live `ar` decode time (wall minus prefill);
- decision time: each question a controller answers with a policy network costs the probe policy's time measured
  with the profile (`LatencyProfile.decision`), as live; rules and fixed configs answer for free, and so does the
  oracle (a ceiling on decisions, not on deciding);
- gap = replay speedup / live speedup - 1: the cost model's error plus what replay leaves out (prefill, a rule's
  own time, bookkeeping outside cycles);
- the hindsight oracle (`replay_oracle`) on the same traces: the ceiling any (depth, size) policy can reach, and
  each method's share of it.
Replay is greedy only (T=0).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specpilot.artifacts.trace import is_trace
from specpilot.drafting.types import TreeConfig
from specpilot.eval.compare import DECIDE, HEURISTICS, LEARNED, task_groups
from specpilot.eval.metrics import RunRecord
from specpilot.eval.stats import MIN_PROMPTS_TO_CONCLUDE, paired_ratio_interval, same_decisions, verdict
from specpilot.drafting.control import Controller, DecisionLog


REPLAY_CACHE = "eval --replay-dir"  # trace.json "recorded_by" of the traces evaluation records (its cache)


def check_replaceable_trace(out_dir: str | Path | None, *, tree: TreeConfig, max_new_tokens: int,
                            num_prompts: int | None = None, also: Sequence[str] = ()) -> None:
    """Evaluation re-records its replay cache when the prompts, tree or budget change, but a trace it did not record
    there (`specpilot record`'s, say a training trace) is someone's data: replacing it is refused (ContractError)
    unless it is the very recording asked for. Checked before any work with what is known then (tree, budget,
    number of prompts), and again with the prompts' token ids before recording."""
    from specpilot.artifacts.contract import ContractError
    from specpilot.artifacts.trace import TraceHeader

    if out_dir is None or not is_trace(out_dir):
        return
    try:
        head = TraceHeader.load(out_dir)
    except (OSError, ValueError):  # unreadable: re-recorded, as before
        return
    if head.data.get("recorded_by") == REPLAY_CACHE:
        return
    recorded = head.data.get("prompts") or []
    want = {"width": tree.width, "max_depth": tree.max_depth, "max_size": tree.max_size}
    differ = [what for what, same in (
        (f"tree {head.tree} vs {want}", head.tree == want),
        (f"max_new_tokens {head.max_new_tokens} vs {max_new_tokens}", head.max_new_tokens == max_new_tokens),
        (f"{len(recorded)} vs {num_prompts} prompts", num_prompts is None or len(recorded) == num_prompts))
        if not same] + list(also)
    if differ:
        raise ContractError(f"--replay-dir {out_dir} holds a trace this evaluation did not record (recorded vs asked: "
                            f"{'; '.join(differ)}); evaluation would record over it: give an empty or new folder "
                            "(that trace is left as it is)")


def heldout_trace(pair, tree: TreeConfig, ids: Sequence[Sequence[int]], out_dir: str | Path | None, *,
                  max_new_tokens: int, progress: bool = False):
    """The greedy trace of `ids` (token ids per prompt) with `tree`: loaded from `out_dir` when it holds one of
    the same pair, tree, budget and prompt tokens, else recorded (and saved there, marked as evaluation's cache,
    when out_dir is given; a trace someone else recorded there is never replaced: `check_replaceable_trace`)."""
    from specpilot.envs.record import Trace, record_trace
    from specpilot.envs.shards import pair_content

    want = {"width": tree.width, "max_depth": tree.max_depth, "max_size": tree.max_size}
    if out_dir is not None and is_trace(out_dir):
        also = ["unreadable arrays"]
        try:
            trace = Trace.load(out_dir)
            same_tokens = [trace.prompt(i) for i in range(trace.num_prompts)] == [list(p) for p in ids]
            # by content (hashes, drafter, vocabulary), not by the paths the models were loaded from
            same_pair = pair_content(trace.header.get("pair") or {}) == pair_content(pair.identity())
            same_shape = trace.header.get("tree") == want and trace.max_new_tokens == max_new_tokens
            if same_tokens and same_pair and same_shape:
                return trace
            also = [what for what, same in (("other prompt tokens", same_tokens), ("another pair", same_pair))
                    if not same]
        except (ValueError, OSError, KeyError):
            pass  # unreadable or another version: record again (if evaluation recorded it)
        check_replaceable_trace(out_dir, tree=tree, max_new_tokens=max_new_tokens, num_prompts=len(ids), also=also)
    trace = record_trace(pair, tree, [list(p) for p in ids], max_new_tokens=max_new_tokens, progress=progress)
    if out_dir is not None:
        trace.header["recorded_by"] = REPLAY_CACHE
        trace.save(out_dir)
    return trace


def record_on_workers(trace_workers, tree: TreeConfig, texts: Sequence[str], out_dir: str | Path, *,
                      max_new_tokens: int) -> Path:
    """Record the greedy trace of `texts` into out_dir on the processes of `trace_workers` side by side (a
    `specpilot.train.scale.processes.ProcessPool`: recording reads no clock), in shards of prompts merged in prompt
    order, marked as evaluation's cache: `heldout_trace` then finds it there (same prompts, pair, tree and budget)
    instead of recording it in one process."""
    from specpilot.drafting.executor import ShardTask, shard_ranges
    from specpilot.envs.record import Trace, merge_traces, record_shard

    shape = {"width": tree.width, "max_depth": tree.max_depth, "max_size": tree.max_size}
    # one prompt a shard: no process idles at the end while another records a long last shard
    tasks = [ShardTask(i, {"prompts": list(texts[lo:hi]), "tree": shape, "max_new_tokens": max_new_tokens,
                           "profile_prompts": [], "seed": [0, i], "ar": False}, list(range(lo, hi)))
             for i, (lo, hi) in enumerate(shard_ranges(len(texts), len(trace_workers), 1))]
    outcomes = trace_workers.map(record_shard, tasks)
    trace = merge_traces([Trace(o.result["header"], o.result["arrays"]) for o in outcomes])
    trace.header["recorded_by"] = REPLAY_CACHE  # (a pair other than the evaluation's: heldout_trace records again)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return trace.save(out_dir)


def ar_seconds_per_token(records: Sequence[RunRecord]) -> float:
    """Decode seconds per token of the live greedy `ar` runs (wall time minus prefill, pooled)."""
    ar = [r for r in records if r.method == "ar" and r.temperature == 0.0 and r.concurrency == 1]
    tokens = sum(r.n_tokens for r in ar)
    if not tokens:
        raise ValueError("no live greedy `ar` runs: replay speedups need the run's autoregressive reference")
    return sum(r.wall_s - r.prefill_s for r in ar) / tokens


def _replay_units(trace, profile, controller: Controller, n: int) -> dict:
    """Per prompt: tokens, modelled time (s) and the (depth, size) log of `controller` under replay."""
    from specpilot.envs.oracle import replay_controller

    logged = DecisionLog(copy.deepcopy(controller))
    tokens, times, logs, deciding = [], [], [], []
    for i in range(n):
        start = len(logged.log)
        out = replay_controller(trace, profile, logged, prompts=[i])
        tokens.append(out["tokens"])
        times.append(out["time_s"])
        deciding.append(out["decision_s"])
        logs.append(logged.log[start:])
    return {"tokens": np.asarray(tokens, float), "time_s": np.asarray(times, float), "logs": logs,
            "decision_s": np.asarray(deciding, float)}


def _ratio(a: dict, b: dict, idx: Sequence[int], *, seed: int) -> dict:
    idx = list(idx)
    interval = paired_ratio_interval(a["tokens"][idx], a["time_s"][idx], b["tokens"][idx], b["time_s"][idx],
                                     seed=seed)
    same = same_decisions([a["logs"][i] for i in idx], [b["logs"][i] for i in idx])
    return {"ratio": interval.ratio, "ci": interval.ci(), "same_decisions": same, "verdict": verdict(interval),
            "flags": ["same decisions"] if same else [], "n_units": interval.n_units}


def replay_evaluation(result, trace, profile, *, prompts: Sequence, seed: int = 0,
                      decide: tuple[str, str] = DECIDE, profile_info: dict | None = None,
                      replay_only: dict | None = None) -> dict:
    """Replay every controller of `result` (an `EvalResult`) and of `replay_only` ({name: (controller, tree)}:
    methods not run live) over `trace` (recorded on `prompts`, in order) with `profile`; the dict the report
    prints as "Replay beside live" (module docstring). Methods whose tree width differs from the trace's are
    skipped with the reason. Prompts whose target output is flagged degenerate (`result.degeneracy`) are left out,
    as the live verdicts leave them out (`kept_prompts`)."""
    from specpilot.envs.oracle import replay_oracle

    if trace.num_prompts != len(prompts):
        raise ValueError(f"the trace has {trace.num_prompts} prompts but {len(prompts)} were evaluated: record the "
                         "trace on the evaluated prompts, in order")
    s_per_token = (getattr(profile, "meta", {}) or {}).get("ar_seconds_per_token")
    ar_source = "measured with the profile, interleaved"
    if not s_per_token:
        s_per_token, ar_source = ar_seconds_per_token(result.records), "this run's live ar (wall minus prefill)"
    n = trace.num_prompts
    kept = kept_prompts(result, prompts)
    if not kept:
        raise ValueError("every prompt is flagged degenerate: nothing to replay")
    units, skipped = {}, {}
    for name, (controller, tree) in {**result.controllers, **(replay_only or {})}.items():
        if tree.width != trace.width:
            skipped[name] = f"tree width {tree.width} differs from the trace's {trace.width}"
            continue
        units[name] = _replay_units(trace, profile, controller, n)
    ar_tokens = np.asarray([trace.budget(i)[0] for i in range(n)], dtype=float)  # greedy: the same for all
    ar = {"tokens": ar_tokens, "time_s": ar_tokens * s_per_token, "logs": [[]] * n}
    live = {s["method"]: s for s in result.summary if s["temperature"] == 0.0}
    methods = []
    for name, u in units.items():
        c = _ratio(u, ar, kept, seed=seed)
        live_speedup = live.get(name, {}).get("speedup")
        tokens, time_s = u["tokens"][kept].sum(), u["time_s"][kept].sum()
        methods.append({"method": name, "speedup": c["ratio"], "speedup_ci": c["ci"],
                        "tau": float(tokens / max(1, sum(len(u["logs"][i]) for i in kept))),
                        "tokens_per_s": float(tokens / time_s),
                        "live_speedup": live_speedup, "live_speedup_ci": live.get(name, {}).get("speedup_ci"),
                        "gap": (c["ratio"] / live_speedup - 1.0) if live_speedup else None, "n_prompts": len(kept),
                        "decision_share": float(u["decision_s"][kept].sum() / time_s)})
    oracle = replay_oracle(trace, profile, prompts=kept)
    ar_tps = 1.0 / s_per_token
    decision_us = {q: 1e6 * t for q, t in profile.decision_charges(("skip", "stop", "size")).items()}
    return {"ar_seconds_per_token": s_per_token, "ar_source": ar_source, "n_prompts": len(kept),
            "n_degenerate_left_out": n - len(kept), "prompts_kept": kept, "profile": profile_info or {},
            "decision_us": decision_us,
            "methods": methods, "skipped": skipped, "replay_only": sorted(replay_only or {}),
            "comparisons": _replay_comparisons(units, kept, seed=seed, decide=decide),
            "groups": _replay_groups(units, prompts, kept, decide=decide, seed=seed),
            "oracle": {"speedup": oracle["oracle"]["tokens_per_s"] / ar_tps,
                       "greedy_oracle_speedup": oracle["greedy_oracle"]["tokens_per_s"] / ar_tps,
                       "best_static": {"depth": oracle["best_static"]["depth"], "size": oracle["best_static"]["size"],
                                       "speedup": oracle["best_static"]["tokens_per_s"] / ar_tps},
                       "per_prompt_static_speedup": oracle["per_prompt_static"]["tokens_per_s"] / ar_tps,
                       "share": {m["method"]: m["tokens_per_s"] / oracle["oracle"]["tokens_per_s"]
                                 for m in methods},
                       "gain_share": {m["method"]: gain_share(m["tokens_per_s"], oracle["oracle"]["tokens_per_s"],
                                                              ar_tps) for m in methods}}}


def gain_share(tokens_per_s: float, oracle_tokens_per_s: float, ar_tokens_per_s: float) -> float | None:
    """The share of the oracle's gain over AR a method captures: (speedup - 1) / (oracle speedup - 1), speedups
    over the same AR reference (0: no faster than AR, 1: as fast as the oracle, < 0: slower than AR); None when
    the oracle itself is no faster than AR (no gain to share). `share` beside it is the throughput ratio."""
    oracle_gain = oracle_tokens_per_s / ar_tokens_per_s - 1.0
    if not oracle_gain > 0:
        return None
    return (tokens_per_s / ar_tokens_per_s - 1.0) / oracle_gain


def kept_prompts(result, prompts: Sequence) -> list[int]:
    """Indices of `prompts` the verdicts keep: all but those whose target output `result.degeneracy` flags."""
    flagged = set((getattr(result, "degeneracy", None) or {}).get("flagged", []))
    return [i for i, p in enumerate(prompts) if getattr(p, "id", None) not in flagged]


def _replay_comparisons(units: dict, kept: Sequence[int], *, seed: int, decide: tuple[str, str]) -> list[dict]:
    speed = {m: float(u["tokens"][kept].sum() / u["time_s"][kept].sum()) for m, u in units.items()}
    heuristics = [h for h in HEURISTICS if h in units]
    best = max(heuristics, key=speed.get) if heuristics else None
    pairs: list[tuple[str, str]] = []
    for m, b in [decide] + [(m, b) for m in LEARNED for b in ("grid", best)]:
        if b is not None and m != b and m in units and b in units and (m, b) not in pairs:
            pairs.append((m, b))
    return [{"method": m, "baseline": b, "temperature": 0.0, **_ratio(units[m], units[b], kept, seed=seed)}
            for m, b in pairs]


def _replay_groups(units: dict, prompts: Sequence, kept: Sequence[int], *, decide: tuple[str, str],
                   seed: int) -> list[dict]:
    m, b = decide
    if m not in units or b not in units:
        return []
    keep = set(kept)
    groups = {key: [i for i in idx if i in keep] for key, idx in task_groups(prompts).items()}
    groups = {key: idx for key, idx in groups.items() if idx}
    return [{"task": task, "language": lang, "method": m, "baseline": b, "temperature": 0.0,
             **_ratio(units[m], units[b], idx, seed=seed), "n_prompts": len(idx),
             "too_small": len(idx) < MIN_PROMPTS_TO_CONCLUDE}
            for (task, lang), idx in sorted(groups.items())]
