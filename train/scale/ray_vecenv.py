"""RayVecEnv: SB3's VecEnv API over live environments that run on Ray workers, one environment per worker.

    venv = RayVecEnv(pool, partial(SizeEnv, prompts=prompts, max_new_tokens=64, tree=tree, size_actions=acts))
    model = PPO("MlpPolicy", VecNormalize(venv, norm_obs=False))

Each `PairWorker` of the pool builds its environment as `env_fn(pair)` on its own pair (on its own GPU), wrapped in
SB3's `Monitor` as DummyVecEnv wraps it: env_fn is any picklable function of a ModelPair (a `functools.partial` of
`specpilot.envs.environments.SizeEnv` / `DepthEnv`), shipped to the workers, so the VecEnv knows no environment class. `step_async` sends every worker its action, `step_wait`
collects the results; as in SubprocVecEnv, a worker resets its environment at episode end and returns the final
observation in info["terminal_observation"]. Decoding runs on the workers in parallel; the policy and the updates
stay in this process. Replay environments do not need this: they are cheap, SB3's local DummyVecEnv serves them.

A worker that dies during training loses its environment's episode: the VecEnv raises ClusterError; resume the
stage (`specpilot train ... --resume`) from its last checkpoint.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn

from specpilot.train.scale.cluster import ClusterError, WorkerPool, import_ray


class RayVecEnv(VecEnv):
    """SB3 VecEnv whose environments live on the pool's workers (num_envs = number of workers used).

    pool: a started WorkerPool. env_fn: pair -> gym.Env, called on each worker with its pair; it is pickled to
    the workers, with everything it holds (prompts, tree, partner controllers: PPOController pickles).
    num_envs: the first N workers (default all).
    """

    def __init__(self, pool: WorkerPool, env_fn: Callable[[Any], Any], *, num_envs: int | None = None) -> None:
        self.ray = import_ray()
        n = len(pool) if num_envs is None else int(num_envs)
        if not 1 <= n <= len(pool):
            raise ValueError(f"num_envs must be between 1 and the pool's {len(pool)} workers, got {num_envs}")
        self.pool, self.actors = pool, pool.actors[:n]
        spaces = self._get([a.env_make.remote(env_fn) for a in self.actors])
        observation_space, action_space, metadata = spaces[0]
        super().__init__(n, observation_space, action_space)
        self.metadata = metadata
        self.workers = pool.workers[:n]
        self._pending: list | None = None
        self.closed = False

    def _get(self, refs: list) -> list:
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayActorError as err:
            raise ClusterError(f"a worker of the RayVecEnv died ({str(err).splitlines()[0]}): its episode is lost; "
                               "resume the stage from its last checkpoint (--resume)") from err

    # -- the VecEnv protocol -------------------------------------------------------------------------------------------
    def reset(self) -> VecEnvObs:
        refs = [a.env_reset.remote(self._seeds[i], self._options[i] or None) for i, a in enumerate(self.actors)]
        results = self._get(refs)
        self.reset_infos = [info for _, info in results]
        self._reset_seeds()
        self._reset_options()
        return np.stack([obs for obs, _ in results])

    def step_async(self, actions: np.ndarray) -> None:
        self._pending = [a.env_step.remote(action) for a, action in zip(self.actors, actions)]

    def step_wait(self) -> VecEnvStepReturn:
        if self._pending is None:
            raise RuntimeError("step_wait() without step_async()")
        results, self._pending = self._get(self._pending), None
        obs, rewards, dones, infos, reset_infos = zip(*results)
        self.reset_infos = list(reset_infos)
        return (np.stack(obs), np.asarray(rewards, dtype=np.float32), np.asarray(dones, dtype=bool), list(infos))

    def close(self) -> None:
        if self.closed:
            return
        if self._pending is not None:
            self.ray.wait(self._pending, num_returns=len(self._pending))
        self._get([a.env_close.remote() for a in self.actors])
        self.closed = True

    def _call(self, op: str, name: str, indices: VecEnvIndices, *args, **kwargs) -> list[Any]:
        targets = [self.actors[i] for i in self._get_indices(indices)]
        return self._get([a.env_call.remote(op, name, args, kwargs) for a in targets])

    def has_attr(self, attr_name: str) -> bool:
        return all(self._call("has", attr_name, None))

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        return self._call("get", attr_name, indices)

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        self._call("set", attr_name, indices, value)

    def env_method(self, method_name: str, *method_args, indices: VecEnvIndices = None, **method_kwargs) -> list[Any]:
        return self._call("method", method_name, indices, *method_args, **method_kwargs)

    def env_is_wrapped(self, wrapper_class: type, indices: VecEnvIndices = None) -> list[bool]:
        return self._call("is_wrapped", "", indices, wrapper_class)

    def get_images(self) -> Sequence[np.ndarray | None]:
        return [None for _ in self.actors]  # the decoding environments have no render modes
