"""The learned batch-aware policy on the embedded pair (with its separate draft LM), in batch
replay: tokens/s vs batch size for batched AR, the best static config for batch size 1 used at every size, the
per-batch-size grid table (`BatchTableController`), the learned policy trained over batch sizes, the same policy
behind its validation guard (`BatchGuardController`: the table at the sizes where it lost on validation), and the
per-batch oracle ceiling (`envs.batch_replay.batch_oracle_batch`).

    PYTHONPATH=.. python benchmarks/batch_learn.py prep  --out /tmp/batch_learn   # traces + batched profile + grid
    PYTHONPATH=.. python benchmarks/batch_learn.py train --out /tmp/batch_learn   # PPO over batch sizes
    PYTHONPATH=.. python benchmarks/batch_learn.py eval  --out /tmp/batch_learn   # held-out batch replay table
    PYTHONPATH=.. python benchmarks/batch_learn.py summary --out /tmp/batch_learn --runs s0,s1,s2  # seeds side by side

`prep --drafter eagle` uses the embedded target's EAGLE-3 head instead of its draft LM, and every setting left unset
follows the drafter's recipe (RECIPES: for eagle, issue 23's W4 D8 V32, 48 tokens, BC 8 x 20 + 3 PPO rounds); train
and eval read the drafter from OUT/prep.json.

prep records train (suite "train"), validation ("validation") and held-out test ("heldout_code") traces, measures
one batched latency profile (drafting/batch.py's forwards at each batch size) on the train prompts, kept as every
trace's profile.json, and ranks every static cell per batch size on the TRAIN trace (the grid's table). train runs
`run_pipeline` with `TrainOptions(batch_sizes=...)` (with --bc-iters: behaviour cloning from the per-batch
oracle, then --rounds of PPO co-adaptation), then writes RUN/batch_guard.json from the validation trace. eval
replays the held-out trace in batches of B
(`BatchReplaySession` + `run_generation`, the decoders' cycle), every method on the same batches; intervals are
paired bootstraps over those batches of (method tokens/time) / (AR tokens/time). Replay times are the profile's
model of this machine, not wall-clock runs. The table is a grid-search result (OUT/grid_table.json, a
`GridResult`), so the live check is `specpilot eval --suite heldout_code --batch-sizes 1,2 --methods
ar,batch_table,ltd_guarded --grid OUT/grid_table.json --run OUT/RUN --width 4 --max-depth 8 --max-size 32
--max-new-tokens 48 --temperatures 0`.

The larger suites (every bundled train and validation prompt, 48 held-out): `prep --train-prompts 77 --val-prompts
21 --test-prompts 48 [--profile PROFILE_JSON]` (about 9 minutes of recording on a shared 2-core CPU), then
`train --bc-iters 4 --rounds 3 [--seed S]` (1-2 minutes each) and `eval --compare NAME=RUN[:guarded],...`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def _demo_recipe() -> dict:
    """`specpilot demo`'s defaults (DemoBudget): the recipe that beat the static grid on held-out code at batch size
    1 (issue 23: W4 D8 V32, 48 tokens, BC 8 DAgger iterations x 20 epochs, 3 PPO co-adaptation rounds, ...)."""
    from specpilot.demo import DemoBudget

    budget = DemoBudget()
    keys = ("width", "max_depth", "max_size", "max_new_tokens", "bc_iters", "bc_epochs", "rounds", "coadapt_steps",
            "n_steps", "n_epochs")
    return {**{k: getattr(budget, k) for k in keys}, "ppo_batch_size": budget.batch_size,
            "pi_arch": list(budget.pi_arch), "vf_arch": list(budget.vf_arch)}


# Per drafter, the settings prep / train use where no flag is given. "draft": the embedded target's separate draft
# LM at the settings this benchmark has always used. "eagle": the embedded target's EAGLE-3 head at the demo's recipe.
RECIPES = {
    "draft": {"width": 2, "max_depth": 6, "max_size": 12, "max_new_tokens": 32, "bc_iters": 0, "bc_epochs": 30,
              "rounds": 0, "coadapt_steps": 2048, "pi_arch": [64], "vf_arch": [64], "n_steps": None,
              "ppo_batch_size": None, "n_epochs": None},
    "eagle": _demo_recipe(),
}
TABLE_FILE = "grid_table.json"
SPLITS = {"train": "train", "validation": "validation", "test": "heldout_code"}


def resolve(args, drafter: str) -> None:
    """Fill every setting left unset (None) from the drafter's recipe."""
    for key, value in RECIPES[drafter].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def prep(args, out: Path, batch_sizes: list[int]) -> None:
    import os

    from specpilot.drafting import ModelPair, TreeConfig
    from specpilot.envs.batch_replay import batch_static_sweep, best_per_batch_size
    from specpilot.envs.profile import LatencyProfile, measure_batch_profile
    from specpilot.envs.record import record_trace
    from specpilot.envs.replay import ReplayModel
    from specpilot.eval.suites import load_suite

    drafter = args.drafter or "draft"
    resolve(args, drafter)
    settings = {"drafter": drafter, "width": args.width, "max_depth": args.max_depth, "max_size": args.max_size,
                "max_new_tokens": args.max_new_tokens}
    meta_path = out / "prep.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta and meta.get("settings") != settings:   # one folder = one pair, tree and length (resumed runs add to it)
        raise SystemExit(f"{out} was prepared with {meta.get('settings')}, not {settings}: use another --out")
    meta["settings"] = settings
    pair = ModelPair.from_pretrained(draft="embedded") if drafter == "draft" else \
        ModelPair.from_pretrained(eagle="embedded")
    print(f"pair: {pair.drafter_kind}; tree W{args.width} D{args.max_depth} V{args.max_size}; "
          f"{args.max_new_tokens} tokens", flush=True)
    tree = TreeConfig(width=args.width, max_depth=args.max_depth, max_size=args.max_size)
    # the batch profile FIRST (timing is what a loaded machine spoils; the traces are timing-free), kept once per
    # folder so that later prep calls (e.g. one per split, in parallel) reuse it
    profile_file = out / "profile.json"
    started = time.perf_counter()
    if args.profile:   # a profile measured before (same machine, pair and tree): the same latency model
        profile = LatencyProfile.load(args.profile)
        profile.save(profile_file)
    elif profile_file.is_file():
        profile = LatencyProfile.load(profile_file)
    else:
        load_before = os.getloadavg()
        train_prompts = [p.prompt for p in load_suite("train")][: min(args.train_prompts, args.profile_prompts)]
        profile = measure_batch_profile(pair, tree, train_prompts, batch_sizes, max_new_tokens=args.max_new_tokens,
                                        min_batches=args.profile_min_batches, progress=True)
        profile.save(profile_file)
        meta["profile"] = {"seconds": time.perf_counter() - started, "loadavg_before": load_before,
                           "loadavg_after": os.getloadavg(), "batch_sizes": batch_sizes}
        print(f"batch profile: {time.perf_counter() - started:.0f}s; load average before "
              f"{load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}", flush=True)
    meta_path.write_text(json.dumps(meta, indent=1))
    counts = {"train": args.train_prompts, "validation": args.val_prompts, "test": args.test_prompts}
    wanted = args.splits.split(",") if args.splits else list(SPLITS)
    for split in wanted:
        if split not in SPLITS:
            raise SystemExit(f"--splits takes {','.join(SPLITS)}; got {split!r}")
        folder = out / "traces" / split
        if not (folder / "profile.json").is_file():   # the profile is written last: a folder with it is complete
            started = time.perf_counter()
            prompts = [p.prompt for p in load_suite(SPLITS[split])][: counts[split]]
            record_trace(pair, tree, prompts, max_new_tokens=args.max_new_tokens).save(folder)
            profile.save(folder / "profile.json")
            print(f"trace {split} ({len(prompts)} prompts): {time.perf_counter() - started:.0f}s", flush=True)
    if not all((out / "traces" / s / "profile.json").is_file() for s in SPLITS):
        return   # the grid table waits for every split (another prep call records the rest)
    model = ReplayModel(out / "traces" / "train")
    sizes = [v for v in (1, 2, 4, 8, 12, 16, 24, 32) if v <= tree.max_size]
    rows = batch_static_sweep(model, [(d, v) for d in range(1, tree.max_depth + 1) for v in sizes], batch_sizes)
    best = best_per_batch_size(rows)
    write_live_grid(out / TABLE_FILE, best, width=tree.width)
    print("grid table (train trace):", [(r["batch_size"], r["depth"], r["size"]) for r in best], flush=True)


def write_live_grid(path: Path, table: list[dict], *, width: int) -> Path:
    """The table as a grid-search result (`GridResult`: best = the batch-size-1 cell, per_batch_size = the table),
    so train / eval here and the live check read it the way `specpilot eval` reads any grid: `specpilot eval
    --batch-sizes 1,2 --methods ar,batch_table,ltd_guarded --grid OUT/grid_table.json --run OUT/RUN` (batch_table =
    this table; ltd_guarded = the run's deployed controller)."""
    from specpilot.artifacts.grid import GridResult

    rows = [{"batch_size": int(r["batch_size"]), "depth": int(r["depth"]), "size": int(r["size"]), "width": width,
             "replay_tokens_per_s": float(r["tokens_per_s"])} for r in table]
    best = {k: rows[0][k] for k in ("depth", "size", "width")}
    meta = {"source": "benchmarks/batch_learn.py prep: per-batch-size static sweep in batch replay of the train trace"}
    return GridResult(best=best, per_batch_size=rows, meta=meta).save(path)


def read_table(out: Path) -> tuple[tuple[int, int], dict[int, tuple[int, int]]]:
    """(the batch-size-1 cell (depth, size), {batch size: (depth, size)}) of the table prep wrote."""
    from specpilot.artifacts.grid import GridResult

    grid = GridResult.load(out / TABLE_FILE)
    return (grid.best["depth"], grid.best["size"]), {r["batch_size"]: (r["depth"], r["size"])
                                                     for r in grid.per_batch_size}


def train(args, out: Path, batch_sizes: list[int]) -> None:
    from specpilot.train.rl import pipeline as P
    from specpilot.train.rl.ppo import PPOOverrides

    b1, _ = read_table(out)
    static = (max(1, b1[0]), max(1, b1[1]))
    ppo = PPOOverrides(pi_arch=args.pi_arch, vf_arch=args.vf_arch, n_steps=args.n_steps,
                       batch_size=args.ppo_batch_size, n_epochs=args.n_epochs)
    print(f"train: bc {args.bc_iters} x {args.bc_epochs} epochs, {args.rounds} rounds x {args.coadapt_steps} steps, "
          f"PPO {ppo.changes()}", flush=True)
    options = P.TrainOptions(static=static, batch_sizes=tuple(batch_sizes), seed=args.seed, reward=args.reward,
                             ppo=ppo, bc_iters=args.bc_iters,
                             bc_epochs=args.bc_epochs, bc_exact_single=args.bc_exact_single)
    started = time.perf_counter()
    traces = P.TaskTraces.resolve(out / "traces")
    run = out / args.run_name
    if not args.guard_only:
        res = P.run_pipeline(run, traces, size_steps=args.size_steps, depth_steps=args.depth_steps,
                             coadapt_steps=args.coadapt_steps, rounds=args.rounds, options=options, wandb="disabled")
        print(f"trained in {time.perf_counter() - started:.0f}s; stage-1 scores (geo-mean x batched AR on "
              f"validation): size {res['size_s1']['score']:.3f}, depth {res['depth_s1']['score']:.3f}", flush=True)
    guard(run, out, batch_sizes)
    if (run / "bc" / "policies.json").is_file():
        guard(run / "bc", out, batch_sizes)


def guard(run: Path, out: Path, batch_sizes: list[int]) -> None:
    """The validation guard of the run's policy against the grid table (RUN/batch_guard.json: `ltd_guarded`)."""
    from specpilot.policies.ppo import load_run_controllers
    from specpilot.train.rl.validation import write_batch_guard

    _, table = read_table(out)
    g = write_batch_guard(run, load_run_controllers(run)["ltd"], table, out / "traces" / "validation", batch_sizes)
    per = g["per_batch_size"]
    print(f"guard {run.name}: table at {g['fallback']}; on validation, learned / table "
          f"{ {b: round(r['learned'] / r['table'], 3) for b, r in per.items()} }, guarded / table "
          f"{ {b: round(r['ratio'], 3) for b, r in per.items()} }", flush=True)


def _per_batch(model, controller, b: int) -> np.ndarray:
    """[(tokens, time_s)] per batch of b held-out prompts (the same batches for every method); controller "oracle":
    the per-batch oracle ceiling (`envs.batch_replay.batch_oracle_batch`) of each batch."""
    from specpilot.drafting.cycle import run_generation
    from specpilot.envs.batch_replay import BatchReplaySession, BatchTimes, batch_oracle_batch, batches_of

    times = _per_batch.times.setdefault(id(model), BatchTimes(model))
    out = []
    for batch in batches_of(model.num_prompts, b):
        if controller == "oracle":
            res = batch_oracle_batch(model, batch, times=times)
            out.append((res["tokens"], res["time_s"]))
            continue
        session = BatchReplaySession(model, batch, times=times)
        run_generation(session, controller)
        out.append((session.emitted_total, sum(r.cycle_s for r in session.cycles)))
    return np.array(out, dtype=float)


_per_batch.times = {}


def evaluate(args, out: Path, batch_sizes: list[int]) -> None:
    from specpilot.drafting.control import FixedController
    from specpilot.envs.batch_replay import learned_batch_table
    from specpilot.envs.replay import ReplayModel
    from specpilot.policies.heuristics import BatchTableController
    from specpilot.policies.ppo import load_run_controllers

    b1, table = read_table(out)
    learned = load_run_controllers(out / args.run_name)
    extra = {}
    for name in args.compare.split(",") if args.compare else []:   # other runs, e.g. BC-only / PPO-only
        name, _, path = name.partition("=")
        path, _, which = path.partition(":")
        ctrls = load_run_controllers(out / path)
        # unguarded: the policy itself; FOLDER:guarded: behind that run's own validation guard
        extra[name] = ctrls["ltd_guarded"] if which == "guarded" else ctrls["ltd"]
    # the deployed policy's own table (what export writes for the engines): the guarded controller's modal choice
    # per size on validation
    deployed = learned.get("ltd_guarded", learned["ltd"])
    own = learned_batch_table(ReplayModel(out / "traces" / "validation"), deployed, batch_sizes)
    print(f"{deployed.name}'s own table (validation):", [(r["batch_size"], r["depth"], r["size"]) for r in own])
    methods = {"ar": FixedController(0, 0), "b1_static": FixedController(*b1),
               "table": BatchTableController(table), "learned": learned["ltd"],
               "guarded": deployed, "oracle": "oracle",
               "learned_table": BatchTableController({r["batch_size"]: (r["depth"], r["size"]) for r in own}),
               **extra}
    shown = ["b1_static", "table", "learned", "guarded", "oracle", *extra]
    rng = np.random.default_rng(0)
    results = {}
    for split in ("test", "validation"):
        model = ReplayModel(out / "traces" / split)
        print(f"\n{split} trace ({model.num_prompts} prompts), batch replay; x = tokens/s over batched AR "
              f"[95% paired bootstrap over batches]; B1-static d={b1[0]} V={b1[1]}")
        # batches: the bootstrap's units (few at large B: an interval over 2-4 batches says little)
        print("| B | batches | AR tok/s | " + " | ".join(f"{m} x" for m in shown) + " | learned / table | "
              "guarded / table | oracle gain share (guarded) |")
        print("|---|---|---|" + "---|" * (len(shown) + 3))
        rows = []
        for b in batch_sizes:
            per = {m: _per_batch(model, c, b) for m, c in methods.items()}
            k = len(per["ar"])
            boot = rng.integers(0, k, size=(2000, k))

            def ratio(m, ref="ar"):
                num, den = per[m], per[ref]
                point = (num[:, 0].sum() / num[:, 1].sum()) / (den[:, 0].sum() / den[:, 1].sum())
                bs = (num[boot, 0].sum(1) / num[boot, 1].sum(1)) / (den[boot, 0].sum(1) / den[boot, 1].sum(1))
                return [float(point), float(np.quantile(bs, 0.025)), float(np.quantile(bs, 0.975))]

            row = {"batch_size": b, "ar_tokens_per_s": float(per["ar"][:, 0].sum() / per["ar"][:, 1].sum()),
                   **{f"{m}_vs_ar": ratio(m) for m in shown + ["learned_table"]},
                   "learned_vs_table": ratio("learned", "table"), "guarded_vs_table": ratio("guarded", "table"),
                   "batches": k}
            # the share of the oracle's gain over the table the guarded policy takes (table = 0, oracle = 1)
            gap = row["oracle_vs_ar"][0] - row["table_vs_ar"][0]
            row["guarded_oracle_share"] = (row["guarded_vs_ar"][0] - row["table_vs_ar"][0]) / gap if gap > 1e-9 \
                else float("nan")
            rows.append(row)
            f = lambda v: f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"  # noqa: E731
            print(f"| {b} | {k} | {row['ar_tokens_per_s']:.1f} | " + " | ".join(f(row[f"{m}_vs_ar"]) for m in shown) +
                  f" | {f(row['learned_vs_table'])} | {f(row['guarded_vs_table'])} | "
                  f"{row['guarded_oracle_share']:.2f} |", flush=True)
        results[split] = rows
    (out / f"eval_{args.run_name}.json").write_text(json.dumps(results, indent=1))


def summary(args, out: Path, batch_sizes: list[int]) -> None:
    """Several seeds' eval results (OUT/eval_<run>.json, --runs a,b,c): per batch size, each run's guarded / table
    [interval] on the held-out trace and the median over runs; the run deployed is the one with the best geometric
    mean of guarded / table over the batch sizes on VALIDATION (chosen without the held-out numbers)."""
    runs = [r for r in args.runs.split(",") if r]
    if not runs:
        raise SystemExit("summary needs --runs RUN,RUN,... (runs evaluated with eval --run-name)")
    res = {r: json.loads((out / f"eval_{r}.json").read_text()) for r in runs}
    score = {r: float(np.exp(np.mean([np.log(row["guarded_vs_table"][0]) for row in res[r]["validation"]])))
             for r in runs}
    chosen = max(runs, key=score.get)
    print("validation geo-mean guarded / table: " + ", ".join(f"{r} {v:.4f}" for r, v in score.items()) +
          f"; deployed: {chosen}")
    f = lambda v: f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"  # noqa: E731
    for split in ("test", "validation"):
        print(f"\n{split}: x batched AR (AR, best-for-B1 static, table, oracle: the same for every run); learned / "
              "guarded: median over runs; guarded / table per run [95% paired bootstrap over batches]")
        print("| B | batches | AR tok/s | best-for-B1 static | table | learned | guarded | oracle ceiling | " +
              " | ".join(f"{r} guarded / table" for r in runs) + " | median guarded / table |")
        print("|---|---|---|---|---|---|---|---|" + "---|" * (len(runs) + 1))
        for i, row in enumerate(res[runs[0]][split]):
            med = lambda key: float(np.median([res[r][split][i][key][0] for r in runs]))  # noqa: E731
            print(f"| {row['batch_size']} | {row['batches']} | {row['ar_tokens_per_s']:.1f} | "
                  f"{f(row['b1_static_vs_ar'])} | {f(row['table_vs_ar'])} | {med('learned_vs_ar'):.3f} | "
                  f"{med('guarded_vs_ar'):.3f} | {row['oracle_vs_ar'][0]:.3f} | " +
                  " | ".join(f(res[r][split][i]["guarded_vs_table"]) for r in runs) +
                  f" | {med('guarded_vs_table'):.3f} |")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["prep", "train", "eval", "summary"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--train-prompts", type=int, default=16)
    ap.add_argument("--val-prompts", type=int, default=8)
    ap.add_argument("--test-prompts", type=int, default=16)
    ap.add_argument("--drafter", choices=sorted(RECIPES), default=None,
                    help="prep: the embedded target's drafter: draft (its separate draft LM, default) or eagle (its "
                    "EAGLE-3 head); train / eval read it from OUT/prep.json. Every setting below left unset follows "
                    "the drafter's recipe (RECIPES)")
    ap.add_argument("--splits", default="", help="prep: record only these splits (train,validation,test); the grid "
                    "table is written once all three exist (so two prep calls can record in parallel)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--profile", default="", help="prep: reuse this batch latency profile instead of measuring one")
    ap.add_argument("--profile-prompts", type=int, default=16,
                    help="prep: the batch profile is measured on the first N train prompts (default 16)")
    ap.add_argument("--profile-min-batches", type=int, default=1,
                    help="prep: at least this many batches per batch size in the profile (the prompts cycled): more "
                    "cycles for the large sizes, which fit few batches into the prompts (default 1)")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--max-depth", type=int, default=None)
    ap.add_argument("--max-size", type=int, default=None)
    ap.add_argument("--size-steps", type=int, default=4096)
    ap.add_argument("--depth-steps", type=int, default=8192)
    ap.add_argument("--coadapt-steps", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--pi-arch", type=_ints, default=None, help="train: actor layers, e.g. 64,64")
    ap.add_argument("--vf-arch", type=_ints, default=None, help="train: critic layers, e.g. 256,256")
    ap.add_argument("--n-steps", type=int, default=None, help="train: PPO rollout steps per update")
    ap.add_argument("--ppo-batch-size", type=int, default=None, help="train: PPO minibatch")
    ap.add_argument("--n-epochs", type=int, default=None, help="train: PPO epochs per update")
    ap.add_argument("--reward", default="dinkelbach")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-name", default="run", help="the training run's folder under --out")
    ap.add_argument("--bc-iters", type=int, default=None, help="train: behaviour cloning from the per-batch oracle "
                    "(DAgger iterations) before PPO fine-tunes (--rounds co-adaptation rounds of --coadapt-steps)")
    ap.add_argument("--bc-epochs", type=int, default=None)
    ap.add_argument("--bc-exact-single", action="store_true",
                    help="train: one-row batches labelled by the exact single-sequence oracle")
    ap.add_argument("--guard-only", action="store_true", help="train: only (re)write the run's validation guard")
    ap.add_argument("--compare", default="", help="eval: more runs as name=folder,... (their unguarded policy; "
                    "name=folder:guarded: behind the run's batch_guard.json)")
    ap.add_argument("--runs", default="", help="summary: the runs (eval --run-name) to put side by side")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.phase != "prep":   # train / eval follow the drafter prep used
        meta = out / "prep.json"
        drafter = json.loads(meta.read_text())["settings"]["drafter"] if meta.is_file() else "draft"
        if args.drafter and args.drafter != drafter:
            raise SystemExit(f"{out} was prepared with --drafter {drafter}, not {args.drafter}")
        resolve(args, drafter)
    {"prep": prep, "train": train, "eval": evaluate, "summary": summary}[args.phase](args, out, batch_sizes)


if __name__ == "__main__":
    main()
