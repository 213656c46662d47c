"""The LTD training pipeline end to end, and the evaluation of a trained run (the `specpilot train` CLI and the demo
call these):

    traces = record_traces(pair, "runs/r1/traces", train_prompts=..., val_prompts=...)   # train/rl/traces.py
    grid = grid_search(traces.train, pair=pair, val_prompts=..., out="runs/r1/grid.json")  # train/grid/search.py
    out = run_pipeline("runs/r1", traces, size_steps=20_000, depth_steps=40_000, rounds=3)
    controllers = load_run_controllers("runs/r1")                  # ltd / depth_only / size_only

Stages: `train_size` / `train_depth` (stage 1, train/rl/stages.py), `coadapt` (stage 2, train/rl/coadapt.py),
`reward_ablation` (train/rl/ablation.py). Run directory (besides `specpilot.train.rl.ppo`'s layout):
    RUN/traces/{train,validation}/   trace.npz, trace.json, profile.json, ar.json
    RUN/grid.json, RUN/grid.png      the static baseline; its best fixes the partners
    RUN/size_s1, RUN/depth_s1        stage 1;   RUN/co1_size, RUN/co2_depth, RUN/co3_size ... stage 2
    RUN/policies.json                final (co-adapted) depth + size policies; fallback = the static config
    RUN/stage1/policies.json         the stage-1 policies
    RUN/bc_size, RUN/bc_depth, RUN/bc/   with options.bc_iters: stage 1 cloned from the replay oracle (train/rl/imitation.py)
    RUN/ablation/ablation.json       reward ablation
    RUN/batch_guard.json             with batch_sizes: per batch size, learned or the grid table (validation guard)
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

from specpilot.artifacts.policies import POLICIES_FILE
from specpilot.artifacts.run import MANIFEST_FILE
from specpilot.drafting.control import Controller, FixedController
from specpilot.drafting.folder_lock import holds_output
from specpilot.envs.replay import ReplayModel
from specpilot.train.rl.ablation import reward_ablation  # noqa: F401 (part of the pipeline's API)
from specpilot.train.rl.coadapt import coadapt, coadapt_stages, write_index, write_stage1_index
from specpilot.train.rl.stages import (StageResult, TaskTraces, TrainOptions, budget_settings,  # noqa: F401
                                    run_logger, static_config, train_depth, train_size)
from specpilot.train.rl.traces import record_traces  # noqa: F401
from specpilot.train.rl.validation import evaluate_replay, replay_ar


@holds_output("run_dir", what="run folder")
def run_pipeline(run_dir: str | Path, traces: TaskTraces | str | Path, *, size_steps: int = 20_000,
                 depth_steps: int = 40_000, coadapt_steps: int | Sequence[int] = 10_000, rounds: int = 3,
                 size_actions: Sequence[int] | None = None, depth_range: tuple[int, int] | None = None,
                 options: TrainOptions | None = None, wandb: str | None = None, logger=None) -> dict:
    """Stage 1 (size, depth) + RUN/stage1/policies.json, then `rounds` of co-adaptation (0: stage 1 only, in
    which case RUN/policies.json points at the stage-1 policies). Returns the StageResults and index paths.

    options.batch_sizes with a per-batch-size grid table (RUN/grid.json from `specpilot grid --batch-sizes`): the
    validation guard RUN/batch_guard.json is written last (`validation.write_batch_guard`; "ltd_guarded").

    options.bc_iters > 0: stage 1 is behaviour cloning of both policies from the replay oracle with that many DAgger
    iterations (`specpilot.train.rl.imitation`, `options.bc_epochs` supervised epochs each) instead of PPO from
    scratch (size_steps / depth_steps are then unused); co-adaptation fine-tunes the cloned policies with PPO."""
    run_dir, options = Path(run_dir), options or TrainOptions()
    check_outputs(pipeline_outputs(run_dir, rounds=rounds, bc=options.bc_iters > 0, batch=bool(options.batch_sizes)))
    config = {"pipeline": True, "size_steps": size_steps, "depth_steps": depth_steps, "coadapt_steps": coadapt_steps,
              "rounds": rounds, "reward": options.reward, "seed": options.seed, "bc_iters": options.bc_iters}
    if options.resume:  # stage 1 as it was trained (cloned or PPO, the same cloning), before any work
        from specpilot.train.rl.imitation import check_imitation_resume, imitation_settings

        check_imitation_resume(run_dir, options, imitation_settings(options) if options.bc_iters > 0 else None)
    with run_logger(run_dir, logger, wandb, config) as log:
        if options.bc_iters > 0:
            from specpilot.train.rl.imitation import imitate, imitation_settings

            bc = imitate(run_dir, traces, size_actions=size_actions, options=options, logger=log,
                         settings=imitation_settings(options))
            size1, depth1 = bc["size"], bc["depth"]
        else:
            with _budget_option("--size-steps"):
                size1 = train_size(run_dir, traces, steps=size_steps, size_actions=size_actions,
                                   depth_range=depth_range, options=options, logger=log)
            with _budget_option("--depth-steps"):
                depth1 = train_depth(run_dir, traces, steps=depth_steps, options=options, logger=log)
            if rounds > 0 and not options.allow_partial:
                for res, option, budget in ((size1, "--size-steps", size_steps),
                                            (depth1, "--depth-steps", depth_steps)):
                    _check_finished(run_dir, res.stage, option, budget)
        stage1 = write_stage1_index(run_dir, depth1, size1, options.static)
        final = None
        if rounds > 0:
            with _budget_option("--coadapt-steps"):
                final = coadapt(run_dir, traces, rounds=rounds, steps=coadapt_steps, options=options, logger=log,
                                size_stage=size1.stage, depth_stage=depth1.stage)
            policies = final["policies"]
        else:
            policies = write_index(run_dir, depth1, size1, static_config(run_dir, options.static), copy=False)
        guard = _guard(run_dir, traces, options) if options.batch_sizes else None
    return {"batch_guard": guard, "size_s1": size1.to_dict(), "depth_s1": depth1.to_dict(), "stage1_policies": stage1,
            **({"imitation": bc["iterations"]} if options.bc_iters > 0 else {}),
            "coadapt": final, "policies": policies}


def stage_outputs(run_dir: str | Path, stages: Sequence[str]) -> dict[Path, str]:
    """{path: "dir" | "file"} of what training `stages` writes: each stage's folder, the run's manifest and
    TensorBoard folder."""
    run_dir = Path(run_dir)
    return {run_dir / MANIFEST_FILE: "file", run_dir / "tb": "dir", **{run_dir / s: "dir" for s in stages}}


def coadapt_outputs(run_dir: str | Path, rounds: int) -> dict[Path, str]:
    """What `coadapt` writes: its stages (co1_size, co2_depth, ...) and RUN/policies.json."""
    stages = [stage for _, stage in coadapt_stages(rounds)]
    return {**stage_outputs(run_dir, stages), Path(run_dir) / POLICIES_FILE: "file"}


def pipeline_outputs(run_dir: str | Path, *, rounds: int, bc: bool = False, batch: bool = False) -> dict[Path, str]:
    """What `run_pipeline` writes: stage 1 (PPO stages, or the cloned stages and RUN/bc/), RUN/stage1/ with its index
    and copied zips, co-adaptation and RUN/policies.json (and the batch guard)."""
    from specpilot.train.rl.imitation import BC_DEPTH_STAGE, BC_DIR, BC_SIZE_STAGE

    run_dir = Path(run_dir)
    first = [BC_SIZE_STAGE, BC_DEPTH_STAGE, BC_DIR] if bc else ["size_s1", "depth_s1"]
    out = {**stage_outputs(run_dir, first), **coadapt_outputs(run_dir, rounds), run_dir / "stage1": "dir",
           **{run_dir / "stage1" / name: "file" for name in (POLICIES_FILE, "depth.zip", "size.zip")}}
    if bc:
        out.update({run_dir / BC_DIR / name: "file" for name in (POLICIES_FILE, "imitation.json", "depth.zip",
                                                                  "size.zip")})
    if batch:
        out[run_dir / "batch_guard.json"] = "file"
    return out


def check_outputs(outputs: dict[Path, str]) -> None:
    """Every folder and file a train command will write can take it, checked before any work (OutputPathError,
    one line): a file where a stage folder goes, or a folder where an index goes, used to be found only when the
    stages before it had trained (some as raw [Errno] text)."""
    from specpilot.drafting.files import check_outputs as check_paths

    check_paths(outputs, fix="move it away, or train into a new --run folder (nothing was trained)",
                what="run output")


@contextmanager
def _budget_option(option: str):
    """A stage resumed past its budget is refused naming the pipeline's option for that budget (not --steps)."""
    from specpilot.train.rl.stages import BudgetPassedError

    try:
        yield
    except BudgetPassedError as err:
        raise err.naming(option) from None


def _check_finished(run_dir: Path, stage: str, option: str, budget: int) -> None:
    """Co-adaptation builds on finished stage-1 stages only. A stage-1 stage that a resumed pipeline skipped because
    its checkpoint already reached a smaller budget than it was started with is still unfinished: refused here,
    naming the pipeline's own budget option (this command has no --allow-partial; `allow_partial` lets library
    callers build on it)."""
    from specpilot.artifacts.contract import ContractError, check_stage_finished
    from specpilot.artifacts.run import RunManifest

    try:
        check_stage_finished(run_dir, stage)
    except ContractError:
        status = RunManifest.load(run_dir).stage(stage)
        total = status.total_timesteps
        started = f"the {total} steps it was started with" if total else "the budget it was started with"
        raise ContractError(
            f"stage {stage!r} of {run_dir} is {status.status} ({status.timesteps_done}/{total or '?'} steps): "
            f"{option} {budget} stops it short of {started}, and co-adaptation builds only on finished stages; "
            f"finish it with --resume and {option} {total or 'as large as it was started with'}"
            f"{' (or more)' if total else ''}") from None


def _guard(run_dir: Path, traces, options: TrainOptions) -> dict | None:
    """The validation guard of a batch-aware run (`validation.write_batch_guard`) against the grid's per-batch-size
    table (RUN/grid.json or options.static as a grid path, from `specpilot grid --batch-sizes`); None without one."""
    from specpilot.artifacts.grid import GRID_FILE, GridResult
    from specpilot.policies.ppo import load_run_controllers
    from specpilot.train.rl.stages import batch_profile_for
    from specpilot.train.rl.validation import write_batch_guard

    grid = Path(options.static) if isinstance(options.static, (str, Path)) else run_dir / GRID_FILE
    rows = GridResult.load(grid).per_batch_size if grid.is_file() else []
    if not rows:
        return None
    traces = TaskTraces.resolve(traces)
    table = {int(r["batch_size"]): (int(r["depth"]), int(r["size"])) for r in rows}
    profile = batch_profile_for(run_dir, ReplayModel(traces.train).trace, options)
    return write_batch_guard(run_dir, load_run_controllers(run_dir)["ltd"], table, traces.validation,
                             options.batch_sizes, profile=profile)


def evaluate_run(run_dir: str | Path, traces: TaskTraces | str | Path, *, split: str = "validation",
                 static: tuple[int, int] | str | Path | None = None, include_stage1: bool = True) -> dict:
    """Replay tokens/s (+ speedup, tau, mean depth/size) on the `split` trace of: the static config, each
    controller of RUN/policies.json (ltd, depth_only, size_only), the stage-1 ones (prefixed `s1_`), and the
    replay oracle over the same actions."""
    from specpilot.envs.oracle import replay_oracle
    from specpilot.policies.ppo import load_run_controllers
    from specpilot.train.rl.stages import size_actions_for

    run_dir = Path(run_dir)
    model = ReplayModel(getattr(TaskTraces.resolve(traces), split))
    ar = replay_ar(model)
    static_cfg = static_config(run_dir, static)
    out: dict[str, dict] = {"static": {**evaluate_replay(FixedController(*static_cfg), model, ar["tokens_per_s"]),
                                       "config": list(static_cfg)}}
    sets = [("", run_dir)] + ([("s1_", run_dir / "stage1")] if include_stage1 else []) + \
        ([("bc_", run_dir / "bc")] if (run_dir / "bc" / "policies.json").is_file() else [])
    size_actions = None
    for prefix, d in sets:
        if (d / POLICIES_FILE).is_file():
            for name, ctrl in load_run_controllers(d).items():
                out[prefix + name] = evaluate_replay(ctrl, model, ar["tokens_per_s"])
                size_actions = size_actions or getattr(ctrl, "size_actions", None)
    oracle = replay_oracle(model, sizes=size_actions or size_actions_for(model, None))
    for key, name in (("oracle", "oracle"), ("best_static", "replay_best_static")):
        out[name] = {**oracle[key], "speedup": oracle[key]["tokens_per_s"] / ar["tokens_per_s"]}
    out["ar"] = ar
    return out


def evaluate_live(pair, controllers: dict[str, Controller], prompts: Sequence, *, tree, max_new_tokens: int = 64,
                  repeats: int = 1, warmup: int = 1, progress: bool = False) -> dict:
    """Live tokens/s of each controller and of autoregressive decoding on `prompts`, measured by the evaluation
    runner's interleaved loop and clock (`specpilot.eval.runner.measure_controllers`).
    Returns {name: {tokens_per_s, speedup, mean_accepted_length, policy_overhead, depth_mean, size_mean, ...}}."""
    from specpilot.eval.runner import measure_controllers

    return measure_controllers(pair, controllers, prompts, tree=tree, max_new_tokens=max_new_tokens,
                               repeats=repeats, warmup=warmup, progress=progress)
