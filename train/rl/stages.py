"""Stage 1 of LTD: train one PPO policy (size or depth) against a partner (`train_size`, `train_depth`).

Everything trains on REPLAY by default (`ReplaySource`: exact accepted lengths from a trace of the training task,
times from its latency profile); `TrainOptions(backend="live")` trains on the live decoder instead (wall-clock
rewards; with `init_from=` it fine-tunes a replay-trained policy; with `temperature > 0` on sampled decoding, which
replay cannot model). Validation is always replay on the trace of the *validation* prompts, deciding through
`PPOController` (the inference code path): higher tokens/s is better.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from functools import partial
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specpilot.artifacts.contract import (RunContract, check_grid, check_pair, check_profile_belongs,
                                         check_stage_finished, record_contract)
from specpilot.artifacts.grid import GRID_FILE, GridResult
from specpilot.artifacts.run import BEST_ZIP, MANIFEST_FILE, RunManifest, read_best
from specpilot.artifacts.trace import TraceHeader
from specpilot.drafting.control import Controller, FixedController
from specpilot.drafting.folder_lock import holds_output
from specpilot.drafting.types import TreeConfig
from specpilot.envs.replay import ReplayModel
from specpilot.policies.observation import (BATCH_FEATURES, DEFAULT_FEATURES, DEFAULT_SIZE_FEATURES, ObservationSpec,
                                            default_size_actions)
from specpilot.train.rl.ppo import PPOOverrides
from specpilot.train.rl.traces import TaskTraces
from specpilot.train.rl.validation import validation_fn

REWARD_MODES = ("throughput", "acceptance", "time", "dinkelbach")
STATIC_FALLBACK = (4, 12)
STATIC_FALLBACK_DICT = {"depth": STATIC_FALLBACK[0], "size": STATIC_FALLBACK[1]}


@dataclass
class TrainOptions:
    """Settings every stage of a run shares.

    reward: environment reward (`specpilot.envs.rewards`); "dinkelbach" optimises long-run tokens/s.
    backend: "replay" (trace + profile, fast, greedy) or "live" (the real decoder, wall-clock rewards).
    pair / train_prompts / temperature: the live backend's models, prompts (default: the trace's prompts) and
        sampling temperature. cluster: a `specpilot.train.scale.cluster.WorkerPool`: with the live backend, one
        environment per Ray worker on the worker's own pair (`specpilot.train.scale.ray_vecenv.RayVecEnv`).
    static: the static baseline (depth, size), a grid.json path, or None for RUN/grid.json; it fixes the partners.
    skip_decisions: the depth policy also decides, before drafting, whether to draft at all.
    resume: continue interrupted stages; finished stages are skipped. seed: base seed of every stage.
    max_context: context length mapped to 1.0 in the observations. ppo: changes to the paper's PPO settings.
    allow_partial: later stages may start from an earlier stage that did not finish (interrupted); refused otherwise.
    bc_iters / bc_epochs: > 0 makes the pipeline's stage 1 behaviour cloning from the replay oracle with that many
        DAgger iterations of bc_epochs supervised epochs (`specpilot.train.rl.imitation`); PPO then fine-tunes.
    batch_sizes: train a batch-aware policy (replay backend): every episode replays a batch of a size drawn
        from these (`ReplaySource(batch_sizes=...)`), rewarded on the batch's throughput, observing the batch
        features (`policies.observation.BATCH_FEATURES`); validation scores the geometric mean speedup over batched
        AR across these sizes. batch_profile: the profile with batch curves (default: RUN/grid.profile_w<W>.json,
        which `specpilot grid --batch-sizes` saves, else the trace's own). With bc_iters, behaviour cloning labels
        batch states with the per-batch oracle (`imitation.BatchOracleLabels`; bc_exact_single: one-row batches by
        the exact single-sequence oracle) before PPO fine-tunes.
    """

    reward: str = "dinkelbach"
    backend: str = "replay"
    pair: Any = None
    cluster: Any = None
    train_prompts: Sequence | None = None
    temperature: float = 0.0
    static: tuple[int, int] | str | Path | None = None
    skip_decisions: bool = True
    resume: bool = False
    seed: int = 0
    max_context: int = 4096
    ppo: PPOOverrides = field(default_factory=PPOOverrides)
    allow_partial: bool = False
    bc_iters: int = 0
    bc_epochs: int = 30
    bc_exact_single: bool = False
    batch_sizes: tuple[int, ...] | None = None
    batch_profile: str | Path | None = None

    def __post_init__(self) -> None:
        if self.batch_sizes is not None:
            self.batch_sizes = tuple(sorted({int(b) for b in self.batch_sizes}))
            if not self.batch_sizes or self.batch_sizes[0] < 1:
                raise ValueError(f"batch_sizes must be sizes >= 1, got {list(self.batch_sizes)}")
            if self.backend != "replay":
                raise ValueError("batch_sizes trains on batch replay: use backend='replay'")
        if self.reward not in REWARD_MODES:
            raise ValueError(f"unknown reward {self.reward!r}; choose one of {REWARD_MODES}")
        if self.backend not in ("replay", "live"):
            raise ValueError(f"backend must be 'replay' or 'live', got {self.backend!r}")
        if self.backend == "live" and self.pair is None and self.cluster is None:
            raise ValueError("backend='live' needs pair= (the models to decode with) or cluster= (a WorkerPool)")
        if self.bc_iters < 0 or self.bc_epochs < 1:
            raise ValueError(f"bc_iters must be >= 0 and bc_epochs >= 1, got {self.bc_iters}, {self.bc_epochs}")


def budget_settings(kind: str, steps: int, *, seed: int = 0, ppo: PPOOverrides | None = None):
    """The paper's PPOSettings for `kind`, scaled to a small budget, then `ppo`'s changes.

    With `steps` below 8 paper rollouts (8 x 2048), n_steps shrinks to the power of two giving >= 8 updates
    (>= 64), batch_size to min(256, n_steps) and n_epochs to 10 (below 4096 steps); eval/checkpoint cadence
    defaults to ~10 validations per stage.
    """
    from specpilot.train.rl.ppo import settings_for

    changes = (ppo or PPOOverrides()).changes()
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n_steps = changes.pop("n_steps", None)
    if n_steps is None:
        n_steps = 2048 if steps >= 8 * 2048 else max(64, 2 ** int(np.floor(np.log2(max(steps / 8, 1)))))
    batch = changes.pop("batch_size", None) or min(256, n_steps)
    epochs = changes.pop("n_epochs", None) or (20 if steps >= 4096 else 10)
    every = max(n_steps, (steps // 10) // n_steps * n_steps)
    base = dict(total_timesteps=steps, n_steps=int(n_steps), batch_size=int(batch), n_epochs=int(epochs), seed=seed,
                eval_every=every, checkpoint_every=every)
    base.update(changes)
    return settings_for(kind, **base)


@dataclass
class StageResult:
    """What one training stage produced (returned by train_size / train_depth, collected by coadapt)."""

    stage: str
    kind: str
    best: Path
    spec: ObservationSpec
    size_actions: list[int] | None
    score: float | None
    skipped: bool = False
    validation: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["best"], d["spec"] = str(self.best), self.spec.to_dict()
        return d


def static_config(run_dir: str | Path, static: tuple[int, int] | str | Path | None = None) -> tuple[int, int]:
    """(depth >= 1, size >= 1) of the static config that partners and backs up the policies: `static` itself, a
    grid.json path, RUN/grid.json, else (4, 12). From a grid whose best cell never drafts (depth 0: plain steps
    won), its best drafting cell."""
    if isinstance(static, (tuple, list)):
        if int(static[0]) < 1 or int(static[1]) < 1:
            raise ValueError(f"static={tuple(static)}: the static partner config must draft (depth >= 1, size >= 1)")
        return int(static[0]), int(static[1])
    path = Path(static) if static is not None else Path(run_dir) / GRID_FILE
    if path.is_file():
        best = GridResult.load(path).static_cell() or STATIC_FALLBACK_DICT
        return int(best["depth"]), int(best["size"])
    if static is not None:
        raise FileNotFoundError(f"grid result {path} not found: run `specpilot grid` or pass static=(depth, size)")
    warnings.warn(f"no grid result at {path} and no static=(depth, size): using {STATIC_FALLBACK}; run "
                  "`specpilot grid` first for the real baseline", stacklevel=3)
    return STATIC_FALLBACK


def check_tree_options(trace, *, static=None, size_actions: Sequence[int] | None = None,
                       depth_range: Sequence[int] | None = None) -> None:
    """Values given for the tree that the training trace cannot replay are refused, naming the value and the
    trace's range (they used to be capped or dropped without a word)."""
    where = f"the training trace was recorded to depth {trace.max_depth} with max_size {trace.max_size}"
    if isinstance(static, (tuple, list)) and (int(static[0]) > trace.max_depth or int(static[1]) > trace.max_size):
        raise ValueError(f"--static {int(static[0])},{int(static[1])}: {where}; give DEPTH in 1..{trace.max_depth} and "
                         f"SIZE in 1..{trace.max_size}")
    beyond = [int(v) for v in size_actions or () if int(v) > trace.max_size]
    if beyond:
        raise ValueError(f"--size-actions {','.join(map(str, beyond))}: {where}; give sizes in 1..{trace.max_size}")
    if depth_range is not None and int(depth_range[1]) > trace.max_depth:
        raise ValueError(f"--depth-range {int(depth_range[0])},{int(depth_range[1])}: {where}; give depths in "
                         f"1..{trace.max_depth}")


def stage_result(run_dir: str | Path, stage: str, *, allow_partial: bool = False) -> StageResult:
    """A finished stage's StageResult, rebuilt from the manifest (kind, spec, size actions) and best.json; an
    interrupted or running stage is refused (ContractError) unless `allow_partial`."""
    run_dir = Path(run_dir)
    best = run_dir / stage / BEST_ZIP
    if not best.is_file():
        raise FileNotFoundError(f"{best} not found: train stage {stage!r} first (stage 1: `specpilot train size` "
                                "and `specpilot train depth`)")
    manifest = RunManifest.load(run_dir)
    setup = manifest.stage_setup(stage)
    if setup is None:
        raise FileNotFoundError(f"{run_dir / MANIFEST_FILE} has no setup for stage {stage!r}: was it trained by "
                                "specpilot.train?")
    check_stage_finished(run_dir, stage, allow_partial=allow_partial)
    info = read_best(run_dir / stage) or {}
    return StageResult(stage, setup["kind"], best, ObservationSpec.from_dict(setup["spec"]), setup.get("size_actions"),
                       info.get("score"))


def load_partner(kind: str, path: str | Path, spec: ObservationSpec, *, size_actions: Sequence[int] | None = None,
                 fallback: Controller | None = None) -> Controller:
    """A frozen policy zip as a Controller deciding `kind` (the rest by `fallback`)."""
    from specpilot.policies.ppo import PPOController, load_sb3_policy

    policy = load_sb3_policy(path)
    if kind == "depth":
        return PPOController(policy, None, depth_spec=spec, fallback=fallback, name="frozen_depth")
    return PPOController(None, policy, size_spec=spec, size_actions=list(size_actions), fallback=fallback,
                         name="frozen_size")


@dataclass
class StageSpec:
    """One PPO stage: what it trains, against whom, and where it starts from.

    kind: "size" or "depth". stage: sub-folder of the run. steps: budget in environment steps.
    partner: the Controller deciding the other half during training; val_partner: during validation.
    size_actions: the size policy's choices (size stages; clipped to the trace's max_size).
    init_from: a policy zip to start from (co-adaptation); keep_init_if_better: the starting policy competes in
    validation too, so a round never hands on a policy worse than the one it started from.
    """

    kind: str
    stage: str
    steps: int
    partner: Controller
    val_partner: Controller
    size_actions: Sequence[int] | None = None
    init_from: str | Path | None = None
    keep_init_if_better: bool = False
    seed_offset: int = 0
    setup: dict = field(default_factory=dict)
    """Settings of this stage's partner that define its training besides TrainOptions (JSON values, e.g.
    {"depth_range": [1, 4]}): recorded in its checkpoints and compared on resume (`check_resume_settings`)."""


def size_actions_for(model: ReplayModel, size_actions: Sequence[int] | None) -> list[int]:
    """The size actions a policy chooses among on this trace: `size_actions` (default: the trace device's) that fit
    its max size, or just the max size."""
    return fit_size_actions(size_actions, model.trace.max_size, model.trace.header.get("device"))


def fit_size_actions(size_actions: Sequence[int] | None, max_size: int, device: str | None = None) -> list[int]:
    """`size_actions` (default: `device`'s) that fit `max_size`, or just `max_size` (`size_actions_for` on a trace
    header, for checks that read no arrays)."""
    acts = [int(v) for v in (size_actions or default_size_actions(device))]
    return [v for v in acts if v <= max_size] or [int(max_size)]


def stage_observation(kind: str, width: int, max_depth: int, actions: Sequence[int] | None, *,
                      max_context: int = TrainOptions.max_context, batch: bool = False) -> ObservationSpec:
    """The observation spec a `kind` stage's policy is trained on (size: over `actions`; batch: with the batch
    features of batch-aware training)."""
    features = DEFAULT_FEATURES + (BATCH_FEATURES if batch else ())
    if kind == "size":
        return ObservationSpec.for_size(width, max_depth, size_actions=list(actions), max_context=max_context,
                                        features=features + DEFAULT_SIZE_FEATURES)
    return ObservationSpec.for_depth(width, max_depth, max_context=max_context, features=features)


def make_env(source, spec: StageSpec, actions, *, reward: str, max_context: int, skip_decisions: bool):
    from specpilot.envs.environments import DepthEnv, SizeEnv

    if spec.kind == "size":
        return SizeEnv(source, reward=reward, size_actions=actions, depth_controller=spec.partner,
                       max_context=max_context)
    return DepthEnv(source, reward=reward, size_controller=spec.partner, max_context=max_context,
                    skip_decisions=skip_decisions)


def batch_profile_for(run_dir: str | Path, trace, options: TrainOptions):
    """The latency profile batch training replays with: options.batch_profile, else RUN/grid.profile_w<W>.json
    (saved by `specpilot grid --batch-sizes`) when present, else None (the trace's own profile)."""
    if options.batch_profile is not None:
        check_profile_belongs(trace, options.batch_profile, given=f"--batch-profile {options.batch_profile}",
                              fix="measure batch sizes with the trace's pair and tree (`specpilot grid "
                                  "--batch-sizes ...` on this trace saves <stem>.profile_w<W>.json)")
        return options.batch_profile
    saved = Path(run_dir) / f"{Path(GRID_FILE).stem}.profile_w{trace.width}.json"
    if not saved.is_file():
        return None
    check_profile_belongs(trace, saved, given=f"the run's batch profile {saved}",
                          fix="run `specpilot grid --batch-sizes ...` on this run's traces again, or give "
                              "--batch-profile FILE")
    return saved


def _live_env(pair, *, prompts, tree, max_new_tokens, temperature, spec, actions, **env_settings):
    """One live training environment on `pair` (a module-level function: Ray workers build it with their pair)."""
    from specpilot.envs.environments import LiveSource

    source = LiveSource(pair, prompts, tree=tree, max_new_tokens=max_new_tokens, temperature=temperature)
    return make_env(source, spec, actions, **env_settings)


def _env_factories(spec: StageSpec, traces: TaskTraces, model: ReplayModel, actions, options: TrainOptions,
                   profile=None):
    """(a function building one training environment, a VecEnv factory or None): replay environments here (batches
    with options.batch_sizes, timed by `profile`), live ones here on options.pair or one per Ray worker on
    options.cluster."""
    from functools import partial

    from specpilot.envs.environments import ReplaySource

    trace = model.trace
    settings = dict(reward=options.reward, max_context=options.max_context, skip_decisions=options.skip_decisions)
    if options.backend == "replay":
        return (lambda: make_env(ReplaySource(traces.train, profile, batch_sizes=options.batch_sizes), spec,
                                 actions, **settings)), None
    prompts = list(options.train_prompts) if options.train_prompts is not None else \
        [trace.prompt(i) for i in range(trace.num_prompts)]
    tree = TreeConfig(width=trace.width, max_depth=trace.max_depth, max_size=trace.max_size)
    env_fn = partial(_live_env, prompts=prompts, tree=tree, max_new_tokens=trace.max_new_tokens,
                     temperature=options.temperature, spec=spec, actions=actions, **settings)
    if options.cluster is None:
        return (lambda: env_fn(options.pair)), None
    from specpilot.train.scale.ray_vecenv import RayVecEnv

    return (lambda: env_fn(options.pair)), (lambda: RayVecEnv(options.cluster, env_fn))


def _finished(run_dir: Path, spec: StageSpec, obs_spec, actions, total: int) -> StageResult | None:
    """The stage's result when it already finished a budget >= total (a resumed pipeline skips it): the policy its
    recorded selection chose (`stage_selection`), else its best.zip with no `validation` (a stage that keeps its
    starting policy when better then makes that choice again: `_reselect`)."""
    from specpilot.train.rl.ppo import damaged_best, read_progress

    stage_dir = run_dir / spec.stage
    progress = read_progress(stage_dir) if (stage_dir / "checkpoints").is_dir() else None
    best = read_best(stage_dir)
    if not (progress and int(progress["timesteps_done"]) >= total and (stage_dir / BEST_ZIP).is_file()
            and best is not None):
        return None
    if damaged_best(stage_dir) is not None:  # not finished after all: train_policy scores its final policy again
        return None
    selection = RunManifest.load(run_dir).stage_selection(spec.stage)
    chosen = recorded_policy(run_dir, selection.get("final"))
    if chosen is not None:
        return StageResult(spec.stage, spec.kind, chosen, obs_spec, actions, selection.get("score"), skipped=True,
                           validation=selection)
    return StageResult(spec.stage, spec.kind, stage_dir / BEST_ZIP, obs_spec, actions, best.get("score"),
                       skipped=True)


def run_relative(path: str | Path, run_dir: str | Path) -> str:
    """`path` as the manifest records it: relative to the run folder when inside it (a run folder may be copied,
    moved, or used from another working directory), else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path(run_dir).resolve()))
    except ValueError:
        return str(path)


def recorded_policy(run_dir: str | Path, stored: str | None) -> Path | None:
    """A policy path the manifest recorded, as a file of this run (`run_dir / ...`): run-relative as recorded now,
    or an older manifest's absolute or working-directory-relative path that still names a file inside this run.
    None otherwise: a path into another run (this one was copied or moved) must never be deployed from here."""
    if not stored:
        return None
    run_dir, stored = Path(run_dir), Path(stored)
    root = run_dir.resolve()
    for candidate in ([stored] if stored.is_absolute() else [run_dir / stored, stored]):
        if not candidate.is_file():
            continue
        try:
            return run_dir / candidate.resolve().relative_to(root)
        except ValueError:
            continue
    return None


CONTRACT_FIX = "use the run's own traces / grid, or train into a new --run folder"


def _traces_contract(traces: TaskTraces, size_actions) -> RunContract:
    """The contract the traces make (their pair, tree, ...); ContractError when the splits have different pairs."""
    train, val = TraceHeader.load(traces.train), TraceHeader.load(traces.validation)
    check_pair(train.pair, val.pair, expected_from=f"the training trace {traces.train}",
               got_from=f"the validation trace {traces.validation}", fix="record both splits with one pair")
    return RunContract.from_traces(train, val, size_actions=size_actions,
                                   paths={"train": traces.train, "validation": traces.validation})


def _check_contract(run_dir: Path, traces: TaskTraces, size_actions) -> None:
    """Traces that do not belong to the run are refused naming the traces' tree / pair and the run's (ContractError),
    writing nothing: a resumed stage checks this before its settings, since a tree's defaults (the depth range)
    follow the traces and would otherwise be blamed on options never given."""
    recorded = RunContract.of_run(RunManifest.load(run_dir))
    if recorded is not None:
        recorded.check(_traces_contract(traces, size_actions), run=f"run {run_dir} (manifest.json)",
                       given=f"traces {traces.train}", fix=CONTRACT_FIX)


def _record_contract(run_dir: Path, traces: TaskTraces, size_actions, static) -> None:
    """Refuse traces (and a grid result) that do not belong to the run (ContractError naming both sides); record the
    run's contract when it has none yet."""
    fix = CONTRACT_FIX
    contract = _traces_contract(traces, size_actions)
    recorded = record_contract(run_dir, contract, given=f"traces {traces.train}", fix=fix)
    grid = Path(static) if isinstance(static, (str, Path)) else Path(run_dir) / GRID_FILE
    if grid.is_file():
        check_grid(GridResult.load(grid), recorded, grid_from=f"grid result {grid}", run=f"run {run_dir}", fix=fix)


class BudgetPassedError(ValueError):
    """Resuming a stage whose checkpoint is already at or past the budget. The message names `--steps`; `naming`
    makes the same error naming the option that sets the stage's budget elsewhere (`train all`: --size-steps, ...)."""

    stage, done, total = "", 0, 0

    @classmethod
    def of(cls, stage: str, done: int, total: int, option: str = "--steps") -> "BudgetPassedError":
        err = cls(f"{stage}: its checkpoint is already at {done} steps, at or past the budget of {total}: give a "
                  f"larger {option} to continue it (nothing was trained)")
        err.stage, err.done, err.total = stage, done, total
        return err

    def naming(self, option: str) -> "BudgetPassedError":
        return BudgetPassedError.of(self.stage, self.done, self.total, option)


def check_resume_budget(stage_dir: Path, total: int, *, resume: bool) -> None:
    """Resuming a stage whose checkpoint already passed the budget would train nothing (and never validate): refuse
    it, naming the checkpoint's step count (BudgetPassedError); unless its best policy is damaged, when validating
    the final policy is what the resume has left to do."""
    from specpilot.train.rl.ppo import read_progress

    from specpilot.train.rl.ppo import damaged_best

    progress = read_progress(stage_dir) if resume else None
    if progress is not None and int(progress.get("timesteps_done", 0)) >= total:
        if damaged_best(stage_dir) is not None:  # the budget is spent but its best is damaged: train_policy trains
            return                               # nothing and validates the final policy, which is what is left
        raise BudgetPassedError.of(stage_dir.name, int(progress["timesteps_done"]), total)


# ---------------------------------------------------------------------------------------------------------------
# resuming: the settings that define a stage's training must be the ones its checkpoint was trained with

# the option (or, for settings the command line does not set, the TrainOptions / PPOSettings field) of each
RESUME_OPTIONS = {"learning_rate": "--lr", "gamma": "--gamma", "n_steps": "--n-steps", "batch_size": "--batch-size",
                  "n_epochs": "--n-epochs", "pi_arch": "--pi-arch", "vf_arch": "--vf-arch", "ent_coef": "--ent-coef",
                  "seed": "--seed", "reward": "--reward", "backend": "--backend", "static": "--static",
                  "depth_range": "--depth-range", "size_actions": "--size-actions", "batch_sizes": "--batch-sizes",
                  "init_from": "--init-from"}
# scaled from the budget when not given (`budget_settings`): a resumed stage keeps its checkpoint's instead, so
# a larger --steps continues it
BUDGET_DERIVED = ("n_steps", "batch_size", "n_epochs")


def stage_setup_record(spec: StageSpec, run_dir: Path, options: TrainOptions, actions) -> dict:
    """The settings besides PPO's that define a stage's training (JSON values), as its checkpoints record them."""
    with warnings.catch_warnings():  # the stage's caller already warned about a missing grid result
        warnings.simplefilter("ignore")
        static = static_config(run_dir, options.static)
    # relative to the run when inside it: run directories can move
    init_from = None if spec.init_from is None else run_relative(spec.init_from, run_dir)
    return {"kind": spec.kind, "reward": options.reward, "backend": options.backend,
            "temperature": float(options.temperature), "static": [int(v) for v in static],
            "size_actions": [int(v) for v in actions] if spec.kind == "size" else None,
            "batch_sizes": list(options.batch_sizes) if options.batch_sizes else None,
            "max_context": int(options.max_context), "skip_decisions": bool(options.skip_decisions),
            "init_from": init_from, **spec.setup}


def _saved_setup(run_dir: Path, stage: str, progress: dict) -> dict:
    """The stage settings its checkpoint was trained with: progress.json's record, or for checkpoints written before
    it existed what the manifest's stage setup recorded (reward, backend, size actions, depth range, ...)."""
    if isinstance(progress.get("setup"), dict):
        return progress["setup"]
    setup = RunManifest.load(run_dir).stage_setup(stage) or {}
    saved = {k: setup[k] for k in ("kind", "reward", "backend", "temperature", "size_actions") if k in setup}
    if setup:
        saved["batch_sizes"] = setup.get("batch_sizes") or None
    partner = setup.get("partner")
    if isinstance(partner, dict) and partner.get("name") == "random_depth" and {"low", "high"} <= set(partner):
        saved["depth_range"] = [partner["low"], partner["high"]]
    return saved


def check_resume_settings(run_dir: Path, spec: StageSpec, progress: dict, settings, setup: dict):
    """A ResumeSettingsError, before anything is loaded or written, when a stage resumes with `settings` (PPO's) or
    `setup` (`stage_setup_record`) other than its checkpoint's (`progress`): it names every changed setting by its
    option with the saved and the given value. Settings that may change: the budget, the validation / checkpoint
    cadence, the device (and what is no setting of the stage: wandb, threads, logging)."""
    from specpilot.train.rl.ppo import RESUME_KEYS, ResumeSettingsError, changed_settings, show_value

    stage_dir = run_dir / spec.stage
    changes = changed_settings(progress.get("settings") or {}, asdict(settings), RESUME_KEYS)
    saved_setup = _saved_setup(run_dir, spec.stage, progress)
    changes += changed_settings(saved_setup, setup, sorted(k for k in saved_setup if k != "kind"))
    if not changes:
        return
    offset = {"seed": spec.seed_offset}  # a stage's seed is the run's --seed plus its offset

    def show(key, value):
        return show_value(value - offset[key] if key in offset and isinstance(value, int) else value)

    listed = "; ".join(f"{RESUME_OPTIONS.get(k, k)} saved {show(k, a)}, given {show(k, b)}" for k, a, b in changes)
    checkpoint = stage_dir / "checkpoints" / str(progress.get("checkpoint"))
    raise ResumeSettingsError(f"cannot resume stage {stage_dir} with changed settings ({listed}): its checkpoint "
                              f"{checkpoint} was trained with the saved values; resume with those, or start a new "
                              "--run to train with the new ones (nothing was changed)")


def keep_budget_derived(settings, progress: dict, ppo: PPOOverrides | None):
    """`settings` with the checkpoint's n_steps / batch_size / n_epochs where `ppo` does not give them: they scale
    with the budget when not given, and a resumed stage may be given a larger one."""
    saved = progress.get("settings") or {}
    keep = {k: saved[k] for k in BUDGET_DERIVED if k in saved and getattr(ppo, k, None) is None}
    return replace(settings, **keep) if keep else settings


def policy_shape(path: str | Path) -> dict:
    """{"observations", "actions", "pi", "vf"} of an SB3 policy zip: its observation size, number of actions and
    (actor, value) hidden layers (PolicyLoadError naming a missing or damaged zip)."""
    import torch

    from specpilot.policies.ppo import load_sb3_policy

    policy = load_sb3_policy(path)
    extractor = policy.mlp_extractor
    return {"observations": int(np.prod(policy.observation_space.shape)), "actions": int(policy.action_space.n),
            "pi": [m.out_features for m in extractor.policy_net if isinstance(m, torch.nn.Linear)],
            "vf": [m.out_features for m in extractor.value_net if isinstance(m, torch.nn.Linear)]}


def check_init_policy(init_from: str | Path, kind: str, obs_spec: ObservationSpec, actions: Sequence[int] | None,
                      ppo: PPOOverrides | None = None) -> tuple[list[int], list[int]]:
    """The (actor, value) layers of a `kind` stage that starts from `init_from` (observing `obs_spec`, choosing
    among `actions` for size), after checking the zip fits it: a policy of the other kind, or of another tree, size
    actions or observation features, is refused naming both shapes (its weights cannot load), as are layers given
    in `ppo` that differ from its own. Called before a stage writes anything."""
    shape = policy_shape(init_from)
    n_actions = len(actions) if kind == "size" else 2  # depth: CONTINUE / STOP
    if (shape["observations"], shape["actions"]) != (obs_spec.dim, n_actions):
        depth_dim = stage_observation("depth", obs_spec.width, obs_spec.max_depth, None,
                                      batch=bool(set(obs_spec.features) & set(BATCH_FEATURES))).dim
        theirs = ("depth" if (shape["observations"], shape["actions"]) == (depth_dim, 2)
                  else "size" if shape["actions"] != 2 else "other")
        what = "a depth or size" if theirs == "other" else f"a {theirs}"
        fix = (f"start from a {kind} policy trained on this tree (e.g. RUN/{kind}_s1/best.zip)"
               if theirs != kind else f"it was trained on another tree{', size actions' if kind == 'size' else ''} "
               "or observation features: start from a policy trained for this stage's trace")
        raise ValueError(f"--init-from {init_from}: it is {what} policy ({shape['actions']} actions, "
                         f"{shape['observations']} observations), this stage trains a {kind} policy ({n_actions} "
                         f"actions, {obs_spec.dim} observations) on width {obs_spec.width}, max_depth "
                         f"{obs_spec.max_depth}: {fix}, or train without --init-from")
    _check_init_tree(init_from, obs_spec)
    return _given_arch(init_from, kind, shape["pi"], shape["vf"], ppo)


def _tree_of(spec: ObservationSpec) -> str:
    return f"width {spec.width}, max_depth {spec.max_depth}, max_context {spec.max_context}"


def _check_init_tree(init_from: str | Path, obs_spec: ObservationSpec) -> None:
    """A starting policy whose run records it observing another tree is refused naming both trees: the observations
    scale depths by max_depth (and contexts by max_context), so equal shapes (same width) do not make its weights
    read this stage's observations as it learned them. A zip with no record (outside a run) is taken on its shapes."""
    found = recorded_spec(init_from)
    if found is None:
        return
    theirs, where = found
    if _tree_of(theirs) != _tree_of(obs_spec):
        raise ValueError(f"--init-from {init_from}: it was trained observing a tree of {_tree_of(theirs)} ({where}); "
                         f"this stage's trace is {_tree_of(obs_spec)}: start from a policy trained on this tree, or "
                         "train without --init-from")


def recorded_spec(policy: str | Path) -> tuple[ObservationSpec, str] | None:
    """(the observation spec a policy zip was trained on, where that is recorded), from its run: the manifest's stage
    setup for RUN/<stage>/best.zip, or a policies.json beside the zip or in its run that names it; None without
    one."""
    from specpilot.artifacts.policies import POLICIES_FILE, PoliciesIndex
    from specpilot.artifacts.run import owning_run

    path = Path(policy).resolve()
    run = owning_run(path)
    if run is not None and path.name == BEST_ZIP and path.parent.parent == run:
        setup = RunManifest.load(run).stage_setup(path.parent.name) or {}
        if isinstance(setup.get("spec"), dict):
            return ObservationSpec.from_dict(setup["spec"]), f"stage {path.parent.name} of {run / MANIFEST_FILE}"
    for folder in dict.fromkeys(f for f in (path.parent, run) if f is not None):
        if not (folder / POLICIES_FILE).is_file():
            continue
        index = PoliciesIndex.load(folder)
        for entry in (index.depth, index.size):
            if entry is not None and (folder / entry.path).resolve() == path:
                return ObservationSpec.from_dict(entry.spec), str(folder / POLICIES_FILE)
    return None


def start_arch(init_from: str | Path, kind: str, ppo: PPOOverrides | None = None) -> tuple[list[int], list[int]]:
    """The (actor, value) layers of a stage that starts from `init_from`: the starting policy's. Layers given in
    `ppo` that differ are refused before any work, naming both (its weights cannot load into them)."""
    shape = policy_shape(init_from)
    return _given_arch(init_from, kind, shape["pi"], shape["vf"], ppo)


def _given_arch(init_from: str | Path, kind: str, pi: list[int], vf: list[int],
                ppo: PPOOverrides | None) -> tuple[list[int], list[int]]:
    """(pi, vf), the starting policy's layers, unless `ppo` gives others (refused, naming both)."""
    given = {"pi_arch": getattr(ppo, "pi_arch", None), "vf_arch": getattr(ppo, "vf_arch", None)}
    for name, theirs in (("pi_arch", pi), ("vf_arch", vf)):
        if given[name] is not None and list(given[name]) != theirs:
            option = "--" + name.replace("_", "-")
            raise ValueError(f"{option} {','.join(map(str, given[name]))}: the {kind} stage starts from "
                             f"{init_from}, whose {option} is {','.join(map(str, theirs))}; give that (or leave "
                             f"{option} out to use it), or train without a starting policy")
    return pi, vf


def _describe(partner: Any) -> Any:
    return partner.describe() if isinstance(partner, Controller) else str(partner)


def train_stage(spec: StageSpec, run_dir: str | Path, traces: TaskTraces | str | Path, options: TrainOptions,
                logger=None) -> StageResult:
    """Train (or resume, or skip when finished) one stage; returns its best policy by validation."""
    from specpilot.train.rl.ppo import read_progress, train_policy, update_manifest

    run_dir, traces = Path(run_dir), TaskTraces.resolve(traces)
    model = ReplayModel(traces.train)
    trace = model.trace
    profile = batch_profile_for(run_dir, trace, options) if options.batch_sizes else None
    actions = size_actions_for(model, spec.size_actions) if spec.kind == "size" else None
    obs_spec = stage_observation(spec.kind, trace.width, trace.max_depth, actions, max_context=options.max_context,
                                 batch=bool(options.batch_sizes))
    settings = budget_settings(spec.kind, spec.steps, seed=options.seed + spec.seed_offset, ppo=options.ppo)
    if spec.init_from is not None:  # its weights load into the networks built here: the same shapes and layers
        pi, vf = check_init_policy(spec.init_from, spec.kind, obs_spec, actions, options.ppo)
        settings = replace(settings, pi_arch=pi, vf_arch=vf)
    setup = stage_setup_record(spec, run_dir, options, actions)
    progress = read_progress(run_dir / spec.stage) if options.resume else None
    if progress is not None:  # resuming: the same settings as its checkpoint, before anything is loaded or written
        _check_contract(run_dir, traces, actions if spec.kind == "size" else None)
        settings = keep_budget_derived(settings, progress, options.ppo)
        check_resume_settings(run_dir, spec, progress, settings, setup)
    validate = partial(_stage_validation, spec, traces, obs_spec, actions, options, logger, profile)
    if options.resume and (done := _finished(run_dir, spec, obs_spec, actions, settings.total_timesteps)):
        return _reselect(done, spec, validate, run_dir)
    check_resume_budget(run_dir / spec.stage, settings.total_timesteps, resume=options.resume)
    val = validate()
    _record_contract(run_dir, traces, actions if spec.kind == "size" else None, options.static)
    update_manifest(run_dir, traces={"train": str(traces.train), "validation": str(traces.validation),
                                     "train_pair": trace.header.get("pair")},
                    seeds={spec.stage: settings.seed},
                    stage_setup={spec.stage: {"kind": spec.kind, "backend": options.backend, "reward": options.reward,
                                              "cluster": options.cluster is not None,
                                              "temperature": options.temperature,
                                              "partner": _describe(spec.partner),
                                              "val_partner": _describe(spec.val_partner), "size_actions": actions,
                                              "spec": obs_spec.to_dict(), "init_from": str(spec.init_from or ""),
                                              **({"batch_sizes": list(options.batch_sizes),
                                                  "batch_profile": str(profile or "")}
                                                 if options.batch_sizes else {})}})
    make_env, make_venv = _env_factories(spec, traces, model, actions, options, profile)
    best = train_policy(make_env, val, settings, run_dir, spec.stage, resume=options.resume, logger=logger,
                        init_from=spec.init_from, venv_factory=make_venv, setup=setup)
    info = read_best(run_dir / spec.stage) or {}
    result = StageResult(spec.stage, spec.kind, best, obs_spec, actions, info.get("score"))
    if spec.init_from is not None and spec.keep_init_if_better and val is not None:
        result = _keep_init_if_better(result, spec, val, run_dir)
    return result


def _stage_validation(spec: StageSpec, traces: TaskTraces, obs_spec, actions, options: TrainOptions, logger,
                      profile):
    """The stage's validation function; None at temperature > 0 (replay validation models greedy decoding only: such
    a stage keeps its final policy)."""
    if options.temperature != 0:
        return None
    return validation_fn(traces.validation, kind=spec.kind, spec=obs_spec, partner=spec.val_partner,
                         size_actions=actions, logger=logger, stage=spec.stage, batch_sizes=options.batch_sizes,
                         profile=profile)


def _reselect(done: StageResult, spec: StageSpec, validate, run_dir: Path) -> StageResult:
    """A finished stage that keeps its starting policy when better, but whose choice never reached the manifest (the
    process died between its last checkpoint and the record, or the recorded path is not inside this run): the
    choice is made again, as the uninterrupted run made it, so a resumed run deploys the same policy."""
    if done.validation or spec.init_from is None or not spec.keep_init_if_better:
        return done
    val = validate()
    if val is None:
        return done
    chosen = _keep_init_if_better(done, spec, val, run_dir)
    chosen.skipped = True  # nothing was trained
    return chosen


def _keep_init_if_better(result: StageResult, spec: StageSpec, val, run_dir: Path) -> StageResult:
    # validation only runs after training steps: the starting policy itself competes too
    from specpilot.policies.ppo import load_sb3_model
    from specpilot.train.rl.ppo import update_manifest

    init_score = val(load_sb3_model(spec.init_from), step=0)  # the stage's step 0: it starts from this policy
    result.validation = {"init_score": init_score, "stage_best_score": result.score}
    if result.score is None or init_score > result.score:
        result = StageResult(spec.stage, spec.kind, Path(spec.init_from), result.spec, result.size_actions,
                             init_score, validation={**result.validation, "kept_init": True})
    update_manifest(run_dir, stage_selection={spec.stage: {**result.validation,
                                                           "final": run_relative(result.best, run_dir),
                                                           "score": result.score}})
    return result


@contextmanager
def run_logger(run_dir, logger, wandb: str | None, config: dict):
    """`with run_logger(...) as log:` an explicit logger is used as is (its owner closes it); otherwise a RunLogger
    for `run_dir`, closed when the block ends, however it ends."""
    if logger is not None:
        yield logger
        return
    from specpilot.train.rl.logging import RunLogger

    log = RunLogger(run_dir, config, mode=wandb)
    try:
        yield log
    finally:
        log.close()


@holds_output("run_dir", what="run folder")
def train_size(run_dir: str | Path, traces: TaskTraces | str | Path, *, steps: int = 20_000,
               depth_partner: Any = None, depth_range: tuple[int, int] | None = None,
               size_actions: Sequence[int] | None = None, stage: str = "size_s1",
               init_from: str | Path | None = None, options: TrainOptions | None = None, wandb: str | None = None,
               logger=None) -> StageResult:
    """Stage 1 size policy: PPO against random depths in `depth_range` (default 1..max_depth), or `depth_partner`
    (an int depth, a (low, high) pair, a Controller). Validation: the static depth (options.static) with the
    policy choosing sizes, on the validation trace."""
    from specpilot.envs.environments import as_depth_controller

    options = options or TrainOptions()
    traces = TaskTraces.resolve(traces)
    depth, _ = static_config(run_dir, options.static)
    trace = ReplayModel(traces.train).trace
    max_depth = trace.max_depth
    check_tree_options(trace, static=options.static, size_actions=size_actions, depth_range=depth_range)
    if depth_partner is None:
        depth_partner = tuple(int(v) for v in (depth_range or (1, max_depth)))
    partner = as_depth_controller(depth_partner)
    setup = ({"depth_range": [int(v) for v in depth_partner]} if isinstance(depth_partner, (tuple, list))
             else {"depth_partner": _describe(partner)})
    spec = StageSpec("size", stage, steps, partner=partner,
                     val_partner=FixedController(depth=min(depth, max_depth), size=1), size_actions=size_actions,
                     init_from=init_from, setup=setup)
    with run_logger(run_dir, logger, wandb, {"stage": stage, "kind": "size", "steps": steps}) as log:
        return train_stage(spec, run_dir, traces, options, log)


@holds_output("run_dir", what="run folder")
def train_depth(run_dir: str | Path, traces: TaskTraces | str | Path, *, steps: int = 40_000,
                size_partner: Any = None, stage: str = "depth_s1", init_from: str | Path | None = None,
                options: TrainOptions | None = None, wandb: str | None = None, logger=None) -> StageResult:
    """Stage 1 depth policy: PPO with the verification size fixed at the static config's (the paper uses EAGLE-3's
    60 on GPU), or `size_partner` (an int size or a Controller). Validated with the same partner."""
    from specpilot.envs.environments import as_size_controller

    options = options or TrainOptions()
    _, size = static_config(run_dir, options.static)
    check_tree_options(ReplayModel(TaskTraces.resolve(traces).train).trace, static=options.static)
    partner = as_size_controller(size_partner if size_partner is not None else size)
    spec = StageSpec("depth", stage, steps, partner=partner, val_partner=partner, init_from=init_from,
                     setup={} if size_partner is None else {"size_partner": _describe(partner)})
    with run_logger(run_dir, logger, wandb, {"stage": stage, "kind": "depth", "steps": steps}) as log:
        return train_stage(spec, run_dir, traces, options, log)
