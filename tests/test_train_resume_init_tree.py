"""--init-from a policy whose run records it observing another tree (same width, so the same tensor shapes, but
depths scaled by another max_depth) is refused naming both trees; one of the same tree, or with no record, starts."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from stable_baselines3 import PPO

from specpilot.artifacts.run import RunManifest
from specpilot.train.rl.ppo import write_policies_index
from specpilot.train.rl.stages import check_init_policy, stage_observation

WIDTH = 3


class _Spaces(gym.Env):
    """Only the spaces of a depth stage's environment (building PPO needs an env; nothing steps it)."""

    def __init__(self, dim: int):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(dim,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.zeros(self.observation_space.shape, dtype=np.float32), {}

    def step(self, action):
        return np.zeros(self.observation_space.shape, dtype=np.float32), 0.0, True, False, {}


def _depth_zip(path, spec) -> None:
    """An untrained depth policy zip observing `spec` (CONTINUE / STOP)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    PPO("MlpPolicy", _Spaces(spec.dim), n_steps=64, batch_size=32, policy_kwargs={"net_arch": [8]},
        device="cpu").save(path)


def _recorded_in_manifest(tmp_path, spec):
    run = tmp_path / "other_run"
    _depth_zip(run / "depth_s1" / "best.zip", spec)
    RunManifest.update(run, stage_setup={"depth_s1": {"kind": "depth", "spec": spec.to_dict()}})
    return run / "depth_s1" / "best.zip"


def _recorded_in_index(tmp_path, spec):
    folder = tmp_path / "exported"
    _depth_zip(folder / "depth.zip", spec)
    write_policies_index(folder, depth=folder / "depth.zip", depth_spec=spec, fallback_depth=2, fallback_size=4)
    return folder / "depth.zip"


def _unrecorded(tmp_path, spec):
    _depth_zip(tmp_path / "loose" / "depth.zip", spec)
    return tmp_path / "loose" / "depth.zip"


@pytest.mark.parametrize("where", [_recorded_in_manifest, _recorded_in_index])
def test_a_starting_policy_of_another_max_depth_is_refused_naming_both_trees(tmp_path, where):
    init = where(tmp_path, stage_observation("depth", WIDTH, 6, None))
    stage = stage_observation("depth", WIDTH, 4, None)
    with pytest.raises(ValueError, match=r"--init-from .*max_depth 6.*this stage's trace is width 3, max_depth 4"):
        check_init_policy(init, "depth", stage, None)


@pytest.mark.parametrize("where", [_recorded_in_manifest, _recorded_in_index, _unrecorded])
def test_a_starting_policy_of_the_same_tree_or_unrecorded_starts(tmp_path, where):
    spec = stage_observation("depth", WIDTH, 4, None)
    init = where(tmp_path, spec if where is not _unrecorded else stage_observation("depth", WIDTH, 6, None))
    assert check_init_policy(init, "depth", spec, None) == ([8], [8])
