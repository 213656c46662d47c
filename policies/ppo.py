"""PPOController: trained SB3 depth/size policies as a deterministic Controller, and loading them from a run.

A policy decides through `Actor.from_sb3` (`Actor.decide`: numpy on copies of its actor weights taken when the
controller is built, so build the controller after training): SB3's `predict` adds numpy/space checks that cost more
than the tiny MLP itself, and the depth policy runs after every draft level.

Run directory contract (written by `specpilot.train.rl.ppo.write_policies_index`):
    run_dir/policies.json = {"depth": {"path": "<rel path to .zip>", "spec": {...}} | null,
                             "size":  {"path": ..., "spec": {...}, "size_actions": [...]} | null,
                             "fallback": {"depth": int, "size": int}}
"""
from __future__ import annotations

import zipfile
from pathlib import Path

from specpilot.artifacts.policies import POLICIES_FILE, TRAIN_FIX, PoliciesIndex
from specpilot.drafting.control import Controller, FixedController
from specpilot.policies.actor import Actor
from specpilot.policies.learned import CONTINUE, STOP, LearnedController  # noqa: F401 (re-exported)
from specpilot.policies.observation import ObservationSpec, default_size_actions


class PolicyLoadError(RuntimeError):
    """A policy file is missing, unreadable or does not match its recorded observation spec."""


def _eval_mode(policy):
    """Accept an SB3 algorithm (PPO) or its policy; return the policy in eval mode."""
    policy = getattr(policy, "policy", policy)
    policy.set_training_mode(False)
    return policy


class PPOController(LearnedController):
    """Depth from `depth_policy`, size from `size_policy` (SB3 policies or algorithms); whichever is None is decided
    by `fallback` (this gives the depth_only / size_only ablations)."""

    name = "ppo"
    label = "ppo"

    def __init__(self, depth_policy=None, size_policy=None, depth_spec: ObservationSpec | None = None,
                 size_spec: ObservationSpec | None = None, size_actions: list[int] | None = None,
                 fallback: Controller | None = None, *, name: str | None = None) -> None:
        # actors from what was given: an algorithm also brings its VecNormalize observation statistics
        depth_actor = Actor.from_sb3(depth_policy) if depth_policy is not None else None
        size_actor = Actor.from_sb3(size_policy) if size_policy is not None else None
        self.depth_policy = _eval_mode(depth_policy) if depth_policy is not None else None
        self.size_policy = _eval_mode(size_policy) if size_policy is not None else None
        if size_actor is not None and size_actions is None:
            size_actions = default_size_actions()
        super().__init__(depth_actor, size_actor, depth_spec, size_spec, size_actions, fallback, name=name)


# SB3 pickles the learning-rate schedule (a specpilot class) by its module path. Deciding never uses it, so it is not
# unpickled: a policy file stays loadable when that class moves (it did: train/ppo.py -> train/rl/ppo.py).
INFERENCE_OBJECTS = {"learning_rate": 0.0, "lr_schedule": 0.0}


SB3_MEMBERS = ("data", "policy.pth")  # what every SB3 PPO zip holds: its settings and spaces, the policy's weights
RESTORE = "retrain the stage that wrote it, or restore the file"


def _check_archive(path: Path) -> None:
    """Refuse a zip that lacks the members every SB3 PPO zip holds, naming them. A truncated zip whose cut falls
    inside an inner .pth (itself a zip) opens as that inner archive, and SB3 would then fail on its own assert."""
    with zipfile.ZipFile(path) as archive:
        missing = [name for name in SB3_MEMBERS if name not in archive.namelist()]
    if missing:
        names = " and ".join(repr(name) for name in missing)
        raise PolicyLoadError(f"policy file {path} is not a whole SB3 PPO zip (it lacks its {names} member"
                              f"{'s' if len(missing) > 1 else ''}: truncated, or not written by specpilot); {RESTORE}")


def load_sb3_model(path: str | Path, device: str = "cpu"):
    """The SB3 PPO model of a zip for deciding and scoring (not for resuming training: no schedule). Any failure
    to read the zip is a PolicyLoadError naming the file."""
    from stable_baselines3 import PPO

    path = Path(path)
    if not path.is_file():
        raise PolicyLoadError(f"policy file {path} does not exist: train the stage that writes it, or fix "
                              "policies.json to point at an existing best.zip")
    try:
        _check_archive(path)
        return PPO.load(path, device=device, custom_objects=INFERENCE_OBJECTS)
    except PolicyLoadError:
        raise
    except Exception as err:
        # the file is the only input here, and a damaged one fails anywhere inside zipfile, zlib, torch.load, the
        # JSON/pickle of SB3's "data" or SB3's own asserts: BadZipFile, EOFError, KeyError, AssertionError,
        # UnpicklingError, RuntimeError, ... all mean the same thing to the user
        raise PolicyLoadError(f"policy file {path} is corrupted or not an SB3 PPO zip ({type(err).__name__}: "
                              f"{' '.join(str(err).split())[:200]}); {RESTORE}") from err


def load_sb3_policy(path: str | Path, device: str = "cpu"):
    """Load the policy of an SB3 PPO zip; a clear PolicyLoadError naming the file when it is missing/corrupt."""
    return _eval_mode(load_sb3_model(path, device=device).policy)


def _read_index(run_dir: Path) -> PoliciesIndex:
    from specpilot.drafting.errors import InputFileError

    index_path = run_dir / POLICIES_FILE
    if not index_path.is_file():
        raise PolicyLoadError(f"{index_path} not found: this run has no final policies yet (train it first)")
    try:
        return PoliciesIndex.load(index_path, fix=TRAIN_FIX)
    except InputFileError as err:  # truncated, binary, not a JSON object, an entry without path / spec, a value
        # outside the policies' tree
        raise PolicyLoadError(str(err)) from None


class StaticSteps(FixedController):
    """What a policy set's switch gives when the static config measured faster than the policies at its
    temperature: that config (off_switch["static"], or `config`), under the policies' name, with the measurement in
    `describe()`."""

    def __init__(self, name: str, off_switch: dict, config: tuple[int, int] | None = None) -> None:
        depth, size = config if config is not None else (int(v) for v in off_switch["static"])
        super().__init__(depth, size)
        self.name, self.off_switch = name, dict(off_switch)

    def describe(self) -> dict:
        return {**super().describe(), "off_switch": self.off_switch}


class PlainSteps(StaticSteps):
    """What a policy set's off-switch gives: never draft (every cycle a plain target step), under the policies' name,
    with the measurement that switched them off in `describe()`."""

    def __init__(self, name: str, off_switch: dict) -> None:
        super().__init__(name, off_switch, config=(0, 0))


def load_run_controllers(run_dir: str | Path, device: str = "cpu", *,
                         off_switch: bool = True) -> dict[str, Controller]:
    """{"ltd": both policies, "depth_only": depth policy + fixed size, "size_only": fixed depth + size policy},
    from run_dir/policies.json; entries whose policies are absent are left out. An index whose `off_switch` says
    "plain_steps" (train/rl/sampled.py) gives `PlainSteps` controllers under the same names, one that names a
    "static" config `StaticSteps` controllers, unless `off_switch` is False (the policies themselves, as the
    off-switch check measures them). A run with RUN/batch_guard.json also
    gives "ltd_guarded" (`load_batch_guard`: the deployed batch-aware controller)."""
    run_dir = Path(run_dir)
    index = _read_index(run_dir)
    fb = index.fallback
    fallback = FixedController(fb.get("depth"), fb.get("size"))
    parts: dict[str, tuple] = {}
    try:
        if index.depth:
            parts["depth"] = (load_sb3_policy(run_dir / index.depth.path, device),
                              ObservationSpec.from_dict(index.depth.spec), None)
        if index.size:
            parts["size"] = (load_sb3_policy(run_dir / index.size.path, device),
                             ObservationSpec.from_dict(index.size.spec), list(index.size.size_actions))
    except (KeyError, TypeError, ValueError) as err:
        raise PolicyLoadError(f"{run_dir / POLICIES_FILE}: {err}") from err

    def make(use_depth: bool, use_size: bool, name: str) -> PPOController:
        d, s = parts["depth"] if use_depth else None, parts["size"] if use_size else None
        try:
            return PPOController(d[0] if d else None, s[0] if s else None, d[1] if d else None, s[1] if s else None,
                                 s[2] if s else None, fallback=fallback, name=name)
        except ValueError as err:
            raise PolicyLoadError(f"{run_dir / POLICIES_FILE}: {err}") from err

    out: dict[str, Controller] = {}
    if "depth" in parts and "size" in parts:
        out["ltd"] = make(True, True, "ltd")
    if "depth" in parts:
        out["depth_only"] = make(True, False, "depth_only")
    if "size" in parts:
        out["size_only"] = make(False, True, "size_only")
    if not out:
        raise PolicyLoadError(f"{run_dir / POLICIES_FILE} names neither a depth nor a size policy")
    switch = index.off_switch or {}
    if off_switch and switch.get("plain_steps"):  # measured no faster than plain target steps (train/rl/sampled.py)
        return {name: PlainSteps(name, switch) for name in out}
    if off_switch and switch.get("static"):  # the static config measured faster than the policies
        return {name: StaticSteps(name, switch) for name in out}
    guard = load_batch_guard(run_dir, out["ltd"]) if "ltd" in out else None
    if guard is not None:  # the deployed batch-aware controller: the table where the policy lost on validation
        out["ltd_guarded"] = guard
    return out


BATCH_GUARD_FILE = "batch_guard.json"
BATCH_GUARD_VERSION = 1


def load_batch_guard(run_dir: str | Path, learned: Controller) -> Controller | None:
    """`learned` wrapped in the run's validation guard (RUN/batch_guard.json, `train/rl/validation.batch_guard`:
    the per-batch-size table decides at the batch sizes where the policy lost to it), or None without one."""
    from specpilot.artifacts.common import load_object
    from specpilot.policies.heuristics import BatchGuardController

    path = Path(run_dir) / BATCH_GUARD_FILE
    if not path.is_file():
        return None
    try:
        data = load_object(path, what="batch guard", fix="train the run again with --batch-sizes",
                           version=BATCH_GUARD_VERSION)
        return BatchGuardController.from_dict(learned, data)
    except (KeyError, TypeError, ValueError) as err:
        raise PolicyLoadError(f"{path}: {err}") from err
