"""`evaluate()`: run every method on the same prompts in interleaved rounds, and aggregate rows for the report.

Protocol (what makes the numbers comparable; the loop itself is `specpilot.eval.rounds`):
- every method gets the same token ids, the same max_new_tokens, sampling parameters, ending options (stop strings,
  stop token ids, ignore_eos) and per-unit seed (a unit is one (prompt, round)); `ar` (our autoregressive baseline
  on the same caches and clock) is always run, as the speedup reference;
- warm-up generations of every method before anything is timed;
- per prompt and round, all methods run back to back in the order of a Williams design (`rounds.method_order`:
  every method in every position and right after every other method equally often), so drift in machine load,
  clock frequency or carry-over from the previous method hits every method alike;
- wall time of each call is measured around the call, identically for all methods (perf_counter after device
  synchronisation); the decoder's own draft/verify/policy times only split that time;
- every speedup is a pooled ratio over units paired with `ar`'s runs of the same units, with a 95% paired
  bootstrap interval (`specpilot.eval.stats`); method pairs are compared the same way (`specpilot.eval.compare`);
- rounds: a fixed number, or "auto": more rounds until the deciding comparison (ltd vs grid) is resolved to
  +-1.5% or the time budget is spent (never fewer than `min_rounds`);
- at temperature 0 every method's tokens are compared with `ar`'s (identical_to_ar); sampled runs are not
  comparable token for token (None);
- `concurrency` N > 1 additionally runs N streams at once (threads sharing the models and the device) and reports
  the same metrics under that load. On CPU the streams share the cores, so this measures contention, not batching.

Methods come from a registry: name -> factory(ctx) returning a callable method; callers may add any Controllers
by name (`controllers=`), measured by the same loop. Methods whose requirements are missing (no --run for
trained policies, no --grid result, module not built) are skipped with a note.
"""
from __future__ import annotations

import copy
import datetime
import platform
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specpilot.drafting.checks import prompt_room
from specpilot.drafting.executor import (Executor, ShardOutcome, ShardTask, as_executor, assign_groups,
                                         shard_report)
from specpilot.drafting.linear_kernels import describe as describe_small_rows
from specpilot.drafting.pair import ModelPair
from specpilot.drafting.stopping import check_stop_token_ids, request_ending, stopping_options
from specpilot.drafting.types import TreeConfig
from specpilot.eval.degeneracy import degeneracy_report, greedy_outputs, measure
from specpilot.eval.compare import DECIDE, compare, comparisons, decision_stats, group_comparisons, unit_records
from specpilot.eval.metrics import RunRecord, aggregate, pooled_tau
from specpilot.eval.stats import paired_ratio_interval, same_decisions
from specpilot.eval.rounds import Measurer, MemoryMonitor, RoundPlan, method_order, run_rounds, timed
from specpilot.eval.methods import (METHODS, ARMethod, ControllerMethod, EvalContext, Method,  # noqa: F401
                                    MethodUnavailable, build_methods)
from specpilot.eval.suites import Prompt, prompt_mix
from specpilot.drafting.control import Controller


# ---- the evaluation ------------------------------------------------------------------------------------------
@dataclass
class EvalResult:
    """results: report rows; meta: what was measured, how; records: every timed run.

    comparisons / groups / decisions / summary: the paired analysis of the records (`specpilot.eval.compare`);
    replay / cost_check: set by `specpilot.eval.replay_eval.replay_evaluation` and `specpilot.eval.costcheck`
    when a caller runs them; degeneracy: the target's greedy output per prompt measured and flagged
    (`specpilot.eval.degeneracy`): flagged prompts are left out of summary and comparisons and analysed apart
    in its "summary" / "comparisons"; controllers: name -> (fresh copy of the method's Controller, its
    TreeConfig), so the same decisions can be replayed offline."""

    results: list[dict]
    meta: dict
    records: list[RunRecord]
    comparisons: list[dict] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)
    decisions: dict = field(default_factory=dict)
    summary: list[dict] = field(default_factory=list)
    replay: dict | None = None
    cost_check: dict | None = None
    degeneracy: dict | None = None
    controllers: dict = field(default_factory=dict, repr=False)

    def analysis(self) -> dict:
        """What `write_report(..., analysis=)` prints beside the rows."""
        return {"summary": self.summary, "comparisons": self.comparisons, "groups": self.groups,
                "decisions": self.decisions, "replay": self.replay, "cost_check": self.cost_check,
                "degeneracy": self.degeneracy}


def _encode_all(prompts: list[Prompt], encode: Callable[[str], list[int]], limit: int) -> tuple[list[list[int]], int]:
    """Token ids per prompt, keeping the last `limit` tokens (the end of a prompt is what the model continues)."""
    out, truncated = [], 0
    for p in prompts:
        ids = list(encode(p.prompt))
        if not ids:
            raise ValueError(f"prompt {p.id!r} encodes to no tokens")
        if len(ids) > limit:
            ids, truncated = ids[-limit:], truncated + 1
        out.append(ids)
    return out, truncated


def _build(ctx: EvalContext, methods: list[str] | None, controllers: dict[str, Controller] | None
           ) -> tuple[dict[str, Method], dict[str, str], dict[str, Callable[[], Method]]]:
    """(built methods incl. `ar`, skipped {name: reason}, factories of fresh instances for concurrent streams).
    Without `methods`: every registered method, or only `controllers` (plus `ar`) when those are given."""
    names = list(methods) if methods is not None else ([] if controllers else list(METHODS))
    clash = sorted(set(controllers or {}) & (set(names) | {"ar"}))
    if clash:
        raise ValueError(f"controller name(s) {', '.join(clash)} clash with method names; rename them")
    built, skipped = build_methods(names, ctx)
    factories: dict[str, Callable[[], Method]] = {n: (lambda n=n: METHODS[n](ctx, n)) for n in built}
    for name, entry in (controllers or {}).items():
        controller, tree = entry if isinstance(entry, tuple) else (entry, ctx.tree)  # (controller, its own tree)
        if not isinstance(controller, Controller):
            raise TypeError(f"controllers[{name!r}] is a {type(controller).__name__}, not a "
                            "specpilot.policies.Controller")
        built[name] = ControllerMethod(name, ctx.pair, tree, controller)
        factories[name] = lambda n=name, c=controller, t=tree: ControllerMethod(n, ctx.pair, t, copy.deepcopy(c))
    return built, skipped, factories


def measure_controllers(pair: ModelPair | None, controllers: dict, prompts, *, tree: TreeConfig,
                        max_new_tokens: int = 64, repeats: int = 1, warmup: int = 1, seed: int = 0,
                        temperature: float = 0.0, progress: bool = False, baseline: str = "ar",
                        also_vs: Sequence[str] = (), executor: Executor | None = None) -> dict[str, dict]:
    """Live throughput (at `temperature`, greedy by default) of each controller (a Controller, or a (Controller, TreeConfig) pair) and of `ar` on
    `prompts` (strings or token-id lists), measured by `evaluate`'s interleaved rounds and clock: the grid search's
    live re-measure and training-time live evaluation use this, so their numbers are the report's quantity.
    Returns {name: {tokens, time_s, tokens_per_s, speedup, mean_accepted_length, policy_s, policy_overhead,
    depth_mean, size_mean, vs_baseline}}: vs_baseline is the throughput ratio over `baseline` ("ar" or one of the
    controllers) with its paired 95% bootstrap interval over (prompt, round) units; `vs` the same against each of
    `baseline` and `also_vs` ({name: {"baseline", "ratio", "ci", "same_decisions"}}; same_decisions: both chose the
    same (depth, size) on every cycle of every unit, `eval.stats.same_decisions`). With `executor` (instead of
    `pair`) the prompts are shared out over its workers and the numbers pooled over all their units."""
    items = [getattr(p, "prompt", p) for p in prompts]
    if not items:
        raise ValueError("measure_controllers needs at least one prompt")
    suite = [Prompt(id=f"p{i}", task="live", language="-", split="validation", prompt=p) for i, p in enumerate(items)]
    result = evaluate(suite, pair=pair, executor=executor, methods=[], controllers=controllers,
                      temperatures=(float(temperature),), max_new_tokens=max_new_tokens, rounds=repeats,
                      warmup=warmup, tree=tree, seed=seed, by_group=False,
                      progress=(lambda msg: print(f"  live: {msg}", flush=True)) if progress else None)
    if result.meta.get("skipped"):
        raise RuntimeError(f"live measurement failed: {result.meta['skipped']}")
    names = ["ar", *controllers]
    for b in (baseline, *also_vs):
        if b not in names:
            raise ValueError(f"baseline {b!r} is neither 'ar' nor one of the controllers {list(controllers)}")
    out = {name: _throughput([r for r in result.records if r.method == name]) for name in names}
    units = {name: {(r.repeat, r.prompt_id): r for r in result.records if r.method == name} for name in names}
    for name, row in out.items():
        row["speedup"] = row["tokens_per_s"] / out["ar"]["tokens_per_s"]
        row["vs"] = {}
        for other in dict.fromkeys((baseline, *also_vs)):
            keys = sorted(units[name].keys() & units[other].keys())  # the (round, prompt) units both ran
            a, b = [units[name][k] for k in keys], [units[other][k] for k in keys]
            ci = paired_ratio_interval([r.n_tokens for r in a], [r.wall_s for r in a],
                                       [r.n_tokens for r in b], [r.wall_s for r in b])
            row["vs"][other] = {"baseline": other, "ratio": ci.ratio, "ci": ci.ci(),
                                "same_decisions": same_decisions([r.cycles for r in a], [r.cycles for r in b])}
        row["vs_baseline"] = row["vs"][baseline]
    return out


def _throughput(recs: list[RunRecord]) -> dict:
    tokens, time_s = sum(r.n_tokens for r in recs), sum(r.wall_s for r in recs)
    cycles = [c for r in recs for c in r.cycles]
    policy_s = sum(r.policy_s for r in recs)
    return {"tokens": tokens, "time_s": time_s, "tokens_per_s": tokens / time_s if time_s > 0 else float("nan"),
            "cycles": len(cycles) if cycles else tokens,  # autoregressive decoding: one target step per token
            "mean_accepted_length": tokens / len(cycles) if cycles else 1.0, "policy_s": policy_s,
            "policy_overhead": policy_s / time_s if time_s > 0 else float("nan"),
            "depth_mean": sum(c[0] for c in cycles) / len(cycles) if cycles else None,
            "size_mean": sum(c[1] for c in cycles) / len(cycles) if cycles else None}


def evaluate(prompts: list[Prompt], *, pair: ModelPair | None = None, executor: Executor | None = None,
             methods: list[str] | None = None, controllers: dict[str, Controller] | None = None,
             temperatures: tuple[float, ...] = (0.0, 1.0), top_k: int = 0, top_p: float = 1.0,
             max_new_tokens: int = 128, rounds: int | str = 1, min_rounds: int = 2, max_rounds: int = 20,
             time_budget_s: float | None = None, target_half_width: float = 0.015,
             decide: tuple[str, str] = DECIDE, full_rounds: int | None = None, repeats: int | None = None,
             sampled_min_rounds: int | None = None,
             warmup: int = 1, concurrency: int = 1, tree: TreeConfig | None = None,
             grid: str | Path | None = None, run_dir: str | Path | None = None, seed: int = 0,
             encode: Callable[[str], list[int]] | None = None, progress: Callable[[str], None] | None = None,
             sampled_methods: list[str] | None = None, by_group: bool = True,
             suite: dict | None = None, stop_strings: Sequence[str] | None = None,
             stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False) -> EvalResult:
    """Evaluate `methods` (default: every registered one that is available) and `controllers` (any Controllers,
    by name, on the evaluation `tree`) on `prompts` with the interleaved rounds of `specpilot.eval.rounds`.

    pair: run in this process; executor: run on its workers (`specpilot.drafting.executor`, e.g. a Ray
    WorkerPool), each measuring its share of the prompts (whole (task, language) groups when by_group, so each
    report row is measured on one device; else single prompts) with every method interleaved there, its own
    rounds and the whole time budget; the rows and the paired analysis are computed here on all records, the
    same way for one worker or many. Paths (grid, run_dir) must exist where the workers run.
    rounds: an int (exactly that many rounds) or "auto" (min_rounds .. max_rounds: stop once the `decide`
    comparison's 95% interval has a half-width <= target_half_width, the pair made the same decisions on every
    unit, or `time_budget_s` (the whole call's budget) would not fit another round); full_rounds: rounds in
    which every method runs, later rounds run `ar` and the `decide` pair (None: all rounds); sampled_min_rounds:
    min_rounds at temperatures > 0 (None: min_rounds); repeats: the old name of a fixed `rounds`.
    sampled_methods: the methods run at temperatures > 0 (default: all; `ar` always runs, it is the reference).
    stop_strings, stop_token_ids, ignore_eos: where every method's generations end, as `generate()` takes them
    (a code-completion suite stopped at "\ndef ", or vLLM's ignore_eos for full budgets); each method gets the same.
    Returns rows (task x language x method x temperature x concurrency, each speedup with its paired interval,
    tagged with the worker and device that measured it), the paired analysis, a meta block (meta["workers"],
    meta["executor"]: which worker ran which prompts) and the raw records."""
    if not prompts or warmup < 0 or concurrency < 1:
        raise ValueError("need prompts, concurrency >= 1 and warmup >= 0" if prompts else "no prompts to evaluate")
    plan = RoundPlan.make(repeats if repeats is not None else rounds, min_rounds=min_rounds, max_rounds=max_rounds,
                          time_budget_s=time_budget_s, target_half_width=target_half_width, decide=tuple(decide),
                          full_rounds=full_rounds, sampled_min_rounds=sampled_min_rounds)
    stopping = stopping_options(stop_strings, stop_token_ids, ignore_eos)
    executor = as_executor(pair, executor)
    if executor is None:
        raise ValueError("evaluate needs pair= (run in this process) or executor= (e.g. a Ray WorkerPool)")
    # the id range here, from the workers' pair: on Ray a worker raising it would be retried as a failed shard
    check_stop_token_ids(stopping.get("stop_token_ids"), executor.workers[0]["pair"]["vocab_size"])
    settings = dict(methods=methods, controllers=controllers, temperatures=tuple(temperatures), top_k=top_k,
                    top_p=top_p, max_new_tokens=max_new_tokens, plan=plan, warmup=warmup, concurrency=concurrency,
                    tree=tree or TreeConfig(), grid=grid, run_dir=run_dir, seed=seed, encode=encode,
                    sampled_methods=sampled_methods, stopping=stopping)
    shares = [idx for idx in assign_groups(prompts, len(executor), by_group=by_group) if idx]
    tasks = [ShardTask(i, {"prompts": [prompts[j] for j in idx], **settings}, idx) for i, idx in enumerate(shares)]
    outcomes = executor.map(measure_rounds, tasks, progress=progress)
    result = _merge(prompts, tasks, outcomes, temperatures, plan.decide, seed, by_group)
    if suite is not None:  # {"name", "chosen_by"} (`specpilot.eval.suites.choose_suite`): the report names it
        result.meta["suite"] = suite
    return result


def measure_rounds(worker, *, prompts: list[Prompt], methods, controllers, temperatures, top_k, top_p,
                   max_new_tokens, plan: RoundPlan, warmup, concurrency, tree: TreeConfig, grid, run_dir, seed, encode,
                   sampled_methods, stopping: dict | None = None) -> dict:
    """The work unit of `evaluate`: the interleaved rounds of every method on `prompts` on the worker's pair.
    Returns {"records", "meta", "kept" (methods that ran without failing), "controllers"}."""
    pair = worker.pair
    stopping = dict(stopping or {})
    # checked on the pair before any method runs: a method failing on them would be skipped, not refused
    request_ending(pair, **stopping)
    ctx = EvalContext(pair=pair, tree=tree, grid=grid, run_dir=run_dir)
    built, skipped, factories = _build(ctx, methods, controllers)
    names = list(built)
    say = worker.say

    # leave room for the generation and the deepest draft lookahead of any method's tree
    max_depth = max([tree.max_depth] + [getattr(getattr(m, "decoder", None), "tree", tree).max_depth
                                        for m in built.values()])
    context = pair.max_context
    limit = prompt_room(context, max_new_tokens, max_depth)
    if limit < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in a {context}-token context")
    all_ids, n_truncated = _encode_all(prompts, encode or pair.encode, limit)

    failed: dict[str, str] = {}
    records: list[RunRecord] = []
    sampled_names = names if sampled_methods is None else [n for n in names if n == "ar" or n in sampled_methods]
    started = time.perf_counter()
    time_budget_s = plan.time_budget_s
    with MemoryMonitor(pair.device) as memory:
        measurer = Measurer(built, all_ids, [p.id for p in prompts], pair.device, memory, seed, failed, records,
                            degenerate=lambda tokens: measure(
                                tokens, pair.decode(list(tokens), skip_special_tokens=False)).degenerate)
        rounds_meta = {}
        for j, temperature in enumerate(temperatures):
            # top-k / top-p shape the sampled temperatures only (greedy would ignore them, with a warning)
            sampling = dict(max_new_tokens=max_new_tokens, temperature=float(temperature),
                            top_k=top_k if temperature > 0 else 0, top_p=top_p if temperature > 0 else 1.0, **stopping)
            running = names if temperature == 0 else sampled_names
            # what is left of the budget, shared evenly by the temperatures still to run
            deadline = (None if time_budget_s is None else time.perf_counter()
                        + (started + time_budget_s - time.perf_counter()) / (len(temperatures) - j))
            measurer.warmup(running, sampling, warmup)
            rounds_meta[f"{float(temperature):g}"] = run_rounds(measurer, running, sampling, plan,
                                                                deadline=deadline, say=say)
            if concurrency > 1:
                records.extend(_run_concurrent(factories, running, failed, prompts, all_ids, sampling, seed,
                                               concurrency, pair.device, memory))
                say(f"T={temperature:g} concurrency {concurrency} done")

    kept = [n for n in names if n not in failed]
    method_info = {n: (built[n].describe() if hasattr(built[n], "describe") else {"name": n}) for n in names}
    meta = build_meta(pair, tree=tree, prompts=prompts, temperatures=temperatures, top_k=top_k, top_p=top_p,
                      max_new_tokens=max_new_tokens, repeats=max(r["rounds"] for r in rounds_meta.values()),
                      warmup=warmup, concurrency=concurrency, seed=seed, methods=method_info,
                      skipped={**skipped, **failed}, n_truncated=n_truncated, prompt_token_limit=limit,
                      stopping=stopping)
    meta["rounds"] = {**plan.describe(), "seconds": round(time.perf_counter() - started, 1),
                      "by_temperature": rounds_meta}
    if sampled_methods is not None:
        meta["sampled_methods"] = sampled_names
    # the ar runs at T=0 are the target's greedy output (`specpilot.eval.degeneracy`): decoded here, on the
    # worker that holds the tokenizer, measured in `_merge`; it costs no generation
    # the degeneracy measure reads the text with its special tokens, as it always has (an end token is output too)
    greedy = {pid: pair.decode(list(tokens), skip_special_tokens=False)
              for pid, tokens in greedy_outputs(records).items()}
    return {"records": [r for r in records if r.method not in failed], "meta": meta, "kept": kept,
            "greedy_texts": greedy,
            "controllers": {n: (copy.deepcopy(m.controller), m.decoder.tree) for n, m in built.items()
                            if n in kept and isinstance(m, ControllerMethod)}}


def _merge(prompts: list[Prompt], tasks: list[ShardTask], outcomes: list[ShardOutcome], temperatures,
           decide: tuple[str, str], seed: int, by_group: bool) -> EvalResult:
    """One EvalResult from the workers' parts: records in prompt order, methods every worker kept, rows and the
    paired analysis over all records, rows tagged with the worker and device that measured them."""
    parts = [o.result for o in outcomes]
    kept = [n for n in parts[0]["kept"] if all(n in p["kept"] for p in parts)]
    order = {p.id: i for i, p in enumerate(prompts)}
    records = [r for p in parts for r in p["records"] if r.method in kept]
    if len(parts) > 1:
        records.sort(key=lambda r: order.get(r.prompt_id, 0))
    concurrency = parts[0]["meta"]["protocol"]["concurrency"]
    meta = merge_meta([p["meta"] for p in parts], [o.worker for o in outcomes])
    meta["prompt_mix"] = prompt_mix(list(prompts))
    meta["executor"] = shard_report(tasks, outcomes, unit="(task, language) group" if by_group else "prompt")
    worker_of = {prompts[j].id: o.worker for t, o in zip(tasks, outcomes) for j in t.prompts}
    rows = _aggregate(records, prompts, kept, temperatures, concurrency, seed=seed)
    for row in rows:
        first = next(p.id for p in prompts if (p.task, p.language) == (row["task"], row["language"]))
        row.update(worker=worker_of[first]["worker"], device=worker_of[first]["device"])
    result = EvalResult(results=rows, meta=meta, records=records)
    outputs = greedy_outputs(records)
    texts = {tuple(outputs[pid]): text for p in parts for pid, text in p["greedy_texts"].items() if pid in outputs}
    result.degeneracy = (degeneracy_report(outputs, prompts, decode=lambda tokens: texts.get(tuple(tokens)))
                         if outputs else None)
    _analyse(result, prompts, temperatures, decide, seed)
    result.controllers = {n: c for p in parts for n, c in p["controllers"].items() if n in kept}
    return result


def merge_meta(metas: list[dict], workers: list[dict]) -> dict:
    """Merge per-worker meta blocks generically: equal values are kept, dicts merge key by key, counts
    (`prompts_*`) are summed; a value that differs between workers keeps the first worker's (a dict: all keys)
    and lists every worker's under `per_worker`; `workers` lists each worker's description (device, GPU, host)."""
    merged: dict = {}
    per_worker: dict = {}
    for key in dict.fromkeys(k for m in metas for k in m):
        values = [m.get(key) for m in metas if key in m]
        if all(v == values[0] for v in values):
            merged[key] = values[0]
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values) and key.startswith("prompts_"):
            merged[key] = sum(values)
        else:
            merged[key] = ({k: v for d in values for k, v in d.items()} if all(isinstance(v, dict) for v in values)
                           else values[0])
            per_worker[key] = values
    merged["workers"] = list(workers)
    merged["per_worker"] = per_worker
    return merged


def _analyse(result: EvalResult, prompts: list[Prompt], temperatures, decide: tuple[str, str], seed: int) -> None:
    """The paired analysis of `result.records` (see `specpilot.eval.compare`). Prompts whose greedy output is
    flagged degenerate are left out of every verdict (the summary, the comparisons and the task groups' intervals)
    and analysed apart; exactness and the decision statistics describe every prompt."""
    records = result.records
    flagged = set((result.degeneracy or {}).get("flagged", []))
    kept = [r for r in records if r.prompt_id not in flagged]
    result.summary = _summary(kept, temperatures, seed, exact_over=records)
    result.comparisons = comparisons(kept, temperatures, decide=decide, seed=seed)
    if flagged:
        apart = [r for r in records if r.prompt_id in flagged]
        result.degeneracy["summary"] = _summary(apart, temperatures, seed)
        result.degeneracy["comparisons"] = comparisons(apart, temperatures, decide=decide, seed=seed)
    result.groups = [g for t in temperatures for g in group_comparisons(kept, prompts, temperature=t,
                                                                        method=decide[0], baseline=decide[1],
                                                                        seed=seed)]
    result.decisions = {f"{float(t):g}": decision_stats(records, temperature=t, reference=decide[1])
                        for t in temperatures}


def _summary(records: list[RunRecord], temperatures, seed: int,
             exact_over: list[RunRecord] | None = None) -> list[dict]:
    """Per method and temperature, over every unit it ran (concurrency 1): pooled speedup over `ar` with its
    paired interval, tau, and whether every greedy run equalled `ar`'s tokens (over `exact_over` when given:
    exactness is checked on every prompt, also those left out of the speedups)."""
    out = []
    for temperature in temperatures:
        by_method = unit_records(records, temperature=temperature)
        every = unit_records(exact_over, temperature=temperature) if exact_over is not None else by_method
        ar_tokens = {k[0]: r.tokens for k, r in every.get("ar", {}).items() if k[1] == 0}
        for name, units in by_method.items():
            c = compare(by_method, name, "ar", temperature=temperature, seed=seed)
            recs = list(units.values())
            out.append({
                "method": name, "temperature": float(temperature),
                "speedup": c["ratio"] if c else float("nan"), "speedup_ci": c["ci"] if c else [None, None],
                "tau": pooled_tau(recs),
                "policy_overhead": sum(r.policy_s for r in recs) / max(sum(r.wall_s for r in recs), 1e-12),
                "identical_to_ar": (all(r.tokens == ar_tokens.get(r.prompt_id)
                                        for r in every.get(name, units).values())
                                    if float(temperature) == 0.0 else None),
                "n_units": len(units), "n_prompts": len({k[0] for k in units}),
                "n_rounds": len({k[1] for k in units})})
    return out


def _run_concurrent(factories: dict[str, Callable[[], Method]], names: list[str], failed: dict, prompts: list[Prompt],
                    all_ids: list[list[int]], sampling: dict, seed: int, n: int, device: torch.device,
                    memory: MemoryMonitor) -> list[RunRecord]:
    """N streams at once: prompts in batches of N, one thread per prompt; methods ordered per batch by
    `method_order`. Every thread builds its own method instance (decoders and controllers keep per-generation state)."""
    out: list[RunRecord] = []
    active = [m for m in names if m not in failed]
    instances = {m: [factories[m]() for _ in range(n)] for m in active}
    batches = [list(range(s, min(s + n, len(all_ids)))) for s in range(0, len(all_ids), n)]
    for b, batch in enumerate(batches):
        for name in method_order(active, b):
            got: list[RunRecord | None] = [None] * len(batch)
            errors: list[BaseException] = []

            def work(slot: int, idx: int) -> None:
                try:
                    got[slot] = timed(instances[name][slot], all_ids[idx], {**sampling, "seed": seed + idx},
                                      device, None)
                except Exception as err:  # noqa: BLE001 - reported below
                    errors.append(err)

            memory.begin()
            threads = [threading.Thread(target=work, args=(s, idx)) for s, idx in enumerate(batch)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            peak = memory.end()
            if errors:
                if name == "ar":
                    raise errors[0]
                failed[name] = f"under concurrency {n}: {type(errors[0]).__name__}: {errors[0]}"
                continue
            for slot, idx in enumerate(batch):
                rec = got[slot]
                rec.prompt_id, rec.peak_mem_mb = prompts[idx].id, peak
                rec.temperature, rec.concurrency = sampling["temperature"], n
                out.append(rec)
    return out


def _aggregate(records: list[RunRecord], prompts: list[Prompt], names: list[str],
               temperatures: tuple[float, ...], concurrency: int, *, seed: int = 0) -> list[dict]:
    """One row per task x language x method x temperature x concurrency. A row's speedup pairs the method's units
    with `ar`'s runs of the same units (a method run in fewer rounds is compared on its own rounds), and carries
    the paired bootstrap interval `speedup_ci`."""
    by_id = {p.id: p for p in prompts}
    split_of: dict[tuple[str, str], set] = {}
    for p in prompts:
        split_of.setdefault((p.task, p.language), set()).add(p.split)
    rows = []
    levels = [1] + ([concurrency] if concurrency > 1 else [])
    for temperature in temperatures:
        for c in levels:
            by_method = unit_records(records, temperature=temperature, concurrency=c)
            ar = by_method.get("ar", {})
            # greedy reference tokens: ar's first round of each prompt
            ar_tokens = {k[0]: r.tokens for k, r in ar.items() if k[1] == 0}
            for task, lang in sorted(split_of):
                ids = [p.id for p in prompts if (p.task, p.language) == (task, lang)]
                for name in names:
                    units = {k: r for k, r in by_method.get(name, {}).items() if by_id[k[0]].task == task
                             and by_id[k[0]].language == lang}
                    if not units:
                        continue
                    recs = list(units.values())
                    identical = (all(r.tokens == ar_tokens.get(r.prompt_id) for r in recs)
                                 if float(temperature) == 0.0 else None)
                    row = {"task": task, "language": lang, "split": "/".join(sorted(split_of[(task, lang)])),
                           "method": name, "temperature": float(temperature), "concurrency": c}
                    row.update(aggregate(recs, [ar[k] for k in units if k in ar] or None, identical=identical))
                    paired = compare(by_method, name, "ar", temperature=temperature, prompt_ids=ids, seed=seed)
                    row["speedup_ci"] = paired["ci"] if paired else [float("nan"), float("nan")]
                    row["n_units"] = len(units)
                    rows.append(row)
    return rows


# ---- meta ---------------------------------------------------------------------------------------------------
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:  # noqa: BLE001 - a missing package is reported as None
        return None


def build_meta(pair: ModelPair, *, tree: TreeConfig, prompts: list[Prompt], temperatures, top_k: int,
               top_p: float, max_new_tokens: int, repeats: int, warmup: int, concurrency: int, seed: int,
               methods: dict, skipped: dict, n_truncated: int = 0, prompt_token_limit: int | None = None,
               stopping: dict | None = None) -> dict:
    """Everything a reader needs to know what the numbers were measured on. stopping: the stop strings, stop token
    ids and ignore_eos every method was given (`drafting.stopping.stopping_options`)."""
    stopping = stopping or {}
    device = pair.device
    import os
    return {
        "models": pair.identity(),
        "dtype": str(pair.dtype).replace("torch.", ""),
        "dtype_reason": getattr(pair, "dtype_reason", ""),  # why this dtype (resolve_dtype: asked, default, auto)
        "drafter_dtype": str(pair.drafter_dtype).replace("torch.", ""),
        "device": str(device),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # the CPU row plan of few-row products, per model (drafting/linear_kernels.py)
        "small_row_linears": describe_small_rows([getattr(pair, k, None) for k in ("target", "draft", "eagle")]),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": _version("transformers"), "specpilot": _version("specpilot")},
        "sampling": {"temperatures": [float(t) for t in temperatures], "top_k": top_k, "top_p": top_p,
                     "max_new_tokens": max_new_tokens, "seed": seed,
                     "stop_strings": list(stopping.get("stop_strings", [])),
                     "stop_token_ids": list(stopping.get("stop_token_ids", [])),
                     "ignore_eos": bool(stopping.get("ignore_eos", False))},
        "protocol": {"repeats": repeats, "warmup": warmup, "concurrency": concurrency,
                     "interleaving": ("rounds over all prompts; per prompt the methods back to back, in the order of a "
                                      "Williams design (every method in every position and after every other "
                                      "method equally often)"),
                     "unit": "one (prompt, round): every method of the round ran it back to back",
                     "speedup": "pooled tokens/s of the method over pooled tokens/s of ar on the same units",
                     "interval": "95% paired percentile bootstrap over prompts, each prompt's rounds resampled "
                                 "together (4000 resamples, seeded); a round's timing-noise interval over (prompt, "
                                 "round) units decides when to stop adding rounds",
                     "itl": "gaps between successive token deliveries (a cycle's tokens are one delivery)",
                     "peak_mem": MemoryMonitor.source(device)},
        "tree": {"width": tree.width, "max_depth": tree.max_depth, "max_size": tree.max_size},
        "methods": methods,
        "skipped": skipped,
        "prompt_mix": prompt_mix(prompts),
        "prompts_truncated": n_truncated,
        "prompt_token_limit": prompt_token_limit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
