"""PPO training machinery for the depth and size policies (environment-agnostic: envs come from a factory).

    settings = settings_for("size", total_timesteps=100_000, seed=1)
    best_zip = train_policy(make_env, val_fn, settings, run_dir, "size_s1", logger=RunLogger(run_dir, cfg))
    write_policies_index(run_dir, depth=..., size=best_zip, depth_spec=..., size_spec=..., size_actions=...)

Run directory layout (shared with `specpilot.policies.ppo.load_run_controllers` and the exporter):
    run_dir/manifest.json                    config, seeds, package versions, models/hashes, per-stage status
    run_dir/<stage>/checkpoints/step_<n>.zip  SB3 model after n trained env steps (+ step_<n>_vecnormalize.pkl)
    run_dir/<stage>/checkpoints/progress.json the latest complete checkpoint: {"timesteps_done", ...}
    run_dir/<stage>/best.zip, best.json      the checkpoint best on validation ({"score", "timesteps", ...})
    run_dir/tb/, run_dir/wandb/              TensorBoard and wandb (offline) logs
    run_dir/policies.json                    which stage produced the final depth / size policies
"""
from __future__ import annotations

import copy
import dataclasses
import json
import platform
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

from specpilot.artifacts.policies import PoliciesIndex, PolicyEntry
from specpilot.artifacts.run import (BEST_JSON, BEST_ZIP, CHECKPOINTS_DIR, PROGRESS_FILE,  # noqa: F401
                                     RunManifest, read_best, write_record)
from specpilot.artifacts.run import read_progress as artifact_progress
from specpilot.drafting.errors import InputFileError
from specpilot.drafting.files import atomic_path
from specpilot.policies.observation import ObservationSpec
from specpilot.train.rl.logging import CycleMetricsCallback, RunLogger



class StageExistsError(FileExistsError):
    """A stage directory already has checkpoints and resuming was not asked for (`stage_dir` says which)."""

    def __init__(self, stage_dir: Path) -> None:
        self.stage_dir = Path(stage_dir)
        super().__init__(f"stage {stage_dir} already has checkpoints: pass resume=True to continue it, or use "
                         "another stage name / delete the directory to start over")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be resumed from (corrupted, or trained with different settings/spaces)."""


class ResumeSettingsError(CheckpointError):
    """A stage is resumed with settings other than those its checkpoint was trained with (nothing is loaded or
    written; the message names each changed setting with its saved and given value)."""


@dataclass
class WarmupLinearSchedule:
    """Learning rate as a function of SB3's progress_remaining (1 -> 0): linear warm-up from 0 to `peak` over the
    first `warmup_fraction` of training, then linear decay to 0 (the LTD paper's schedule). A class rather than a
    closure so checkpoints pickle it by reference."""

    peak: float
    warmup_fraction: float = 0.01

    def __call__(self, progress_remaining: float) -> float:
        progress = 1.0 - progress_remaining
        if self.warmup_fraction > 0 and progress < self.warmup_fraction:
            # floor at 1% of a warm-up step's worth so the very first update is not a no-op
            return self.peak * max(progress, 0.01 * self.warmup_fraction) / self.warmup_fraction
        return self.peak * max(0.0, 1.0 - progress) / max(1e-12, 1.0 - self.warmup_fraction)


@dataclass
class PPOSettings:
    """Hyper-parameters of one PPO stage (defaults: the LTD paper's; use `settings_for(kind)`)."""

    kind: str = "depth"
    """Which policy: "depth" (CONTINUE/STOP after each level) or "size" (verification size index)."""
    total_timesteps: int = 1_000_000
    """Budget in environment steps (paper: 1M for depth, 100k for size)."""
    pi_arch: list[int] = field(default_factory=lambda: [1024])
    """Hidden layers of the actor MLP (paper: depth [1024], size [1024, 256])."""
    vf_arch: list[int] = field(default_factory=lambda: [1024, 256])
    """Hidden layers of the value MLP (paper: [1024, 256] for both)."""
    gamma: float = 0.999
    """Discount (paper: 0.999 for depth so it does not stop prematurely; 0.9 for size)."""
    learning_rate: float = 1e-3
    """Peak learning rate of the warm-up-then-linear-decay schedule."""
    warmup_fraction: float = 0.01
    """Fraction of the budget spent warming the learning rate up from 0."""
    n_steps: int = 2048
    """Rollout length per environment between updates."""
    batch_size: int = 256
    """Minibatch size of each gradient step."""
    n_epochs: int = 20
    """Passes over each rollout."""
    ent_coef: float = 0.01
    """Entropy bonus coefficient."""
    gae_lambda: float = 0.95
    """GAE lambda (SB3 default)."""
    clip_range: float = 0.2
    """PPO clip range (SB3 default)."""
    n_envs: int = 1
    """Parallel environments (DummyVecEnv: one process; the decoder itself is the expensive part)."""
    normalize_reward: bool = True
    """Scale rewards by a running std of returns (VecNormalize); tokens/s rewards are O(10-1000) and would
    otherwise swamp the value loss. Inference is unaffected (observations are never normalised)."""
    seed: int = 0
    """Seed for SB3 (torch, numpy, env seeding)."""
    device: str = "cpu"
    """Torch device of the policy networks (tiny MLPs: "cpu" is usually fastest)."""
    checkpoint_every: int = 20_480
    """Save a resumable checkpoint at the first update boundary after this many env steps."""
    eval_every: int = 20_480
    """Call val_fn at the first update boundary after this many env steps; keep the best as best.zip."""
    keep_checkpoints: int = 3
    """How many recent checkpoints to keep on disk."""
    verbose: int = 0
    """SB3 verbosity."""

    def __post_init__(self) -> None:
        # what SB3's PPO asserts (a minibatch of one has no advantage spread to normalise), said before any work
        if self.batch_size < 2:
            raise ValueError(f"PPO batch_size must be at least 2 (SB3 normalises advantages over a minibatch), got "
                             f"{self.batch_size}")
        if self.n_steps * self.n_envs < 2:
            raise ValueError(f"PPO n_steps x n_envs must be at least 2 (one rollout step is no minibatch), got "
                             f"n_steps={self.n_steps}, n_envs={self.n_envs}")


_PAPER_DEFAULTS: dict[str, dict[str, Any]] = {
    "depth": dict(kind="depth", total_timesteps=1_000_000, pi_arch=[1024], vf_arch=[1024, 256], gamma=0.999),
    "size": dict(kind="size", total_timesteps=100_000, pi_arch=[1024, 256], vf_arch=[1024, 256], gamma=0.9),
}
# Settings that must match for a checkpoint to be resumable: every one that defines the training. The budget
# (total_timesteps) may change, as may the validation / checkpoint cadence, the device, verbosity and pruning.
# n_envs must match too, but only the built VecEnv knows it (Ray: one per worker), so train_policy compares it there
# (`check_resume_envs`), after building the VecEnv and before loading anything.
RESUME_KEYS = ("kind", "learning_rate", "warmup_fraction", "gamma", "n_steps", "batch_size", "n_epochs", "pi_arch",
               "vf_arch", "ent_coef", "gae_lambda", "clip_range", "normalize_reward", "seed")


def changed_settings(saved: dict, given: dict, keys) -> list[tuple[str, Any, Any]]:
    """(key, saved, given) for each of `keys` that `saved` records (older records lack some) with another value
    than `given` (tuples and lists compare alike: records are JSON)."""
    def norm(v):
        return [norm(x) for x in v] if isinstance(v, (list, tuple)) else v

    return [(k, saved[k], given.get(k)) for k in keys
            if k in saved and norm(saved[k]) != norm(given.get(k))]


def show_value(value: Any) -> str:
    """A setting as the command line writes it: lists comma-separated, None as "none"."""
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(show_value(v) for v in value)
    return str(value)


@dataclass
class PPOOverrides:
    """Changes to the paper's PPO settings (None: keep the default of `budget_settings`); see PPOSettings for the
    meaning of each field."""

    n_steps: int | None = None
    batch_size: int | None = None
    n_epochs: int | None = None
    pi_arch: list[int] | None = None
    vf_arch: list[int] | None = None
    gamma: float | None = None
    learning_rate: float | None = None
    ent_coef: float | None = None
    eval_every: int | None = None
    checkpoint_every: int | None = None

    def changes(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def settings_for(kind: str, **overrides) -> PPOSettings:
    """The paper's settings for a "depth" or "size" policy, with keyword overrides."""
    if kind not in _PAPER_DEFAULTS:
        raise ValueError(f"kind must be 'depth' or 'size', got {kind!r}")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(PPOSettings)}
    if unknown:
        raise TypeError(f"unknown PPOSettings fields: {sorted(unknown)}")
    return PPOSettings(**{**_PAPER_DEFAULTS[kind], **overrides})


# ---------------------------------------------------------------------------------------------------------------
# manifest and policies index


def library_versions() -> dict[str, str]:
    """Versions of Python and the libraries a run's numbers depend on (manifests, exports)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("specpilot", "torch", "transformers", "safetensors", "numpy", "gymnasium", "stable-baselines3"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def write_json(path: Path, data: dict) -> None:
    """Atomic write: a crash mid-write never leaves a truncated JSON file behind."""
    write_record(path, data)


def update_manifest(run_dir: str | Path, **sections: Any) -> dict:
    """Merge sections into run_dir/manifest.json (dict sections merge one level deep); always records versions.
    Typical sections: config=..., seeds=..., models={"target": {"name":..., "sha256":...}, ...}."""
    return RunManifest.update(run_dir, **sections, versions=library_versions()).data


def write_policies_index(
    run_dir: str | Path,
    depth: str | Path | None = None,
    size: str | Path | None = None,
    *,
    depth_spec: ObservationSpec | None = None,
    size_spec: ObservationSpec | None = None,
    size_actions: list[int] | None = None,
    fallback_depth: int | None = None,
    fallback_size: int | None = None,
) -> Path:
    """Record which policy zips are the run's final depth/size policies (read by load_run_controllers).
    `fallback_*` is the static config used for the part a single-policy controller does not decide."""
    run_dir = Path(run_dir)

    def rel(p: str | Path) -> str:
        p = Path(p)
        if not p.is_file():
            raise FileNotFoundError(f"policy file {p} does not exist")
        try:
            return str(p.resolve().relative_to(run_dir.resolve()))
        except ValueError:
            return str(p.resolve())

    index = PoliciesIndex(fallback=_fit_fallback(fallback_depth, fallback_size, depth_spec or size_spec))
    if depth is not None:
        if depth_spec is None or depth_spec.kind != "depth":
            raise ValueError("write_policies_index: a depth policy needs its depth ObservationSpec")
        index.depth = PolicyEntry(rel(depth), depth_spec.to_dict())
    if size is not None:
        if size_spec is None or size_spec.kind != "size" or not size_actions:
            raise ValueError("write_policies_index: a size policy needs its size ObservationSpec and size_actions")
        index.size = PolicyEntry(rel(size), size_spec.to_dict(), [int(v) for v in size_actions])
    return index.save(run_dir)


def _fit_fallback(depth: int | None, size: int | None, spec: ObservationSpec | None) -> dict:
    """The fallback as the policies' tree runs it: a static depth past its max_depth (the built-in (4, 12) on a
    shallow trace without a grid result) stops at max_depth in the decoder anyway, and reading policies.json refuses
    depths outside the tree (hand edits), so the index records the depth that runs and stays loadable. The size is
    kept as given (the decoder clips it to the tree's max_size, which the index does not record)."""
    if depth is not None and spec is not None:
        depth = min(int(depth), spec.max_depth)
    return {"depth": depth, "size": size}


# ---------------------------------------------------------------------------------------------------------------
# checkpoints


# a progress record's fields, as every checkpoint writes them (`_StageCallback`): a record without one, or with one
# of another type, was edited or damaged, and resuming from it would skip a check (the settings) or fail later
PROGRESS_FIELDS = {"timesteps_done": int, "checkpoint": str, "settings": dict}


def read_progress(stage_dir: str | Path) -> dict | None:
    """The latest checkpoint's progress record of a stage, or None when it has none; CheckpointError when it is
    damaged (unreadable, or a field missing or of another type)."""
    try:
        progress = artifact_progress(stage_dir)
    except InputFileError as err:  # truncated, garbage, or not a JSON object
        raise CheckpointError(str(err)) from None
    if progress is None:
        return None
    bad = [f"{k} {'missing' if k not in progress else 'is a ' + type(progress[k]).__name__}"
           for k, kind in PROGRESS_FIELDS.items()
           if not isinstance(progress.get(k), kind) or (kind is int and isinstance(progress[k], bool))]
    if progress.get("setup") is not None and not isinstance(progress["setup"], dict):  # (None: a stage without one)
        bad.append(f"setup is a {type(progress['setup']).__name__}")
    if bad:
        path = Path(stage_dir) / CHECKPOINTS_DIR / PROGRESS_FILE
        raise CheckpointError(f"{path} is damaged ({', '.join(bad)}): restore it, or delete {path.parent} to "
                              "restart the stage")
    return progress


class _StageCallback(BaseCallback):
    """Checkpoints and validation, both at update boundaries (rollout start): the weights then match
    `num_timesteps` exactly, so a resumed run neither repeats nor skips trained steps."""

    def __init__(self, stage_dir: Path, settings: PPOSettings, val_fn: Callable | None, run_logger: RunLogger | None,
                 stage: str, progress: dict | None, setup: dict | None = None) -> None:
        super().__init__(settings.verbose)
        self.setup = setup
        self.stage_dir = stage_dir
        self.ckpt_dir = stage_dir / "checkpoints"
        self.settings = settings
        self.val_fn = val_fn
        self.run_logger = run_logger
        self.stage = stage
        progress = progress or {}
        self.trained = int(progress.get("timesteps_done", 0))
        self.last_ckpt = self.trained
        self.last_eval = int(progress.get("last_eval", self.trained))
        # only a resumed stage inherits its best score: a fresh start must not be beaten by a stale best.json
        best = _read_best(stage_dir) if progress else None
        self.best_score = best.get("score") if best else None
        self._boundary_state: tuple[dict, dict] | None = None  # weights + optimiser while an update runs

    def _on_rollout_start(self) -> None:
        self.trained = self.num_timesteps
        self._boundary_state = None  # the previous update finished: the live weights are the boundary's again
        if self.num_timesteps - self.last_eval >= self.settings.eval_every:
            self.validate()
        if self.num_timesteps - self.last_ckpt >= self.settings.checkpoint_every:
            self.save_checkpoint()

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        # PPO's gradient update comes next and changes the weights epoch by epoch: keep the boundary's weights and
        # optimiser state, so a Ctrl-C inside the update checkpoints the policy that step `trained` labels
        # rather than a partly updated one (a resume redoes this rollout and its whole update)
        self._boundary_state = copy.deepcopy(self.model.policy.state_dict()), \
            copy.deepcopy(self.model.policy.optimizer.state_dict())

    def _on_training_end(self) -> None:
        self._boundary_state = None
        self.trained = self.num_timesteps
        if self.val_fn is not None and self.last_eval != self.num_timesteps:
            self.validate()
        self.save_checkpoint()

    def validate(self) -> None:
        self.last_eval = self.num_timesteps
        if self.val_fn is None:
            return
        score = float(self.val_fn(self.model))
        if self.run_logger is not None:
            self.run_logger.log({f"{self.stage}/val/score": score}, step=self.num_timesteps)
        if self.best_score is None or score > self.best_score:
            self.best_score = score
            self._save_best(score)

    def _save_best(self, score: float | None) -> None:
        save_atomically(self.model.save, self.stage_dir / BEST_ZIP)
        write_json(self.stage_dir / BEST_JSON, {"score": score, "timesteps": self.num_timesteps,
                                                   "stage": self.stage, "time": time.time()})

    def save_checkpoint(self) -> Path:
        """Save model (+ VecNormalize) at the last update boundary, then point progress.json at it."""
        done = self.trained
        model = self.model
        if self._boundary_state is not None:  # interrupted inside an update: roll it back
            weights, optimiser = self._boundary_state
            model.policy.load_state_dict(weights)
            model.policy.optimizer.load_state_dict(optimiser)
            self._boundary_state = None
        seen = model.num_timesteps
        model.num_timesteps = done  # an interrupted rollout's steps were never trained on: they are redone
        try:
            zip_path = self.ckpt_dir / f"step_{done:010d}.zip"
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            save_atomically(model.save, zip_path)
        finally:
            model.num_timesteps = seen
        vec_name = None
        vec_norm = model.get_vec_normalize_env()
        if vec_norm is not None:
            vec_name = f"step_{done:010d}_vecnormalize.pkl"
            save_atomically(vec_norm.save, self.ckpt_dir / vec_name)
        write_json(self.ckpt_dir / PROGRESS_FILE, {
            "timesteps_done": done, "total_timesteps": self.settings.total_timesteps,
            "checkpoint": zip_path.name, "vecnormalize": vec_name, "last_eval": self.last_eval,
            "settings": asdict(self.settings), "setup": self.setup, "time": time.time()})
        self.last_ckpt = done
        self._prune(keep=zip_path.name)
        return zip_path

    def _prune(self, keep: str) -> None:
        zips = sorted(self.ckpt_dir.glob("step_*.zip"))
        for old in zips[: max(0, len(zips) - self.settings.keep_checkpoints)]:
            if old.name != keep:
                old.unlink(missing_ok=True)
                old.with_name(old.stem + "_vecnormalize.pkl").unlink(missing_ok=True)


def save_atomically(save: Callable[[str], Any], path: Path) -> Path:
    """`save(temporary path)` writes the file beside `path`, which it then replaces in one step: a kill during the
    write (an SB3 zip of tens of MB takes a while) leaves the previous file whole, never a truncated one that a
    resume or a later load trips over. The temporary name keeps `path`'s suffix, so SB3 appends no ".zip"."""
    with atomic_path(path) as tmp:
        save(str(tmp))
    return path


def damaged_best(stage_dir: Path) -> str | None:
    """Why the stage's best.zip / best.json cannot stand as its best policy (one is damaged, or one lacks the
    other), or None when both are whole or both absent."""
    from specpilot.policies.ppo import PolicyLoadError, load_sb3_model

    zip_path, json_path = stage_dir / BEST_ZIP, stage_dir / BEST_JSON
    if not zip_path.exists() and not json_path.exists():
        return None
    if not zip_path.is_file():
        return f"{zip_path} is missing while {json_path} names its score"
    try:
        steps = int(load_sb3_model(zip_path).num_timesteps)
    except PolicyLoadError as err:
        return str(err).split(";")[0]
    record = _read_best(stage_dir)
    if record is None:
        return f"{json_path} is {'damaged' if json_path.exists() else 'missing'}: the score of {zip_path} is unknown"
    if record.get("timesteps") != steps:  # a kill between writing the zip and its record: the score is another's
        return f"{json_path} scores the policy of step {record.get('timesteps')}, but {zip_path} holds step {steps}"
    return None


def drop_damaged_best(stage_dir: Path) -> str | None:
    """Delete a damaged best.zip / best.json pair (`damaged_best`) before a resumed stage trains, so its validations
    re-establish the best from policies they actually scored (the best before the damage is lost: it cannot be
    rebuilt from a checkpoint of another step); the note to show, or None when the pair was whole."""
    why = damaged_best(stage_dir)
    if why is None:
        return None
    for name in (BEST_ZIP, BEST_JSON):
        (stage_dir / name).unlink(missing_ok=True)
    return (f"{why}: deleted {BEST_ZIP} and {BEST_JSON}; the resumed stage's validations choose its best again "
            "(the best validated before the damage is lost)")


def _read_best(stage_dir: Path) -> dict | None:
    return read_best(stage_dir)  # best.json is advisory (None when unreadable); a fresh validation rewrites it


def _make_venv(env_factory: Callable[[], gym.Env], n_envs: int) -> DummyVecEnv:
    return DummyVecEnv([lambda: Monitor(env_factory()) for _ in range(n_envs)])


def build_model(venv, settings: PPOSettings) -> PPO:
    return PPO(
        "MlpPolicy", venv,
        learning_rate=WarmupLinearSchedule(settings.learning_rate, settings.warmup_fraction),
        n_steps=settings.n_steps, batch_size=settings.batch_size, n_epochs=settings.n_epochs,
        gamma=settings.gamma, gae_lambda=settings.gae_lambda, clip_range=settings.clip_range,
        ent_coef=settings.ent_coef,
        policy_kwargs=dict(net_arch=dict(pi=list(settings.pi_arch), vf=list(settings.vf_arch))),
        seed=settings.seed, device=settings.device, verbose=settings.verbose,
    )


def _load_checkpoint(ckpt_dir: Path, progress: dict, venv: DummyVecEnv, settings: PPOSettings,
                     setup: dict | None = None):
    """(model, env) restored from the checkpoint progress.json points at; CheckpointError when impossible, a
    ResumeSettingsError (before anything loads) when `settings` or `setup` differ from the checkpoint's."""
    diffs = changed_settings(progress.get("settings") or {}, asdict(settings), RESUME_KEYS)
    saved_setup = progress.get("setup")
    if isinstance(saved_setup, dict) and setup is not None:
        diffs += changed_settings(saved_setup, setup, sorted(set(saved_setup) | set(setup)))
    if diffs:
        changes = "; ".join(f"{k} saved {show_value(a)}, given {show_value(b)}" for k, a, b in diffs)
        raise ResumeSettingsError(
            f"{ckpt_dir / PROGRESS_FILE} was written with other settings ({changes}): resume with the saved "
            "settings, or use a new stage name / run directory to train with the new ones (nothing was changed)")
    zip_path = ckpt_dir / str(progress.get("checkpoint"))
    if not zip_path.is_file():
        raise CheckpointError(f"checkpoint {zip_path} named in {PROGRESS_FILE} is missing: restore it, or delete "
                              f"{ckpt_dir} to restart the stage")
    env = venv
    if progress.get("vecnormalize"):
        vec_path = ckpt_dir / progress["vecnormalize"]
        try:
            env = VecNormalize.load(str(vec_path), venv)
        except AssertionError as err:  # SB3's check that the saved spaces are the environment's
            raise CheckpointError(f"VecNormalize statistics {vec_path} were saved for other observation / action "
                                  f"spaces than this stage's environment ({err}): it was trained with other settings "
                                  "(size actions, tree, observation features); resume with those, or train a new "
                                  "stage / run") from err
        except Exception as err:
            raise CheckpointError(f"VecNormalize statistics {vec_path} cannot be loaded ({type(err).__name__}: "
                                  f"{err}): restore the file or delete {ckpt_dir} to restart the stage") from err
    elif settings.normalize_reward:
        env = VecNormalize(venv, norm_obs=False, norm_reward=True, gamma=settings.gamma)
    try:
        try:
            model = PPO.load(zip_path, env=env, device=settings.device)
        except ImportError:  # its schedule was pickled under a module path that moved: rebuild it from settings
            schedule = WarmupLinearSchedule(settings.learning_rate, settings.warmup_fraction)
            model = PPO.load(zip_path, env=env, device=settings.device,
                             custom_objects={"learning_rate": schedule, "lr_schedule": 0.0})
    except Exception as err:
        # SB3 raises BadZipFile/EOFError on truncated files and ValueError on space mismatches
        raise CheckpointError(
            f"checkpoint {zip_path} cannot be resumed ({type(err).__name__}: {err}). If it is corrupted, delete it "
            f"and point {ckpt_dir / PROGRESS_FILE} at an earlier step_*.zip (or delete {ckpt_dir} to start over); "
            "if the environment's spaces changed, train a new stage instead of resuming") from err
    if int(model.num_timesteps) != int(progress["timesteps_done"]):
        raise CheckpointError(f"checkpoint {zip_path} holds {model.num_timesteps} steps but {PROGRESS_FILE} says "
                              f"{progress['timesteps_done']}: the directory is inconsistent; delete {ckpt_dir}")
    return model, env


def checkpoint_envs(ckpt_dir: Path, progress: dict) -> int | None:
    """How many environments the checkpoint was trained on: its SB3 zip's own n_envs (checkpoints of Ray training
    before 2026-12 recorded 1 in progress.json for 2 workers), else progress.json's; None when neither says."""
    try:
        with zipfile.ZipFile(ckpt_dir / str(progress.get("checkpoint"))) as archive:
            return int(json.loads(archive.read("data"))["n_envs"])
    except Exception:  # unreadable here: _load_checkpoint names the damaged zip
        saved = (progress.get("settings") or {}).get("n_envs")
        return saved if isinstance(saved, int) else None


def check_resume_envs(ckpt_dir: Path, progress: dict, n_envs: int) -> None:
    """ResumeSettingsError when the resume built another number of environments than the checkpoint trained on: PPO
    collects n_steps per environment between updates, so the rollout (and the training) would silently change."""
    saved = checkpoint_envs(ckpt_dir, progress)
    if saved is None or saved == n_envs:
        return
    raise ResumeSettingsError(
        f"{ckpt_dir / str(progress.get('checkpoint'))} was trained on {saved} environment{'s' * (saved != 1)}, this "
        f"resume runs {n_envs} (one per Ray worker with --ray, 1 without): resume with "
        f"{'--ray and --workers ' + str(saved) if saved > 1 else 'no --ray (or --ray with --workers 1)'}, as the "
        "stage was trained, or use a new stage name / run directory (nothing was changed)")


def check_stages_envs(run_dir: str | Path, stages: list[str], n_envs: int, steps: int | None = None) -> None:
    """`check_resume_envs` for each of `stages` that a resume would continue (a checkpoint, and not finished in the
    run's manifest, or finished short of a raised budget `steps`), before any environment is built: the CLI asks it
    before starting a Ray pool of n_envs workers, so a resume with another worker count is refused in a second
    rather than after the pool has loaded the models. Damaged records are left to the resume itself."""
    run_dir = Path(run_dir)
    try:
        manifest = RunManifest.load(run_dir)
        statuses = manifest.stages
    except (OSError, ValueError):
        statuses = {}
    for name in stages:
        stage_dir = run_dir / name
        if not (stage_dir / CHECKPOINTS_DIR).is_dir():
            continue
        try:
            progress = read_progress(stage_dir)
        except CheckpointError:
            continue
        finished = name in statuses and statuses[name].finished
        if progress is not None and finished and (steps is None or int(progress["timesteps_done"]) >= steps):
            continue  # skipped by the resume: its budget is met
        if progress is not None:
            check_resume_envs(stage_dir / CHECKPOINTS_DIR, progress, n_envs)


def _start_model(venv, settings: PPOSettings, ckpt_dir: Path, progress: dict | None, init_from,
                 setup: dict | None = None):
    """(model, env, steps done): the checkpoint's when resuming, else a new model (with `init_from`'s weights)."""
    if progress is not None:
        model, env = _load_checkpoint(ckpt_dir, progress, venv, settings, setup)
        return model, env, int(progress["timesteps_done"])
    env = VecNormalize(venv, norm_obs=False, norm_reward=True, gamma=settings.gamma) \
        if settings.normalize_reward else venv
    model = build_model(env, settings)
    if init_from is not None:
        _load_start_weights(model, init_from, settings.device)
    return model, env, 0


def _load_start_weights(model: PPO, init_from: str | Path, device: str) -> None:
    """`init_from`'s weights into the new model, or a PolicyLoadError naming the zip: unreadable, or networks of
    other shapes (`specpilot.train.rl.stages.check_init_policy` refuses those before a stage writes anything; this
    covers direct callers)."""
    from specpilot.policies.ppo import PolicyLoadError, load_sb3_model

    load_sb3_model(init_from)  # a damaged zip: PolicyLoadError naming it
    try:
        model.set_parameters(str(init_from), exact_match=True, device=device)
    except (RuntimeError, ValueError, KeyError) as err:  # torch's size mismatch, SB3's missing/extra parameters
        raise PolicyLoadError(f"policy file {init_from} cannot start this stage: its networks differ from the "
                              f"stage's ({' '.join(str(err).split())[:300]}); start from a policy of the same kind "
                              "trained on this tree, or train without init_from") from err


def train_policy(
    env_factory: Callable[[], gym.Env],
    val_fn: Callable[[PPO], float] | None,
    settings: PPOSettings,
    run_dir: str | Path,
    stage_name: str,
    resume: bool = False,
    logger: RunLogger | None = None,
    *,
    init_from: str | Path | None = None,
    callbacks: list[BaseCallback] | None = None,
    venv_factory: Callable[[], Any] | None = None,
    setup: dict | None = None,
) -> Path:
    """Train one PPO stage and return run_dir/<stage_name>/best.zip.

    env_factory: builds one training env (called n_envs times). val_fn(model) -> score to maximise (validation
    throughput; it should decide through PPOController so validation uses the inference code path); None keeps
    the final model as best. resume: continue from the stage's latest checkpoint (remaining budget = total - done;
    a larger total extends a finished stage; no checkpoint yet = fresh start); without it an existing stage with
    checkpoints is refused, never overwritten. init_from: start from another policy zip's weights (co-adaptation
    rounds; ignored when resuming). KeyboardInterrupt saves a checkpoint at the last update boundary, then
    propagates. Validation and checkpoints happen at update boundaries, so they fire at the first rollout end
    after every `eval_every` / `checkpoint_every` steps, and once more at the end. venv_factory: builds the
    VecEnv instead of DummyVecEnv over env_factory (e.g. `specpilot.train.scale.ray_vecenv.RayVecEnv`).
    setup: the stage's other defining settings (JSON values: reward, partners, ...; `specpilot.train.rl.stages`),
    recorded in every checkpoint's progress.json next to the PPO settings; resuming compares both (RESUME_KEYS)
    and refuses any change (ResumeSettingsError) before loading anything. A resumed stage says so in one line
    through `logger.note` when the logger has it (the CLI prints it).
    """
    run_dir = Path(run_dir)
    stage_dir = run_dir / stage_name
    ckpt_dir = stage_dir / "checkpoints"
    for folder in (stage_dir, ckpt_dir):  # said before any work, not as "[Errno 17] File exists" after it
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file, where stage {stage_name!r} keeps its checkpoints: move it "
                                     "away, or train into another --run folder")
    if callable(getattr(logger, "check_folders", None)):
        logger.check_folders()
    progress = read_progress(stage_dir)
    if progress is not None and not resume:
        raise StageExistsError(stage_dir)
    venv = venv_factory() if venv_factory is not None else _make_venv(env_factory, settings.n_envs)
    settings = dataclasses.replace(settings, n_envs=int(venv.num_envs))  # recorded as it runs (Ray: its workers)
    resumed = progress is not None
    try:
        if resumed:
            check_resume_envs(ckpt_dir, progress, settings.n_envs)
        model, env, done = _start_model(venv, settings, ckpt_dir, progress, init_from, setup)
    except BaseException:
        venv.close()
        raise
    if resumed and callable(getattr(logger, "note", None)):
        logger.note(f"{stage_name}: resuming {settings.kind} seed {settings.seed} from "
                    f"{ckpt_dir / str(progress.get('checkpoint'))} at step {done}")
    # before any training step (and after the settings check, which changes nothing when it refuses)
    dropped = drop_damaged_best(stage_dir) if resumed else None
    if dropped and callable(getattr(logger, "note", None)):
        logger.note(f"{stage_name}: {dropped}")
    stage_dir.mkdir(parents=True, exist_ok=True)  # only now: a stage that cannot start leaves no folder behind
    if logger is not None:
        model.set_logger(logger.sb3_logger(stage_name))
    else:  # SB3's default logger would create an SB3-<date> directory in the system temp dir on every learn()
        model.set_logger(Logger(folder=None, output_formats=[]))

    update_manifest(run_dir, stages={stage_name: {"settings": asdict(settings), "status": "running",
                                                  "timesteps_done": done, "init_from": str(init_from or "")}})
    stage_cb = _StageCallback(stage_dir, settings, val_fn, logger, stage_name, progress, setup)
    remaining = settings.total_timesteps - done
    if remaining > 0:
        cbs: list[BaseCallback] = [stage_cb, CycleMetricsCallback(logger, stage_name), *(callbacks or [])]
        try:
            model.learn(total_timesteps=remaining, callback=CallbackList(cbs), reset_num_timesteps=not resumed)
        except KeyboardInterrupt:
            path = stage_cb.save_checkpoint()
            update_manifest(run_dir, stages={stage_name: {"settings": asdict(settings), "status": "interrupted",
                                                          "timesteps_done": stage_cb.trained,
                                                          "checkpoint": str(path)}})
            raise
        finally:
            env.close()
    else:
        env.close()
    best = stage_dir / BEST_ZIP
    if val_fn is None or not best.is_file():
        if getattr(stage_cb, "model", None) is None:  # nothing left to train: the callback never ran
            stage_cb.init_callback(model)
            stage_cb.num_timesteps = model.num_timesteps  # (learn() would have set it) best.json's step
        if val_fn is None:
            stage_cb._save_best(None)
        else:  # a dropped damaged best and no validation since: the final policy is scored, never claimed unscored
            stage_cb.best_score = None
            stage_cb.validate()
    update_manifest(run_dir, stages={stage_name: {"settings": asdict(settings), "status": "done",
                                                  "timesteps_done": int(model.num_timesteps),
                                                  "best": _read_best(stage_dir)}})
    return best
