"""Replay validation of controllers and policies: the score a training stage keeps its best checkpoint by.

Validation deciding through the inference code path: a policy under training becomes half of a `PPOController`,
replayed with `specpilot.envs.oracle.replay_controller` (the same `run_cycle` as `generate()`) on the trace of the
*validation* prompts. Speedups are over `replay_ar`: autoregressive timing measured beside the latency profile when
recorded, else the recording's (ar.json), else the profile's plain-step time.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from specpilot.drafting.control import Controller, DecisionLog, FixedController
from specpilot.envs.oracle import replay_controller
from specpilot.envs.replay import ReplayModel
from specpilot.policies.observation import ObservationSpec
from specpilot.artifacts.trace import read_ar


def replay_ar(model: ReplayModel, prompts: Sequence[int] | None = None) -> dict:
    """Autoregressive tokens/s for the trace's generations, `source` saying from what: "profile", AR generations
    timed between the latency profile's prompts (profile meta "ar_seconds_per_token": `record_traces` and the
    evaluation measure it so), which shares the machine's state with the profile that times the replay; else
    "live", the recording's own greedy generations (ar.json; minutes away from the profile: on a shared machine
    its shards differed by 2x); else "plain_steps", the profile's plain-step time (verification of the root
    alone) at each position's context length."""
    trace = model.trace
    indices = range(trace.num_prompts) if prompts is None else prompts
    tokens = sum(model.tables(i).n for i in indices)
    s_per_token = (getattr(model.profile, "meta", None) or {}).get("ar_seconds_per_token")
    source = "profile"
    if not s_per_token:
        ar = read_ar(trace.path) if trace.path is not None else None
        s_per_token, source = (float(ar["seconds_per_token"]), "live") if ar is not None else (None, "plain_steps")
    if s_per_token:
        return {"tokens": tokens, "time_s": tokens * float(s_per_token), "tokens_per_s": 1.0 / float(s_per_token),
                "source": source}
    time_s = float(sum(model.tables(i).verify[:, 0].sum() for i in indices))
    return {"tokens": tokens, "time_s": time_s, "tokens_per_s": tokens / time_s if time_s > 0 else float("nan"),
            "source": source}


def evaluate_replay(controller: Controller, model: ReplayModel, ar_tokens_per_s: float | None = None, *,
                    prompts: Sequence[int] | None = None) -> dict:
    """Replay throughput of `controller` on `model`'s trace (its `prompts`, default all) with depth/size tallies
    (and speedup vs AR)."""
    logged = DecisionLog(controller)
    res = replay_controller(model, controller=logged, prompts=None if prompts is None else list(prompts))
    depths, sizes = [d for d, _ in logged.log], [v for _, v in logged.log]
    res["depth_mean"] = float(np.mean(depths)) if depths else float("nan")
    res["size_mean"] = float(np.mean(sizes)) if sizes else float("nan")
    res["depth_hist"] = np.bincount(depths, minlength=model.trace.max_depth + 1).tolist()
    if ar_tokens_per_s:
        res["speedup"] = res["tokens_per_s"] / ar_tokens_per_s
    return res


def evaluate_batches(controller: Controller, model: ReplayModel, batch_sizes: Sequence[int],
                     ar: dict[int, float] | None = None) -> dict:
    """Batch-replay tokens/s of `controller` at each batch size (`envs.batch_replay.replay_batch`) and its speedup
    over batched AR at that size; `score` is the geometric mean of those speedups (every size weighs the same,
    though large batches produce more tokens). `ar`: batched AR tokens/s per size (computed when None)."""
    from specpilot.envs.batch_replay import BatchTimes, replay_batch

    times = BatchTimes(model)
    ar = ar or {int(b): replay_batch(model, FixedController(0, 0), batch_size=int(b), times=times)["tokens_per_s"]
                for b in batch_sizes}
    per = {}
    for b in batch_sizes:
        res = replay_batch(model, controller, batch_size=int(b), times=times)
        per[int(b)] = {"tokens_per_s": res["tokens_per_s"], "speedup": res["tokens_per_s"] / ar[int(b)]}
    score = float(np.exp(np.mean([np.log(r["speedup"]) for r in per.values()])))
    return {"score": score, "per_batch_size": per, "ar": ar}


def batch_guard(learned: Controller, table: dict[int, tuple[int, int]], model: ReplayModel,
                batch_sizes: Sequence[int], *, exhaustive_up_to: int = 6) -> dict:
    """The validation guard of a batch-aware policy: which batch sizes the per-batch-size table
    (`BatchTableController(table)`) should decide at, so that the guarded controller (`BatchGuardController`) is
    never below the table at any of `batch_sizes` in batch replay of `model` (the VALIDATION trace: selection never
    sees the held-out one), and otherwise as fast as it can be.

    The guard decides per cycle by the rows still running, so a batch of 4 spends its tail at 3, 2, 1 rows: the
    sizes interact, and the guard is chosen on the guarded controller's own replay, not per size in isolation. Among
    the fallback sets (every subset of the table's keys while there are at most `exhaustive_up_to`, else greedily
    grown from the sizes where learned alone loses, adding the worst size until none loses), the kept one is never
    below the table at any size (the full set is the table itself, so one always qualifies) and has the highest
    geometric-mean ratio to the table; ties keep the smaller set (the learned policy where it is as good).
    The table gets a key at every batch size in `batch_sizes` (its own lookup there). Returns {"table": {B: [d, V]},
    "fallback": [B...], "per_batch_size": {B: {learned, table, guarded, ratio}}, "candidates": n} (ratio: guarded /
    table; `BatchGuardController.from_dict` reads it)."""
    from itertools import combinations

    from specpilot.envs.batch_replay import BatchTimes, replay_batch
    from specpilot.policies.heuristics import BatchGuardController, BatchTableController

    base = BatchTableController(table)
    sizes = sorted({int(b) for b in batch_sizes})
    full = {b: base.lookup(b) for b in sorted(set(sizes) | {int(b) for b in table})}
    keys = sorted(full)
    times = BatchTimes(model)
    speed = lambda ctrl, b: replay_batch(model, ctrl, batch_size=b, times=times)["tokens_per_s"]  # noqa: E731
    ref = {b: speed(base, b) for b in sizes}
    alone = {b: speed(learned, b) for b in sizes}

    scored: dict[tuple, tuple[bool, float, dict]] = {}  # the greedy path's sets are scored again below: once each

    def evaluate(fallback) -> tuple[bool, float, dict]:
        key = tuple(sorted(fallback))
        if key not in scored:
            guarded = BatchGuardController(learned, full, fallback)
            got = {b: speed(guarded, b) for b in sizes}
            ok = all(got[b] >= ref[b] * (1 - 1e-9) for b in sizes)
            scored[key] = ok, float(np.exp(np.mean([np.log(got[b] / ref[b]) for b in sizes]))), got
        return scored[key]

    if len(keys) <= exhaustive_up_to:
        subsets = [list(c) for n in range(len(keys) + 1) for c in combinations(keys, n)]
    else:
        subsets, fallback = [], [b for b in sizes if alone[b] < ref[b]]
        while True:
            subsets.append(sorted(fallback))
            ok, _, got = evaluate(fallback)
            if ok or len(fallback) == len(keys):
                break
            worst = min((b for b in sizes if b not in fallback), key=lambda b: got[b] / ref[b], default=None)
            fallback = fallback + [worst] if worst is not None else keys
    best = None
    for fallback in subsets:   # smaller sets first: a tie keeps the smaller
        ok, score, got = evaluate(fallback)
        if ok and (best is None or score > best[0] + 1e-12):
            best = (score, fallback, got)
    _, fallback, got = best
    per = {str(b): {"learned": alone[b], "table": ref[b], "guarded": got[b], "ratio": got[b] / ref[b]}
           for b in sizes}
    return {"table": {str(b): list(full[b]) for b in keys}, "fallback": list(fallback), "per_batch_size": per,
            "candidates": len(subsets)}


def write_batch_guard(run_dir: str | Path, learned: Controller, table: dict[int, tuple[int, int]],
                      val_trace, batch_sizes: Sequence[int], *, profile=None) -> dict:
    """`batch_guard` on the validation trace (timed by `profile`), saved as RUN/batch_guard.json: from then on
    `load_run_controllers(RUN)["ltd_guarded"]` is the guarded controller and the export's learned per-batch-size
    table is its table."""
    from specpilot.artifacts.common import save_object
    from specpilot.policies.ppo import BATCH_GUARD_FILE, BATCH_GUARD_VERSION

    guard = batch_guard(learned, table, ReplayModel(val_trace, profile), batch_sizes)
    guard["validation_trace"] = str(val_trace)
    save_object(Path(run_dir) / BATCH_GUARD_FILE, guard, version=BATCH_GUARD_VERSION, indent=1)
    return guard


def validation_fn(val_trace: str | Path, *, kind: str, spec: ObservationSpec, partner: Controller,
                  size_actions: Sequence[int] | None = None, logger=None, stage: str = "stage",
                  batch_sizes: Sequence[int] | None = None, profile=None) -> Callable[[Any], float]:
    """val_fn(model) -> replay tokens/s on the validation trace, deciding exactly as inference does.

    The model's policy becomes the `kind` half of a PPOController; `partner` decides the other half (a fixed
    config, a RandomDepthController, or a frozen PPOController). Metrics go to `logger` under <stage>/val/ at the
    model's step count, or at `step` when given (a stage's starting policy: the stage's step 0).
    With `batch_sizes` (a batch-aware policy) the score is `evaluate_batches`' geometric mean speedup over batched
    AR across those sizes, in batch replay timed by `profile` (None: the trace's).
    """
    from specpilot.policies.ppo import PPOController

    model_r = ReplayModel(val_trace, profile)
    calls = {"n": 0}
    if batch_sizes:
        batch_ar = evaluate_batches(FixedController(0, 0), model_r, batch_sizes)["ar"]

        def score(ctrl) -> tuple[float, dict]:
            res = evaluate_batches(ctrl, model_r, batch_sizes, batch_ar)
            return res["score"], {"batch_score": res["score"],
                                  **{f"speedup_b{b}": r["speedup"] for b, r in res["per_batch_size"].items()}}
    else:
        ar = replay_ar(model_r)

        def score(ctrl) -> tuple[float, dict]:
            res = evaluate_replay(ctrl, model_r, ar["tokens_per_s"])
            return float(res["tokens_per_s"]), {key: res[key] for key in ("tokens_per_s", "speedup",
                                                                           "mean_accepted_length", "depth_mean",
                                                                           "size_mean")}

    def val(model, *, step: int | None = None) -> float:
        policy = model.policy if hasattr(model, "policy") else model
        if kind == "size":
            ctrl = PPOController(None, policy, size_spec=spec, size_actions=list(size_actions), fallback=partner)
        else:
            ctrl = PPOController(policy, None, depth_spec=spec, fallback=partner)
        seed = getattr(partner, "seed", None)
        if callable(seed):
            seed(1234)  # the same partner draws at every validation
        value, logged = score(ctrl)
        calls["n"] += 1
        if logger is not None:
            if step is None:  # a policy under training: its own step count
                step = int(getattr(model, "num_timesteps", calls["n"]))
            logger.log({f"{stage}/val/{key}": v for key, v in logged.items()}, step=step)
        return value

    return val
