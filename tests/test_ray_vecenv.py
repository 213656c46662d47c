"""RayVecEnv: live environments on two Ray CPU workers behind SB3's VecEnv API. It behaves like SB3's DummyVecEnv
over the same environments (observations, episode ends, terminal observations, attribute calls), passes SB3's NaN
check, PPO trains on it, and the pipeline's live backend uses it when given a pool."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from stable_baselines3 import PPO
from stable_baselines3.common.env_checker import check_env
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecCheckNan

from specpilot.drafting.pair import ModelPair
from specpilot.drafting.types import TreeConfig
from specpilot.envs.environments import live_depth_env, live_size_env
from specpilot.train.scale.ray_vecenv import RayVecEnv

PROMPTS = ["def f(x):\n    return", "def g(y):", "x = f(1)"]
TREE = TreeConfig(width=2, max_depth=4, max_size=8)
KWARGS = {"size": dict(prompts=PROMPTS, max_new_tokens=8, tree=TREE, size_actions=[1, 2, 4, 8], depth_controller=2),
          "depth": dict(prompts=PROMPTS, max_new_tokens=8, tree=TREE, size_controller=4)}
CLASSES = {"size": live_size_env, "depth": live_depth_env}


@pytest.fixture(scope="module")
def local_pair(saved_pair):
    return ModelPair.from_pretrained(str(saved_pair / "target"), str(saved_pair / "draft"), device="cpu")


@pytest.mark.parametrize("kind", ["size", "depth"])
def test_ray_vecenv_steps_like_dummy_vecenv_over_the_same_envs(ray_pool, local_pair, kind):
    check_env(CLASSES[kind](local_pair, **KWARGS[kind]))  # the environment itself passes SB3's checker
    raw = RayVecEnv(ray_pool, partial(CLASSES[kind], **KWARGS[kind]))
    ray_env = VecCheckNan(raw, raise_exception=True)  # SB3's check: raises on NaN/inf observations or rewards
    dummy = DummyVecEnv([lambda: Monitor(CLASSES[kind](local_pair, **KWARGS[kind])) for _ in range(2)])
    assert ray_env.num_envs == 2 and ray_env.observation_space == dummy.observation_space
    assert ray_env.action_space == dummy.action_space
    ray_env.seed(3)
    dummy.seed(3)
    np.testing.assert_allclose(ray_env.reset(), dummy.reset(), rtol=1e-5, atol=1e-6)
    assert raw.reset_infos == dummy.reset_infos
    rng = np.random.default_rng(0)
    episodes = 0
    for _ in range(40):
        actions = rng.integers(dummy.action_space.n, size=2)
        got, want = ray_env.step(actions), dummy.step(actions)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got[2], want[2])
        for a, b in zip(got[3], want[3]):
            assert a.keys() == b.keys()
            if "terminal_observation" in b:
                np.testing.assert_allclose(a["terminal_observation"], b["terminal_observation"], rtol=1e-5,
                                           atol=1e-6)
                assert a["episode"]["l"] == b["episode"]["l"]  # Monitor runs on the worker
        episodes += int(want[2].sum())
    assert episodes > 0
    assert ray_env.get_attr("prompt_index") == dummy.get_attr("prompt_index")
    assert ray_env.env_is_wrapped(Monitor) == [True, True]
    assert ray_env.env_method("get_episode_lengths", indices=[1]) == dummy.env_method("get_episode_lengths",
                                                                                      indices=[1])
    ray_env.set_attr("max_context", 2048, indices=0)
    assert ray_env.get_attr("max_context") == [2048, 4096]
    ray_env.close()


def test_ppo_trains_a_few_hundred_steps_on_ray_workers(ray_pool):
    venv = RayVecEnv(ray_pool, partial(live_size_env, **KWARGS["size"]))
    model = PPO("MlpPolicy", venv, n_steps=64, batch_size=64, n_epochs=2, policy_kwargs={"net_arch": [16]},
                seed=0, device="cpu")
    model.set_logger(Logger(folder=None, output_formats=[]))  # SB3's default logger leaves a /tmp/SB3-* folder
    model.learn(total_timesteps=256)
    assert model.num_timesteps >= 256
    assert len(model.ep_info_buffer) > 0  # episodes finished on the workers reached SB3's episode statistics
    venv.close()


def test_pipeline_live_stage_trains_on_the_pool(ray_pool, local_pair, tmp_path):
    from specpilot.envs.record import record_task
    from specpilot.train.rl.pipeline import train_size

    for split in ("train", "validation"):
        record_task(local_pair, TREE, PROMPTS, tmp_path / "traces" / split, max_new_tokens=8, profile_prompts=1)
    from specpilot.train.rl.ppo import PPOOverrides
    from specpilot.train.rl.stages import TrainOptions

    ppo = PPOOverrides(n_steps=64, batch_size=64, n_epochs=1, pi_arch=[16], vf_arch=[16])
    options = TrainOptions(static=(2, 4), backend="live", cluster=ray_pool, train_prompts=PROMPTS, ppo=ppo)
    res = train_size(tmp_path / "run", tmp_path / "traces", steps=128, size_actions=[1, 2, 4, 8], options=options,
                     wandb="disabled")
    assert res.best.is_file() and res.score is not None
