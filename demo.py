"""`specpilot demo`: the whole mission end to end — record, grid search, train two PPO policies, co-adapt, evaluate
on held-out tasks, export, summarise — in one run directory, reusing finished stages when re-run.

    specpilot demo [--quick] [--out runs/demo] [--target T --draft D] [--ray auto --workers 8]

Budgets (`DemoBudget`) are sized for the embedded pair on a 2-core CPU: the full run aims at <= 25 minutes,
`--quick` at <= 6 minutes with every stage still present. With `cluster` (a `specpilot.train.cluster.WorkerPool`,
`--ray`), recording, the grid's live phase and the evaluation run sharded on the Ray workers; training (replay)
and the export stay in this process.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from tqdm.auto import tqdm


@dataclass
class DemoBudget:
    """How much work each stage does.

    train_prompts / val_prompts / heldout_prompts: prompts used per split (0 = all of the bundled suite);
    max_new_tokens: tokens per recorded / evaluated generation;
    width / max_depth / max_size: the draft tree recorded and searched;
    size_steps / depth_steps / coadapt_steps / rounds: PPO budgets in env steps (replay backend);
    n_steps / batch_size / n_epochs: PPO rollout settings (the paper's 2048/256; 10 epochs instead of 20, so the
        budget buys more environment steps: on replay, steps are cheap and the updates are the cost);
    pi_arch / vf_arch: actor and critic layers. The paper's [1024, 256] actor costs ~0.1-0.5 ms per decision on
        a CPU, several percent of a ~35 ms CPU cycle (the depth policy runs every level), so the CPU demo uses a
        small actor, and a [256, 256] critic (not used at inference) to keep the updates cheap;
    reward: PPO reward. "dinkelbach" (tokens - lambda * time) by default: summed over an episode it is total tokens
        minus lambda * total time, so it optimises long-run tokens/s. The paper's per-cycle "throughput" reward
        sums tokens/time ratios, which favours many short cycles and collapses the depth policy to depth 1;
    live_top: grid configs re-measured live; repeats / temperatures: evaluation settings; sampled_methods: the
        methods also evaluated at temperatures > 0 (the baselines, the grid config, LTD and the best sampling
        heuristic: all twelve at T=1 would cost the full run ~6 more minutes).
    """

    train_prompts: int = 0
    val_prompts: int = 0
    heldout_prompts: int = 17  # one per (task, language) group of the bundled held-out suite
    max_new_tokens: int = 96
    width: int = 4
    max_depth: int = 8
    max_size: int = 32
    size_steps: int = 40_000
    depth_steps: int = 120_000
    coadapt_steps: int = 30_000
    rounds: int = 3
    n_steps: int = 2048
    batch_size: int = 256
    n_epochs: int = 10
    pi_arch: tuple[int, ...] = (64, 64)
    vf_arch: tuple[int, ...] = (256, 256)
    reward: str = "dinkelbach"
    live_top: int = 3
    repeats: int = 1
    temperatures: tuple[float, ...] = (0.0, 1.0)
    sampled_methods: tuple[str, ...] = ("hf_generate", "hf_assisted", "grid", "ltd", "svip")

    @classmethod
    def quick(cls) -> "DemoBudget":
        return cls(train_prompts=10, val_prompts=4, heldout_prompts=12, max_new_tokens=48, size_steps=3_000,
                   depth_steps=4_000, coadapt_steps=2_000, rounds=3, n_steps=512, batch_size=128, n_epochs=5,
                   vf_arch=(256, 256), live_top=2, temperatures=(0.0,))


STAGES = ("record", "grid", "train", "eval", "export")


class DemoState:
    """demo_state.json: which stages finished with which settings (a stage re-runs if its settings changed)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "demo_state.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}

    def done(self, stage: str, key: str) -> dict | None:
        entry = self.data.get(stage)
        return entry if entry and entry.get("key") == key else None

    def finish(self, stage: str, key: str, result: dict, seconds: float) -> None:
        self.data[stage] = {"key": key, "result": result, "seconds": round(seconds, 1)}
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def invalidate_after(self, stage: str) -> None:
        for later in STAGES[STAGES.index(stage) + 1:]:
            self.data.pop(later, None)


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _limit(items: list, n: int) -> list:
    """The first n prompts, taken round-robin over (task, language) groups so a small budget still covers every
    task and language of the suite (n = 0: all)."""
    if not n or n >= len(items):
        return list(items)
    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault((getattr(item, "task", ""), getattr(item, "language", "")), []).append(item)
    picked, queues = [], list(groups.values())
    while len(picked) < n:
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    return picked


def run_demo(out: str | Path = "runs/demo", *, quick: bool = False, target: str | None = None,
             draft: str | None = None, budget: DemoBudget | None = None, seed: int = 0,
             wandb: str | None = None, device: str | None = None, cluster=None) -> dict:
    """Run (or resume) every stage; return the summary dict (also written to RUN/summary.json)."""
    from specpilot.drafting import ModelPair, TreeConfig
    from specpilot.eval.suites import load_suite

    budget = budget or (DemoBudget.quick() if quick else DemoBudget())
    run_dir = Path(out)
    run_dir.mkdir(parents=True, exist_ok=True)
    state = DemoState(run_dir)
    started = time.perf_counter()
    pair = ModelPair.from_pretrained(target, draft, device=device)
    identity = pair.identity()
    tree = TreeConfig(width=budget.width, max_depth=budget.max_depth, max_size=budget.max_size)
    train = _limit(load_suite("train"), budget.train_prompts)
    val = _limit(load_suite("validation"), budget.val_prompts)
    heldout = _limit(load_suite("heldout"), budget.heldout_prompts)
    base_key = [identity, asdict(budget), seed]
    timings: dict[str, float] = {}
    results: dict[str, dict] = {}

    stages = tqdm(STAGES, desc="specpilot demo", unit="stage")
    for stage in stages:
        stages.set_postfix_str(stage)
        key = _key(base_key, stage)
        previous = state.done(stage, key)
        if previous is not None:
            results[stage], timings[stage] = previous["result"], previous["seconds"]
            tqdm.write(f"[{stage}] reused from {state.path}")
            continue
        state.invalidate_after(stage)
        t0 = time.perf_counter()
        results[stage] = STAGE_FUNCTIONS[stage](run_dir=run_dir, pair=pair, tree=tree, budget=budget, seed=seed,
                                                train=train, val=val, heldout=heldout, wandb=wandb,
                                                cluster=cluster)
        timings[stage] = time.perf_counter() - t0
        state.finish(stage, key, results[stage], timings[stage])
        tqdm.write(f"[{stage}] done in {timings[stage]:.0f}s")
    summary = summarise(run_dir, results, timings, time.perf_counter() - started, identity, budget)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(format_summary(summary))
    return summary


# -- stages --------------------------------------------------------------------------------------------------------

def _record(*, run_dir, pair, tree, budget, seed, train, val, cluster=None, **_) -> dict:
    from specpilot.train.pipeline import record_traces

    if cluster is not None:  # the same files as record_traces: trace, profile and ar.json per split
        from specpilot.train.sharded import record_sharded

        for split, prompts in (("train", train), ("validation", val)):
            record_sharded(cluster, tree, [p.prompt for p in prompts], run_dir / "traces" / split,
                           max_new_tokens=budget.max_new_tokens, profile_prompts=min(8, len(train)), seed=seed,
                           ar=True, progress=tqdm.write)
        return {"train": str(run_dir / "traces" / "train"), "validation": str(run_dir / "traces" / "validation")}
    traces = record_traces(pair, run_dir / "traces", tree=tree, train_prompts=[p.prompt for p in train],
                           val_prompts=[p.prompt for p in val], max_new_tokens=budget.max_new_tokens,
                           profile_prompts=min(8, len(train)), seed=seed, progress=True)
    return {"train": str(traces.train), "validation": str(traces.validation)}


def _grid(*, run_dir, pair, budget, val, cluster=None, **_) -> dict:
    from specpilot.train.grid import grid_search

    if cluster is not None:
        from specpilot.train.cluster_grid import grid_search_sharded

        result = grid_search_sharded(cluster, run_dir / "traces" / "train", val_prompts=[p.prompt for p in val],
                                     live_top=budget.live_top, live_max_new_tokens=budget.max_new_tokens,
                                     out=run_dir / "grid.json", progress=tqdm.write)
        return {"best": result["best"], "oracle": result.get("oracle")}
    result = grid_search(run_dir / "traces" / "train", pair=pair, val_prompts=[p.prompt for p in val],
                         live_top=budget.live_top, live_max_new_tokens=budget.max_new_tokens,
                         out=run_dir / "grid.json", progress=True)
    return {"best": result["best"], "oracle": result.get("oracle")}


def _train(*, run_dir, budget, seed, wandb, **_) -> dict:
    from specpilot.train.pipeline import TaskTraces, run_pipeline

    traces = TaskTraces(run_dir / "traces" / "train", run_dir / "traces" / "validation")
    out = run_pipeline(run_dir, traces, size_steps=budget.size_steps, depth_steps=budget.depth_steps,
                       coadapt_steps=budget.coadapt_steps, rounds=budget.rounds, static=run_dir / "grid.json",
                       reward=budget.reward, resume=True, seed=seed, wandb=wandb, n_steps=budget.n_steps, batch_size=budget.batch_size,
                       n_epochs=budget.n_epochs, pi_arch=list(budget.pi_arch), vf_arch=list(budget.vf_arch))
    return json.loads(json.dumps(out, default=str))


def _eval(*, run_dir, pair, tree, budget, seed, heldout, cluster=None, **_) -> dict:
    from specpilot.eval.report import write_report
    from specpilot.eval.runner import evaluate

    if cluster is not None:  # (task, language) groups over the workers, all methods interleaved on each
        from specpilot.train.sharded import evaluate_sharded

        evaluate = partial(evaluate_sharded, cluster)
    else:
        evaluate = partial(evaluate, pair=pair)
    result = evaluate(heldout, temperatures=budget.temperatures, max_new_tokens=budget.max_new_tokens,
                      repeats=budget.repeats, tree=tree, grid=run_dir / "grid.json", run_dir=run_dir, seed=seed,
                      progress=lambda msg: tqdm.write(f"  {msg}"), sampled_methods=list(budget.sampled_methods))
    paths = write_report(result.results, result.meta, run_dir / "eval")
    return {"report": {k: str(v) for k, v in paths.items()}, "skipped": result.meta.get("skipped")}


def _export(*, run_dir, pair, **_) -> dict:
    from specpilot.policies.export import export_run

    meta = export_run(run_dir, run_dir / "export", pair=pair)
    return {"dir": str(run_dir / "export"), "measured": (meta or {}).get("measured")}


STAGE_FUNCTIONS = {"record": _record, "grid": _grid, "train": _train, "eval": _eval, "export": _export}


# -- summary -------------------------------------------------------------------------------------------------------

def summarise(run_dir: Path, results: dict, timings: dict, wall_s: float, identity: dict, budget: DemoBudget) -> dict:
    """Held-out speedup and tau by method (greedy, pooled over tasks), LTD vs grid, oracle ceiling, overhead."""
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    rows = [r for r in report["results"] if r.get("temperature") == 0.0 and r.get("concurrency", 1) == 1]
    by_method: dict[str, dict] = {}
    for r in rows:
        m = by_method.setdefault(r["method"], {"speedups": [], "taus": [], "overheads": [], "tokens": 0,
                                               "identical": True})
        m["speedups"].append(r["speedup"])
        if r.get("tau") is not None:
            m["taus"].append(r["tau"])
        if r.get("policy_overhead") is not None:
            m["overheads"].append(r["policy_overhead"])
        m["tokens"] += r.get("n_tokens") or 0
        m["identical"] &= r.get("identical_to_ar") is not False

    def mean(xs):
        xs = [x for x in xs if x is not None and x == x]
        return sum(xs) / len(xs) if xs else None

    table = {name: {"speedup": mean(m["speedups"]), "tau": mean(m["taus"]), "policy_overhead": mean(m["overheads"]),
                    "identical_to_ar": m["identical"], "n_tokens": m["tokens"]} for name, m in by_method.items()}
    ltd, grid = table.get("ltd", {}).get("speedup"), table.get("grid", {}).get("speedup")
    heuristics = {k: v["speedup"] for k, v in table.items() if k in ("ddd", "svip", "confidence", "hf_heuristic")}
    grid_json = json.loads((run_dir / "grid.json").read_text()) if (run_dir / "grid.json").exists() else {}
    return {
        "run_dir": str(run_dir), "wall_s": round(wall_s, 1), "stage_s": {k: round(v, 1) for k, v in timings.items()},
        "pair": identity, "budget": asdict(budget), "label": report.get("meta", {}).get("label"),
        "methods": table,
        "ltd_vs_grid": (ltd / grid - 1.0) if ltd and grid else None,
        "ltd_beats_every_heuristic": all(ltd > h for h in heuristics.values() if h) if ltd else None,
        "grid_best": grid_json.get("best"), "replay_oracle": grid_json.get("oracle"),
    }


def format_summary(summary: dict) -> str:
    lines = ["", f"specpilot demo — {summary['run_dir']} ({summary['wall_s']:.0f}s: "
             + ", ".join(f"{k} {v:.0f}s" for k, v in summary["stage_s"].items()) + ")"]
    if summary.get("label"):
        lines.append(str(summary["label"]))
    lines.append(f"{'method':14s} {'speedup':>8s} {'tau':>6s} {'overhead':>9s}  identical")
    order = sorted(summary["methods"].items(), key=lambda kv: -(kv[1]["speedup"] or 0))
    for name, m in order:
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        lines.append(f"{name:14s} {fmt(m['speedup'], '8.2f')}x {fmt(m['tau'], '6.2f')} "
                     f"{fmt(None if m['policy_overhead'] is None else 100 * m['policy_overhead'], '8.2f')}%  "
                     f"{m['identical_to_ar']}")
    if summary.get("ltd_vs_grid") is not None:
        lines.append(f"LTD vs grid-search best: {100 * summary['ltd_vs_grid']:+.1f}% held-out speedup; "
                     f"beats every heuristic: {summary['ltd_beats_every_heuristic']}")
    if summary.get("grid_best"):
        lines.append(f"grid best: {summary['grid_best']}")
    if summary.get("replay_oracle"):
        lines.append(f"replay oracle (training trace): {summary['replay_oracle']}")
    lines.append(f"files: {summary['run_dir']}/eval/report.md, {summary['run_dir']}/export/decoder.json")
    return "\n".join(lines)


# -- CLI -----------------------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small budgets (<= ~6 minutes on 2 CPU cores)")
    parser.add_argument("--out", default="runs/demo", help="run directory (finished stages are reused)")
    parser.add_argument("--target", help="target model (hub id or path); default: the embedded pair")
    parser.add_argument("--draft", help="draft model (hub id or path); default: the embedded pair")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--wandb", choices=["online", "offline", "disabled"], default=None,
                        help="wandb mode (default: $WANDB_MODE, else offline)")


def run(args: argparse.Namespace) -> int:
    run = partial(run_demo, args.out, quick=args.quick, target=args.target, draft=args.draft, seed=args.seed,
                  wandb=args.wandb, device=args.device)
    if getattr(args, "ray", None):
        from specpilot.train.cluster import ClusterError
        from specpilot.train.cluster_cli import open_pool

        try:
            with open_pool(args) as pool:
                run(cluster=pool)
        except ClusterError as err:
            print(f"specpilot demo: {err}", file=sys.stderr)
            return 2
    else:
        run()
    return 0
