"""Live Gymnasium environments: thin adapters over the decoder's step API (`DecodingSession`).

The environments call only `SpeculativeDecoder.start(...)`, `session.draft_level()` and `session.verify(size)`, the
same steps `SpeculativeDecoder.generate()` and evaluation use; observations come from `specpilot.envs.observation`,
the same functions the PPOController uses at inference. There is no second copy of the decoding loop.

    specpilot/Depth-v0   DepthEnv   one step per draft forward, CONTINUE/STOP; the size comes from a partner
    specpilot/Size-v0    SizeEnv    one step per cycle, an index into `size_actions`; the depth from a partner

Partners are `Controller`s (`specpilot.policies.base`): a FixedController, a heuristic, a PPOController, or
`RandomDepthController` (the paper trains the size policy against depths drawn from [1, 12]). Shorthands: an int is a
fixed depth/size, a (low, high) pair a RandomDepthController.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch

from specpilot.drafting.types import CycleRecord, DraftState, TreeConfig
from specpilot.envs.observation import (ObservationSpec, default_size_actions, depth_observation, observation_space,
                                        size_observation)
from specpilot.envs.rewards import Reward, make_reward
from specpilot.policies.base import Controller, FixedController, default_static_config

CONTINUE, STOP = 0, 1
CYCLE_INFO_KEYS = ("accepted", "emitted", "depth", "size", "draft_s", "verify_s")


class RandomDepthController(Controller):
    """Draft a depth drawn uniformly from [low, high] each cycle (drawn at the cycle's first level); verify `size`.

    `seed(seed)` reseeds its generator; the environments call it at every reset with a seed drawn from their own
    seeded generator, so an environment seed reproduces the partner's depths too.
    """

    name = "random_depth"

    def __init__(self, low: int = 1, high: int = 12, size: int | None = None, *, seed: int | None = None,
                 device: str | None = None) -> None:
        if not 1 <= int(low) <= int(high):
            raise ValueError(f"RandomDepthController needs 1 <= low <= high, got low={low}, high={high}")
        self.low, self.high = int(low), int(high)
        self.size = int(default_static_config(device)[1] if size is None else size)
        self.rng = np.random.default_rng(seed)
        self._target = self.low

    def seed(self, seed: int | None) -> None:
        self.rng = np.random.default_rng(seed)

    def draw(self) -> int:
        """The next cycle's depth (replay environments call this directly; live ones through should_stop)."""
        self._target = int(self.rng.integers(self.low, self.high + 1))
        return self._target

    def should_stop(self, state: DraftState) -> bool:
        if state.depth == 1:
            self.draw()
        return state.depth >= self._target

    def choose_size(self, state: DraftState) -> int:
        return self.size

    def describe(self) -> dict:
        return {"name": self.name, "low": self.low, "high": self.high, "size": self.size}


def as_depth_controller(partner: Any, device: str | None = None) -> Controller:
    """None -> FixedController (default depth for the device); int d -> FixedController(depth=d);
    (low, high) -> RandomDepthController(low, high); a Controller passes through."""
    if partner is None:
        return FixedController(device=device)
    if isinstance(partner, Controller):
        return partner
    if isinstance(partner, (tuple, list)) and len(partner) == 2:
        return RandomDepthController(int(partner[0]), int(partner[1]), device=device)
    if isinstance(partner, (int, np.integer)) and not isinstance(partner, bool):
        return FixedController(depth=int(partner), device=device)
    raise TypeError(f"depth_controller must be None, an int depth, a (low, high) pair or a Controller; got {partner!r}")


def as_size_controller(partner: Any, device: str | None = None) -> Controller:
    """None -> FixedController (default size for the device); int V -> FixedController(size=V); a Controller
    passes through."""
    if partner is None:
        return FixedController(device=device)
    if isinstance(partner, Controller):
        return partner
    if isinstance(partner, (int, np.integer)) and not isinstance(partner, bool):
        return FixedController(size=int(partner), device=device)
    raise TypeError(f"size_controller must be None, an int size or a Controller; got {partner!r}")


def seed_partner(partner: Controller, rng: np.random.Generator) -> None:
    """Reseed a partner that has a `seed(int)` method from the environment's generator (others draw nothing)."""
    seed = getattr(partner, "seed", None)
    if callable(seed):
        seed(int(rng.integers(2**31 - 1)))


def cycle_info(record: CycleRecord, **extra) -> dict:
    """The info of a step that ends a cycle (train/logging.py's CycleMetricsCallback reads CYCLE_INFO_KEYS)."""
    info = {"accepted": record.accepted, "emitted": record.emitted, "depth": record.depth, "size": record.size,
            "draft_s": record.draft_s, "verify_s": record.verify_s, "context_len": record.context_len}
    info.update(extra)
    return info


def _prompt_items(prompts) -> list:
    if prompts is None:
        from specpilot.eval.suites import load_suite

        prompts = load_suite("train")
    if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], (int, np.integer))):
        raise TypeError("prompts must be a list of prompts (strings or token-id lists), not a single prompt")
    items = [getattr(p, "prompt", p) for p in prompts]
    if not items:
        raise ValueError("prompts is empty: give at least one prompt")
    return items


class _LiveEnv(gym.Env):
    """Shared episode handling: prompt choice, seeding, session start, verification and episode end."""

    metadata = {"render_modes": []}

    def __init__(self, pair=None, prompts=None, *, max_new_tokens: int = 128, tree: TreeConfig | None = None,
                 reward: str | Reward = "throughput", temperature: float = 0.0, max_context: int = 4096) -> None:
        from specpilot.drafting.decoder import SpeculativeDecoder
        from specpilot.drafting.pair import ModelPair

        if pair is None:
            pair = ModelPair.from_pretrained()
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.pair = pair
        self.device = str(pair.device)
        self.tree = tree or TreeConfig()
        self.decoder = SpeculativeDecoder(pair, self.tree)
        self.prompts = [pair.encode(p) for p in _prompt_items(prompts)]
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.max_context = int(max_context)
        self.reward_fn = make_reward(reward)
        self.session = None
        self.state: DraftState | None = None
        self.prompt_index = -1

    # -- episode ---------------------------------------------------------------------------------------------------
    def _partner(self) -> Controller:
        raise NotImplementedError

    def _start(self, seed: int | None, options: dict | None) -> dict:
        super().reset(seed=seed)
        if seed is not None:
            torch.manual_seed(seed)
        options = options or {}
        if "prompt_index" in options:
            index = int(options["prompt_index"])
            if not 0 <= index < len(self.prompts):
                raise ValueError(f"prompt_index {index} out of range for {len(self.prompts)} prompts")
        else:
            index = int(self.np_random.integers(len(self.prompts)))
        self.prompt_index = index
        partner = self._partner()
        seed_partner(partner, self.np_random)
        partner.reset()
        self.reward_fn.reset()
        session_seed = int(self.np_random.integers(2**31 - 1))
        self.session = self.decoder.start(self.prompts[index], max_new_tokens=self.max_new_tokens,
                                          temperature=self.temperature, seed=session_seed)
        return {"prompt_index": index, "prompt_len": len(self.prompts[index])}

    def _verify(self, size: int) -> tuple[float, bool, bool, dict]:
        """Verify `size` candidates; (reward, terminated, truncated, info)."""
        record = self.session.verify(size)
        self._partner().observe(record)
        reward = float(self.reward_fn(record))
        info = cycle_info(record, new_tokens=len(self.session.new_tokens), prompt_index=self.prompt_index)
        terminated = truncated = False
        if self.session.done:
            info["finished_by"] = self.session.finished_by
            terminated = self.session.finished_by == "eos"
            truncated = not terminated
        return reward, terminated, truncated, info

    def _check_running(self) -> None:
        if self.session is None:
            raise RuntimeError("call reset() before step()")
        if self.session.done:
            raise RuntimeError("the episode has ended (terminated or truncated): call reset()")


class DepthEnv(_LiveEnv):
    """Learn when to stop drafting: one decision after every draft forward of the live decoder.

    ## Description
    Each episode generates one prompt (drawn with the seeded generator from `prompts`) with the speculative
    decoder. After every draft forward the agent decides whether to draft another level of the tree or to stop
    and verify; the verification size comes from `size_controller`.

    ## Action Space
    `Discrete(2)`: 0 = CONTINUE (draft one more level), 1 = STOP (verify now). When a CONTINUE reaches
    `tree.max_depth` the cycle is verified in the same step (the decoder never asks at the maximum depth).

    ## Observation Space
    `Box(2*W*W + 5)` float32, `specpilot.envs.observation.depth_observation`: the last level's W*W cumulative
    log-probabilities (W at depth 1) in drafting order, scaled into [-1, 0], padded with -1 and an explicit validity
    mask; then depth/max_depth, context length/max_context, new tokens/max_new_tokens, and the previous cycle's
    accepted length and depth / max_depth.

    ## Rewards
    0 on CONTINUE; on the step that ends a cycle, `reward(record)` (default "throughput": emitted tokens per second
    of draft + verify time; see `specpilot.envs.rewards`).

    ## Starting State
    The prompt is prefilled (not timed) and the first level of the first tree is drafted.

    ## Episode End
    terminated: the target emitted EOS. truncated: `max_new_tokens` tokens were emitted.

    ## Info
    Every step: `depth`. A step that ends a cycle: `accepted, emitted, depth, size, draft_s, verify_s, context_len,
    new_tokens, prompt_index` (+ `finished_by` at the end). Reset: `prompt_index, prompt_len`.

    ## Arguments
    pair: ModelPair (default: the embedded pair). prompts: strings or token-id lists (default: the "train" suite).
    max_new_tokens: generation budget. tree: TreeConfig (max_depth >= 2). reward: a name or reward object.
    size_controller: Controller, int size, or None (FixedController with the device's default size).
    temperature: 0 = greedy. max_context: context length mapped to 1.0 in the observation.
    reset(options={"prompt_index": i}) picks a prompt explicitly.

    ## Example
        >>> import gymnasium as gym, specpilot.envs
        >>> env = gym.make("specpilot/Depth-v0", pair=pair, prompts=["def f(x):"], max_new_tokens=64)
        >>> obs, info = env.reset(seed=0)
        >>> obs, reward, terminated, truncated, info = env.step(1)
    """

    def __init__(self, pair=None, prompts=None, *, max_new_tokens: int = 128, tree: TreeConfig | None = None,
                 reward: str | Reward = "throughput", size_controller: Controller | int | None = None,
                 temperature: float = 0.0, max_context: int = 4096) -> None:
        super().__init__(pair, prompts, max_new_tokens=max_new_tokens, tree=tree, reward=reward,
                         temperature=temperature, max_context=max_context)
        if self.tree.max_depth < 2:
            raise ValueError("the depth environment needs tree.max_depth >= 2 (with 1 there is nothing to decide)")
        self.size_controller = as_size_controller(size_controller, self.device)
        self.spec_obs = ObservationSpec.for_depth(self.tree.width, self.tree.max_depth, max_context=self.max_context)
        self.observation_space = observation_space(self.spec_obs)
        self.action_space = gym.spaces.Discrete(2)

    def _partner(self) -> Controller:
        return self.size_controller

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        info = self._start(seed, options)
        self.state = self.session.draft_level()
        return depth_observation(self.state, self.spec_obs), info

    def step(self, action):
        self._check_running()
        action = int(action)
        if action not in (CONTINUE, STOP):
            raise ValueError(f"action must be 0 (CONTINUE) or 1 (STOP), got {action}")
        if action == CONTINUE:
            self.state = self.session.draft_level()
            if self.state.depth < self.tree.max_depth:
                return depth_observation(self.state, self.spec_obs), 0.0, False, False, {"depth": self.state.depth}
        size = int(self.size_controller.choose_size(self.state))
        reward, terminated, truncated, info = self._verify(size)
        if not (terminated or truncated):
            self.state = self.session.draft_level()
        return depth_observation(self.state, self.spec_obs), reward, terminated, truncated, info


class SizeEnv(_LiveEnv):
    """Learn how many drafted candidates to verify: one decision per draft-and-verify cycle of the live decoder.

    ## Description
    Each episode generates one prompt (drawn with the seeded generator from `prompts`). Every cycle the tree is
    drafted as deep as `depth_controller` decides (its `should_stop(state)` after each level, never past
    `tree.max_depth`); the agent then picks how many of the best-scored candidates the target verifies.

    ## Action Space
    `Discrete(len(size_actions))`: index into `size_actions` (default: `default_size_actions(device)`). Sizes above
    the candidates drafted are clipped by the decoder (`info["size"]` is the size actually verified).

    ## Observation Space
    `Box(2*max(size_actions) + 5)` float32, `specpilot.envs.observation.size_observation`: the best
    max(size_actions) candidate scores of the whole tree sorted, scaled, padded with -1 and masked; then
    depth/max_depth, context length/max_context, new tokens/max_new_tokens, and the previous cycle's accepted
    length and depth / max_depth.

    ## Rewards
    `reward(record)` of the cycle (default "throughput").

    ## Starting State
    The prompt is prefilled (not timed) and the first tree is drafted.

    ## Episode End
    terminated: the target emitted EOS. truncated: `max_new_tokens` tokens were emitted.

    ## Info
    Every step: `accepted, emitted, depth, size, draft_s, verify_s, context_len, new_tokens, prompt_index`
    (+ `finished_by` at the end). Reset: `prompt_index, prompt_len`.

    ## Arguments
    pair, prompts, max_new_tokens, tree, reward, temperature, max_context: as DepthEnv.
    size_actions: verification sizes (<= tree.max_size; default TreeConfig gets max_size = max(size_actions)).
    depth_controller: Controller, int depth, (low, high) for random depths, or None (the device's default depth).

    ## Example
        >>> env = gym.make("specpilot/Size-v0", pair=pair, prompts=["def f(x):"], depth_controller=(1, 12))
    """

    def __init__(self, pair=None, prompts=None, *, max_new_tokens: int = 128, tree: TreeConfig | None = None,
                 reward: str | Reward = "throughput", size_actions: list[int] | None = None,
                 depth_controller: Controller | int | tuple | None = None, temperature: float = 0.0,
                 max_context: int = 4096) -> None:
        if pair is None:
            from specpilot.drafting.pair import ModelPair

            pair = ModelPair.from_pretrained()
        size_actions, tree = resolve_size_actions(size_actions, tree, pair)
        super().__init__(pair, prompts, max_new_tokens=max_new_tokens, tree=tree, reward=reward,
                         temperature=temperature, max_context=max_context)
        self.size_actions = size_actions
        self.depth_controller = as_depth_controller(depth_controller, self.device)
        self.spec_obs = ObservationSpec.for_size(self.tree.width, self.tree.max_depth, size_actions=size_actions,
                                                 max_context=self.max_context)
        self.observation_space = observation_space(self.spec_obs)
        self.action_space = gym.spaces.Discrete(len(size_actions))

    def _partner(self) -> Controller:
        return self.depth_controller

    def _draft_cycle(self) -> None:
        """Draft levels until the depth controller stops (or max_depth), as SpeculativeDecoder.generate does."""
        state = self.session.draft_level()
        while state.depth < self.tree.max_depth and not self.depth_controller.should_stop(state):
            state = self.session.draft_level()
        self.state = state

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        info = self._start(seed, options)
        self._draft_cycle()
        return size_observation(self.state, self.spec_obs), info

    def step(self, action):
        self._check_running()
        size = self.size_actions[int(action)]
        reward, terminated, truncated, info = self._verify(size)
        if not (terminated or truncated):
            self._draft_cycle()
        return size_observation(self.state, self.spec_obs), reward, terminated, truncated, info


def resolve_size_actions(size_actions, tree: TreeConfig | None, pair=None) -> tuple[list[int], TreeConfig]:
    """Validated size list and a tree that can verify its largest size (a default tree is sized to fit)."""
    if size_actions is None:
        device = str(pair.device) if pair is not None and hasattr(pair, "device") else None
        size_actions = default_size_actions(device)
    size_actions = [int(v) for v in size_actions]
    if not size_actions or min(size_actions) < 1:
        raise ValueError(f"size_actions must be a non-empty list of sizes >= 1, got {size_actions}")
    if tree is None:
        tree = TreeConfig(max_size=max(max(size_actions), TreeConfig().max_size))
    elif max(size_actions) > tree.max_size:
        raise ValueError(f"size_actions go up to {max(size_actions)} but tree.max_size is {tree.max_size}: raise "
                         "TreeConfig.max_size or drop the larger sizes")
    return size_actions, tree
