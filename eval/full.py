"""`full_evaluation()`: live rounds, exact replay beside them and the cost-model check, in one call and one report.

Steps, in order (each says what it costs in the run's log through `progress`):
1. record (or reuse) the greedy trace of the evaluated prompts (`replay_eval.heldout_trace`);
2. re-measure the latency profile on the first `profile_prompts` of them, interleaved prompt by prompt with the
   autoregressive decode time that replay speedups are relative to (`measure_with_ar`): replay in this run uses
   a cost model of the machine as it is now;
3. the live evaluation (`evaluate`, adaptive rounds within what is left of `time_budget_s`, on every worker of the
   executor);
4. replay of every evaluated controller over the trace with the fresh profile (`replay_eval.replay_evaluation`);
5. the cost-model check without extra generations (`costcheck.check_records`): the fresh profile and every
   profile in `check_profiles` (e.g. the one behind the grid search and training) predict the live runs of the
   fixed-config methods; a stale one is named in the log and the report;
6. `write_report` into `out_dir`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specpilot.artifacts.contract import check_profile_belongs
from specpilot.artifacts.profile import DEFAULT_PROFILE_CYCLES
from specpilot.artifacts.profile import profile_path as profile_file
from specpilot.artifacts.trace import is_trace
from specpilot.drafting.executor import Executor, ShardTask, as_executor
from specpilot.drafting.folder_lock import holds_output
from specpilot.drafting.stopping import stopping_options
from specpilot.drafting.types import TreeConfig
from specpilot.eval.compare import DECIDE, flag_replay_outside
from specpilot.eval.costcheck import check_records, profile_age_s
from specpilot.eval.methods import EvalContext, replay_controllers
from specpilot.eval.replay_eval import record_on_workers
from specpilot.eval.report import write_report
from specpilot.eval.runner import EvalResult, evaluate
from specpilot.eval.suites import Prompt
from specpilot.policies import FixedController

REPORT_RESERVE_S = 15.0  # seconds kept from the budget for replay, the checks and the report


@holds_output("out_dir", what="report folder")
def full_evaluation(prompts: Sequence[Prompt], *, pair=None, executor: Executor | None = None, tree: TreeConfig,
                    out_dir: str | Path, trace_dir: str | Path | None = None,
                    check_profiles: dict[str, str | Path] | None = None, replay: bool = True,
                    profile_prompts: int = 6, profile_cycles: int = DEFAULT_PROFILE_CYCLES,
                    time_budget_s: float | None = None, rounds: int | str = "auto",
                    full_rounds: int | None = 1, temperatures=(0.0,), max_new_tokens: int = 96,
                    grid: str | Path | None = None, run_dir: str | Path | None = None,
                    methods: list[str] | None = None, sampled_methods: list[str] | None = None, seed: int = 0,
                    tolerance: float = 0.25, prior_checks: dict[str, dict] | None = None, plots: bool = True,
                    progress: Callable[[str], None] | None = None, suite: dict | None = None,
                    replay_only: Sequence[str] = (), trace_workers=None,
                    **evaluate_kwargs) -> tuple[EvalResult, dict]:
    """Run the steps of the module docstring on `pair` in this process or on `executor` (steps 1-2 on its first
    worker, step 3 on all: `evaluate`); return (the EvalResult with replay and cost_check set, report paths).
    `trace_dir`: where the trace and the fresh profile are kept (None: not saved; with an executor it must be
    reachable from the workers); `check_profiles`: {title: profile.json path} of profiles to check against this
    run's live runs; `prior_checks`: {title: `costcheck.check_and_refresh` result} of earlier checks (e.g. before
    the grid search), reported first; `suite`: {"name", "chosen_by"} of the prompts, named in the report;
    `replay_only`: controller methods evaluated in replay only (step 4, no live runs: exact and nearly free; leave
    them out of `methods`); `trace_workers`: processes that record step 1's trace side by side into `trace_dir`
    when it holds none (`replay_eval.record_on_workers`; the profile of step 2 is still measured alone);
    `evaluate_kwargs`: the other settings of `evaluate` (top_k, decide, ...)."""
    say = progress or (lambda msg: None)
    started = time.perf_counter()
    prompts = list(prompts)
    ending = stopping_options(evaluate_kwargs.get("stop_strings"), evaluate_kwargs.get("stop_token_ids"),
                              evaluate_kwargs.get("ignore_eos", False))  # a bare id 0 or an array counts as given
    if replay and ending:
        raise ValueError(f"replay cannot apply {', '.join(ending)}: its traces are greedy decodings to the model's end "
                         "token or the budget; evaluate live only (replay=False, no --replay-dir)")
    executor = as_executor(pair, executor)
    trace = profile = lookup = None
    if replay and trace_workers is not None and trace_dir is not None and not is_trace(trace_dir):
        t0 = time.perf_counter()
        record_on_workers(trace_workers, tree, [p.prompt for p in prompts], trace_dir, max_new_tokens=max_new_tokens)
        say(f"greedy trace of {len(prompts)} prompts on {len(trace_workers)} processes side by side "
            f"({time.perf_counter() - t0:.0f}s)")
    if replay:
        task = ShardTask(0, dict(texts=[p.prompt for p in prompts], tree=tree, trace_dir=trace_dir,
                                 max_new_tokens=max_new_tokens, profile_prompts=profile_prompts,
                                 profile_cycles=profile_cycles, seed=seed))
        ids, trace, profile = executor.map(replay_inputs, [task], progress=say)[0].result
        lookup = dict(zip(task.payload["texts"], ids))  # the evaluated token ids are the trace's
        for title, path in (check_profiles or {}).items():  # refused before the live rounds, not reported as stale
            check_profile_belongs(trace, path, given=f"--check-profile {path}" if str(title) == str(path)
                                  else f"{title} ({path})",
                                  fix="check a profile measured with this pair, dtype and tree (a run's "
                                  "traces/train/profile.json), or drop it")
    budget = None if time_budget_s is None else max(0.0, time_budget_s - (time.perf_counter() - started)
                                                    - REPORT_RESERVE_S)
    result = evaluate(prompts, executor=executor, methods=methods, temperatures=tuple(temperatures),
                      max_new_tokens=max_new_tokens, rounds=rounds, full_rounds=full_rounds, time_budget_s=budget,
                      tree=tree, grid=grid, run_dir=run_dir, seed=seed,
                      encode=lookup.__getitem__ if lookup else None, progress=say, sampled_methods=sampled_methods,
                      suite=suite,
                      **evaluate_kwargs)
    if replay:
        extra, skipped = {}, {}
        if replay_only:
            ctx = EvalContext(pair=None, tree=tree, grid=grid, run_dir=run_dir, device_name=str(executor.device))
            extra, skipped = replay_controllers(list(replay_only), ctx)
            result.meta["skipped"].update({n: f"replay only: {why}" for n, why in skipped.items()})
        attach_replay(result, trace, profile, prompts, profile_path=profile_file(trace_dir)
                      if trace_dir else None, check_profiles=check_profiles, tolerance=tolerance, seed=seed,
                      progress=say, replay_only=extra, decide=tuple(evaluate_kwargs.get("decide") or DECIDE))
    if prior_checks:
        result.cost_check = {**prior_entries(prior_checks), **(result.cost_check or {})}
    paths = write_report(result.results, result.meta, out_dir, plots=plots, analysis=result.analysis())
    return result, paths


def replay_inputs(worker, *, texts: list[str], tree: TreeConfig, trace_dir, max_new_tokens: int,
                  profile_prompts: int, seed: int, profile_cycles: int = DEFAULT_PROFILE_CYCLES
                  ) -> tuple[list[list[int]], object, object]:
    """The work unit of steps 1 and 2: (token ids of `texts`, their trace, the re-measured profile)."""
    ids = [worker.pair.encode(t) for t in texts]
    trace, profile = prepare_replay(worker.pair, tree, ids, trace_dir, max_new_tokens=max_new_tokens,
                                    profile_prompts=profile_prompts, profile_cycles=profile_cycles, seed=seed,
                                    progress=worker.say)
    return ids, trace, profile


def prior_entries(checks: dict[str, dict]) -> dict[str, dict]:
    """Report entries of `check_and_refresh` results: the check, and the re-check after a refresh."""
    out = {}
    for title, check in checks.items():
        before = {**check["before"], "title": title}
        if check.get("refreshed"):
            before["action"] = "re-measured (run log says so); the grid search and training used the new profile"
            out[f"{title} (re-measured)"] = {**check["after"], "title": f"{title}, after re-measuring"}
        out = {title: before, **out}
    return out


def attach_replay(result: EvalResult, trace, profile, prompts: Sequence[Prompt], *,
                  profile_path: Path | None = None, check_profiles: dict[str, str | Path] | None = None,
                  tolerance: float = 0.25, seed: int = 0, progress: Callable[[str], None] | None = None,
                  replay_only: dict | None = None, decide: tuple[str, str] = DECIDE) -> None:
    """Steps 4 and 5: set `result.replay` and `result.cost_check` (or say in meta["skipped"] why not: replay
    needs greedy runs and the trace's prompts to be the evaluated token ids). `replay_only`: {name: (controller,
    tree)} replayed beside the live methods (the cost-model check uses live runs only); `decide`: the deciding
    pair, compared in replay as live."""
    say = progress or (lambda msg: None)
    if result.meta.get("prompts_truncated"):
        result.meta["skipped"]["replay"] = "prompts were truncated to fit the context: the trace does not match"
        return
    if not any(r.temperature == 0.0 for r in result.records):
        result.meta["skipped"]["replay"] = "no greedy (T=0) runs: replay is exact for greedy decoding only"
        return
    from specpilot.eval.replay_eval import kept_prompts, replay_evaluation

    t0 = time.perf_counter()
    info = _profile_info(profile, profile_path, "re-measured for this evaluation")
    if kept_prompts(result, prompts):
        result.replay = replay_evaluation(result, trace, profile, prompts=prompts, seed=seed, profile_info=info,
                                          replay_only=replay_only, decide=decide)
        flag_replay_outside(result.comparisons or [], result.replay.get("comparisons") or [])
    else:  # as the live verdicts: speed on degenerate text is no verdict
        result.meta["skipped"]["replay"] = "the target's greedy output is degenerate on every prompt"
    result.cost_check = _cost_checks(result, trace, profile, prompts, check_profiles or {}, tolerance, say)
    say(f"replay and cost-model check done ({time.perf_counter() - t0:.0f}s)")


def prepare_replay(pair, tree: TreeConfig, ids: list[list[int]], trace_dir: str | Path | None, *,
                   max_new_tokens: int, profile_prompts: int = 6, profile_cycles: int = DEFAULT_PROFILE_CYCLES,
                   seed: int = 0, progress: Callable[[str], None] | None = None):
    """Steps 1 and 2: (trace of `ids`, latency profile re-measured now on the first `profile_prompts`, at least
    `profile_cycles` cycles)."""
    from specpilot.eval.replay_eval import heldout_trace

    t0 = time.perf_counter()
    before = _created(trace_dir)
    trace = heldout_trace(pair, tree, ids, trace_dir, max_new_tokens=max_new_tokens)
    t1 = time.perf_counter()
    how = "reused" if before is not None and trace.header.get("created") == before else f"{t1 - t0:.0f}s"
    profile = measure_with_ar(pair, tree, ids[: max(1, profile_prompts)], max_new_tokens=max_new_tokens, seed=seed,
                              min_cycles=profile_cycles)
    if trace_dir is not None:
        profile.save(profile_file(trace_dir))
    say = progress or (lambda msg: None)
    say(f"greedy trace of {len(ids)} prompts ({how}), latency profile re-measured on "
        f"{min(len(ids), max(1, profile_prompts))} of them ({time.perf_counter() - t1:.0f}s)")
    return trace, profile


def _created(trace_dir: str | Path | None) -> str | None:
    """When the trace in trace_dir was recorded (its header's "created"), None when there is none readable."""
    from specpilot.artifacts.trace import TraceHeader

    if trace_dir is None or not is_trace(trace_dir):
        return None
    try:
        return TraceHeader.load(trace_dir).data.get("created")
    except (OSError, ValueError):
        return None


def measure_with_ar(pair, tree: TreeConfig, ids: list[list[int]], *, max_new_tokens: int, seed: int = 0,
                    min_cycles: int = 0):
    """A latency profile of `ids` (random configs) with the autoregressive decode time measured interleaved with
    it, prompt by prompt, into meta["ar_seconds_per_token"] (`envs.profile.collect_samples_with_ar`): the reference
    of replay speedups shares the machine's state with the profile, so load changes cancel in the ratio. The profile
    keeps at least `min_cycles` cycles."""
    from specpilot.envs.profile import measure_profile

    profile = measure_profile(pair, tree, ids, max_new_tokens=max_new_tokens, seed=seed, min_cycles=min_cycles,
                              ar=True)
    profile.meta["pair"] = pair.identity()
    return profile


def _profile_info(profile, path: Path | None, source: str) -> dict:
    age, created = profile_age_s(profile, path)
    return {"source": source, "created": created, "age_s": age, "path": str(path) if path else None}


def _fixed_configs(result: EvalResult, width: int) -> dict[str, tuple[int, int]]:
    """Methods whose controller is a static config on the trace's width: name -> (depth, size)."""
    return {name: (c.depth, c.size) for name, (c, tree) in result.controllers.items()
            if isinstance(c, FixedController) and tree.width == width}


def _cost_checks(result: EvalResult, trace, fresh, prompts: Sequence[Prompt], others: dict[str, str | Path],
                 tolerance: float, say: Callable[[str], None]) -> dict:
    from specpilot.envs.profile import LatencyProfile

    configs = _fixed_configs(result, trace.width)
    index = {p.id: i for i, p in enumerate(prompts)}
    out = {}
    candidates = [("fresh", "profile re-measured for this evaluation", fresh, None)]
    for title, path in others.items():
        if Path(path).is_file():
            candidates.append((title, f"profile behind {title}", LatencyProfile.load(path), Path(path)))
    for key, title, profile, path in candidates:
        check = check_records(trace, profile, result.records, configs, index, tolerance=tolerance)
        check["age_s"], check["created"] = profile_age_s(profile, path)
        check["title"] = title
        if key != "fresh" and check["stale"]:
            check["action"] = ("decisions trained or searched on it rest on a stale cost model; the replay here "
                               "uses the re-measured profile")
            say(f"cost model: the {title} is STALE at evaluation time (max error "
                f"{100 * check['max_abs_error']:.0f}% vs live)")
        out[key] = check
    return out
