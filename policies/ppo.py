"""PPOController: trained SB3 depth/size policies as a deterministic Controller, and loading them from a run.

The policies run their actor network directly (features -> mlp_extractor.forward_actor -> action_net -> argmax)
under torch.inference_mode: SB3's `predict` adds numpy/space checks that cost more than the tiny MLP itself,
and the depth policy runs after *every* draft level. Observations come from `specpilot.envs.observation`, the
same functions the training environments use.

Run directory contract (written by `specpilot.train.ppo.write_policies_index`):
    run_dir/policies.json = {"depth": {"path": "<rel path to .zip>", "spec": {...}} | null,
                             "size":  {"path": ..., "spec": {...}, "size_actions": [...]} | null,
                             "fallback": {"depth": int, "size": int}}
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import torch

from specpilot.envs.observation import ObservationSpec, default_size_actions
from specpilot.policies.base import Controller, FixedController
from specpilot.policies.learned import CONTINUE, STOP, LearnedController, numpy_actor  # noqa: F401 (re-exported)



class PolicyLoadError(RuntimeError):
    """A policy file is missing, unreadable or does not match its recorded observation spec."""


def _actor(policy):
    """Accept an SB3 algorithm (PPO) or its policy; return the policy in eval mode."""
    policy = getattr(policy, "policy", policy)
    policy.set_training_mode(False)
    return policy


def _fast_actor(policy):
    """The actor (policy_net then action_net) as a `numpy_actor`, cached on the policy; None when it is not a plain
    Flatten -> [Linear, activation]* -> Linear stack numpy can run (the modules are then called). Decision latency
    counts: nn.Module calls cost several microseconds per layer on a CPU, more right after a model forward."""
    cached = getattr(policy, "_specpilot_numpy_actor", False)
    if cached is not False:
        return cached
    layers: list[tuple] | None = []
    if type(getattr(policy.pi_features_extractor, "flatten", None)) is not torch.nn.Flatten:
        layers = None
    else:
        for module in list(policy.mlp_extractor.policy_net) + [policy.action_net]:
            if isinstance(module, torch.nn.Linear):
                layers.append(("linear", module.weight, module.bias))
            elif layers:  # an activation; numpy_actor declines the ones it cannot run
                params = {"negative_slope": module.negative_slope} if hasattr(module, "negative_slope") else {}
                layers.append(("activation", type(module).__name__.lower(), params))
            else:
                layers = None
                break
    cached = numpy_actor(layers) if layers else None
    policy._specpilot_numpy_actor = cached
    return cached


def _check_dim(policy, spec: ObservationSpec, label: str) -> None:
    shape = getattr(policy.observation_space, "shape", None)
    if shape != (spec.dim,):
        raise ValueError(f"{label} policy expects observations of shape {shape}, but its {spec.kind} spec "
                         f"produces ({spec.dim},): the spec does not belong to this policy")


class PPOController(LearnedController):
    """Depth from `depth_policy` (CONTINUE=0 / STOP=1), size from `size_policy` (index into `size_actions`);
    whichever is None is decided by `fallback` (this gives the depth_only / size_only ablations)."""

    name = "ppo"
    label = "ppo"

    def __init__(
        self,
        depth_policy=None,
        size_policy=None,
        depth_spec: ObservationSpec | None = None,
        size_spec: ObservationSpec | None = None,
        size_actions: list[int] | None = None,
        fallback: Controller | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.fallback = fallback if fallback is not None else FixedController()
        self.depth_policy = _actor(depth_policy) if depth_policy is not None else None
        self.size_policy = _actor(size_policy) if size_policy is not None else None
        if self.depth_policy is not None:
            if depth_spec is None or depth_spec.kind != "depth":
                raise ValueError("a depth policy needs a depth ObservationSpec (depth_spec)")
            _check_dim(self.depth_policy, depth_spec, "depth")
        if self.size_policy is not None:
            if size_spec is None or size_spec.kind != "size":
                raise ValueError("a size policy needs a size ObservationSpec (size_spec)")
            _check_dim(self.size_policy, size_spec, "size")
            n_actions = int(self.size_policy.action_space.n)
            size_actions = list(size_actions) if size_actions is not None else default_size_actions()
            if len(size_actions) != n_actions:
                raise ValueError(f"size policy has {n_actions} actions but size_actions has {len(size_actions)}")
        self.depth_spec = depth_spec
        self.size_spec = size_spec
        self.size_actions = [int(v) for v in size_actions] if size_actions is not None else None
        if name is not None:
            self.name = name

    @staticmethod
    def _decide(policy, obs: np.ndarray) -> int:
        act = _fast_actor(policy)
        if act is not None:
            return act(obs)
        with torch.inference_mode():  # an accelerator policy or an unusual actor: go through the modules
            features = policy.pi_features_extractor(torch.from_numpy(obs).unsqueeze(0))
            logits = policy.action_net(policy.mlp_extractor.forward_actor(features))  # (1, n_actions)
            return int(logits.argmax(dim=1))

    has_depth = property(lambda self: self.depth_policy is not None)
    has_size = property(lambda self: self.size_policy is not None)

    def _depth_action(self, obs: np.ndarray) -> int:
        return self._decide(self.depth_policy, obs)

    def _size_action(self, obs: np.ndarray) -> int:
        return self._decide(self.size_policy, obs)


def load_sb3_policy(path: str | Path, device: str = "cpu"):
    """Load the policy of an SB3 PPO zip; a clear PolicyLoadError naming the file when it is missing/corrupt."""
    from stable_baselines3 import PPO

    path = Path(path)
    if not path.is_file():
        raise PolicyLoadError(f"policy file {path} does not exist: train the stage that writes it, or fix "
                              "policies.json to point at an existing best.zip")
    try:
        model = PPO.load(path, device=device)
    except (zipfile.BadZipFile, EOFError, KeyError, ValueError, RuntimeError, OSError) as err:
        raise PolicyLoadError(f"policy file {path} is corrupted or not an SB3 PPO zip ({type(err).__name__}: "
                              f"{err}); retrain that stage or restore the file") from err
    return _actor(model.policy)


def load_run_controllers(run_dir: str | Path, device: str = "cpu") -> dict[str, Controller]:
    """{"ltd": both policies, "depth_only": depth policy + fixed size, "size_only": fixed depth + size policy},
    from run_dir/policies.json; entries whose policies are absent are left out."""
    run_dir = Path(run_dir)
    index_path = run_dir / "policies.json"
    if not index_path.is_file():
        raise PolicyLoadError(f"{index_path} not found: this run has no final policies yet (train it first)")
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as err:
        raise PolicyLoadError(f"{index_path} is not valid JSON ({err}); rewrite it with write_policies_index")
    fb = index.get("fallback") or {}
    fallback = FixedController(fb.get("depth"), fb.get("size"))

    depth = size = None
    depth_spec = size_spec = None
    size_actions = None
    if index.get("depth"):
        depth_spec = ObservationSpec.from_dict(index["depth"]["spec"])
        depth = load_sb3_policy(run_dir / index["depth"]["path"], device)
    if index.get("size"):
        size_spec = ObservationSpec.from_dict(index["size"]["spec"])
        size_actions = [int(v) for v in index["size"]["size_actions"]]
        size = load_sb3_policy(run_dir / index["size"]["path"], device)

    def make(d, s, name):
        return PPOController(d, s, depth_spec if d is not None else None, size_spec if s is not None else None,
                             size_actions if s is not None else None, fallback=fallback, name=name)

    out: dict[str, Controller] = {}
    if depth is not None and size is not None:
        out["ltd"] = make(depth, size, "ltd")
    if depth is not None:
        out["depth_only"] = make(depth, None, "depth_only")
    if size is not None:
        out["size_only"] = make(None, size, "size_only")
    if not out:
        raise PolicyLoadError(f"{index_path} names neither a depth nor a size policy")
    return out
