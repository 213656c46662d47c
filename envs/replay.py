"""Replay environments: exact counterfactual decoding from a recorded trace, timed by a latency profile.

Under greedy decoding the output does not depend on (depth, size), so a trace (`specpilot.envs.record`) gives the
exact accepted length of any choice at any position, and a latency profile (`specpilot.envs.profile`) its time.
The replay environments have the same spaces, observations (built with `specpilot.envs.observation` from the same
numbers the live `DecodingSession._state()` computes), rewards and info as the live ones:

    specpilot/ReplayDepth-v0   ReplayDepthEnv   like specpilot/Depth-v0
    specpilot/ReplaySize-v0    ReplaySizeEnv    like specpilot/Size-v0

Also here: `replay_static` / `replay_controller` (throughput of a fixed config or any Controller under replay) and
`replay_oracle` (the best any policy can do on the trace in hindsight).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import gymnasium as gym
import numpy as np
import torch

from specpilot.drafting.types import CycleRecord, DraftState
from specpilot.envs.live import (CONTINUE, STOP, RandomDepthController, as_depth_controller, as_size_controller,
                                 seed_partner)
from specpilot.envs.observation import (ObservationSpec, default_size_actions, depth_observation, observation_space,
                                        set_history, size_observation)
from specpilot.envs.profile import LatencyProfile
from specpilot.envs.record import Trace, level_bounds
from specpilot.envs.rewards import Reward, make_reward
from specpilot.policies.base import Controller, FixedController

_TRACES: dict[tuple[str, float], Trace] = {}


def load_trace(trace: str | Path | Trace) -> Trace:
    """A Trace from a directory / trace.npz path (cached per file: many envs share one copy) or a Trace."""
    if isinstance(trace, Trace):
        return trace
    path = Path(trace)
    npz = path if path.suffix == ".npz" else path / "trace.npz"
    key = (str(npz.resolve()), npz.stat().st_mtime if npz.exists() else 0.0)
    if key not in _TRACES:
        _TRACES[key] = Trace.load(path)
    return _TRACES[key]


def load_profile(profile: str | Path | LatencyProfile | None, trace: Trace) -> LatencyProfile:
    if isinstance(profile, LatencyProfile):
        return profile
    if profile is None:
        if trace.path is None or not (trace.path / "profile.json").is_file():
            raise FileNotFoundError("no latency profile: pass profile= (a LatencyProfile or profile.json path) or "
                                    "keep profile.json next to trace.npz (`specpilot record` writes both)")
        profile = trace.path / "profile.json"
    return LatencyProfile.load(profile)


class PromptTables:
    """Everything replay needs about one prompt, precomputed with numpy (the env steps only index into it).

    n: tokens the generation emits; eos: whether it ends with EOS; acc[t, d-1, V]: accepted draft tokens;
    verify[t, V]: predicted verify time; obs[kind]: [n, max_depth, dim] observations (built on first use).
    """

    def __init__(self, model: "ReplayModel", index: int) -> None:
        trace = model.trace
        self.model = model
        self.index = index
        self.rows = trace.positions(index)
        self.n, self.eos = trace.budget(index, model.max_new_tokens)
        self.prompt_len = len(trace.prompt(index))
        ranks = trace.arrays["onpath_rank"][self.rows][: self.n]                        # [n, D, D]
        sizes = np.arange(trace.max_size + 1)
        self.acc = (ranks[:, :, :, None] < sizes).sum(axis=2, dtype=np.int8)            # [n, D, max_size+1]
        self.context = self.prompt_len + np.arange(self.n)
        self.verify = model.profile.verify_table(trace.max_size, self.context)           # [n, max_size+1]
        self.obs: dict[ObservationSpec, np.ndarray] = {}

    def scores(self, t: int) -> np.ndarray:
        return self.model.trace.arrays["scores"][self.rows.start + t]

    def state(self, t: int, depth: int, prev_accepted: int = 0, prev_depth: int = 0) -> DraftState:
        """The DraftState the live decoder's session returns at position t after `depth` levels, the previous
        cycle having accepted `prev_accepted` of `prev_depth` levels."""
        trace, row = self.model.trace, self.rows.start + t
        scores = trace.arrays["scores"][row]
        lo, hi = level_bounds(trace.width, depth)
        level = scores[lo:hi]  # node order = drafting order
        frontier = -np.sort(-level)
        candidates = -np.sort(-scores[: trace.num_candidates(depth)])
        return DraftState(depth=depth, max_depth=trace.max_depth, width=trace.width, context_len=self.prompt_len + t,
                          frontier_scores=torch.from_numpy(frontier), candidate_scores=torch.from_numpy(candidates),
                          last_top_prob=float(trace.arrays["top_prob"][row, depth - 1]),
                          last_entropy=float(trace.arrays["entropy"][row, depth - 1]),
                          new_tokens=t, max_new_tokens=self.model.max_new_tokens,
                          prev_accepted=prev_accepted, prev_depth=prev_depth, level_scores=torch.from_numpy(level))

    def observations(self, spec: ObservationSpec) -> np.ndarray:
        """[n, max_depth, dim] read-only observations for `spec` (depth: frontier; size: candidates) with empty
        history slots: environments return copies of rows with the history (which depends on the policy) set."""
        obs = self.obs.get(spec)
        if obs is None:
            trace = self.model.trace
            d_max, w = trace.max_depth, trace.width
            scores = trace.arrays["scores"][self.rows][: self.n]
            obs = np.empty((self.n, d_max, spec.dim), dtype=np.float32)
            build = depth_observation if spec.kind == "depth" else size_observation
            for d in range(1, d_max + 1):
                if spec.kind == "depth":
                    lo, hi = level_bounds(w, d)
                else:
                    lo, hi = 0, trace.num_candidates(d)
                block = scores[:, lo:hi]                              # depth: drafting order (node order)
                if spec.kind == "size":
                    block = -np.sort(-block, axis=1)                  # size: sorted descending, as the session sorts
                for t in range(self.n):
                    state = DraftState(depth=d, max_depth=d_max, width=w, context_len=self.prompt_len + t,
                                       frontier_scores=block[t], candidate_scores=block[t], last_top_prob=0.0,
                                       last_entropy=0.0, new_tokens=t, max_new_tokens=self.model.max_new_tokens,
                                       level_scores=block[t])
                    obs[t, d - 1] = build(state, spec)
            obs.flags.writeable = False
            self.obs[spec] = obs
        return obs


class ReplayModel:
    """A trace + a latency profile under a generation budget: per-prompt tables (cached) and cycle costs."""

    def __init__(self, trace: str | Path | Trace, profile: str | Path | LatencyProfile | None = None, *,
                 max_new_tokens: int | None = None) -> None:
        self.trace = load_trace(trace)
        self.profile = load_profile(profile, self.trace)
        if self.profile.max_depth < self.trace.max_depth:
            raise ValueError(f"the latency profile covers depth {self.profile.max_depth} but the trace "
                             f"{self.trace.max_depth}: measure the profile with the trace's tree")
        self.max_new_tokens = self.trace.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        self.trace.budget(0, self.max_new_tokens)  # validates the budget
        self.draft = self.profile.draft_table()[: self.trace.max_depth + 2, : self.trace.max_depth + 1]
        self.num_candidates = [self.trace.num_candidates(d) for d in range(self.trace.max_depth + 1)]
        self._tables: dict[int, PromptTables] = {}

    @property
    def num_prompts(self) -> int:
        return self.trace.num_prompts

    def tables(self, index: int) -> PromptTables:
        tab = self._tables.get(index)
        if tab is None:
            tab = self._tables[index] = PromptTables(self, index)
        return tab

    def clip_size(self, depth: int, size: int) -> int:
        """The size the decoder actually verifies: min(size, candidates drafted, max_size)."""
        return min(int(size), self.num_candidates[depth], self.trace.max_size)


# ---------------------------------------------------------------------------------------------------------------------
# environments


class _ReplayEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, trace, profile=None, *, max_new_tokens: int | None = None,
                 reward: str | Reward = "throughput", max_context: int = 4096, time_noise: float = 0.0,
                 prompts: list[int] | None = None) -> None:
        self.model = ReplayModel(trace, profile, max_new_tokens=max_new_tokens)
        self.trace = self.model.trace
        self.max_depth = self.trace.max_depth
        self.max_new_tokens = self.model.max_new_tokens
        self.max_context = int(max_context)
        self.reward_fn = make_reward(reward)
        self.time_noise = float(time_noise)
        self.prompt_indices = list(range(self.trace.num_prompts)) if prompts is None else [int(i) for i in prompts]
        if not self.prompt_indices:
            raise ValueError("prompts selects no prompt of the trace")
        self._draft_std = self.model.profile.draft_std()
        self._verify_std = self.model.profile.verify_std()
        self._tab: PromptTables | None = None
        self._done = True
        self.prompt_index = -1

    def _partner(self) -> Controller:
        raise NotImplementedError

    def _start(self, seed, options) -> dict:
        super().reset(seed=seed)
        if seed is not None:
            torch.manual_seed(seed)
        options = options or {}
        if "prompt_index" in options:
            index = int(options["prompt_index"])
            if not 0 <= index < self.trace.num_prompts:
                raise ValueError(f"prompt_index {index} out of range for {self.trace.num_prompts} prompts")
        else:
            index = self.prompt_indices[int(self.np_random.integers(len(self.prompt_indices)))]
        self.prompt_index = index
        partner = self._partner()
        seed_partner(partner, self.np_random)
        partner.reset()
        self.reward_fn.reset()
        self._tab = self.model.tables(index)
        self._t, self._n_new, self._done = 0, 1, False
        self._prev = (0, 0)  # previous cycle's (accepted, depth), as DraftState.prev_accepted / prev_depth
        return {"prompt_index": index, "prompt_len": self._tab.prompt_len}

    def _verify(self, depth: int, size: int) -> tuple[float, bool, bool, dict]:
        """Replay one verification at the current position; advance; (reward, terminated, truncated, info)."""
        tab, t = self._tab, self._t
        size = min(size, self.model.num_candidates[depth], self.trace.max_size)
        accepted = int(tab.acc[t, depth - 1, size])
        emitted = min(accepted + 1, tab.n - t)
        draft_s = float(self.model.draft[min(self._n_new, self.max_depth + 1), depth])
        verify_s = float(tab.verify[t, size])
        if self.time_noise:
            noise = self.np_random.normal(size=2) * self.time_noise
            draft_s = max(draft_s + noise[0] * self._draft_std * math.sqrt(depth), 1e-9)
            verify_s = max(verify_s + noise[1] * self._verify_std, 1e-9)
        record = CycleRecord(depth, size, accepted, emitted, draft_s, verify_s, 0.0, tab.prompt_len + t)
        reward = float(self.reward_fn(record))
        self._partner().observe(record)
        self._t = t = t + emitted
        self._n_new = emitted
        self._ended_prev, self._prev = self._prev, (accepted, depth)  # the final observation keeps the old one
        info = {"accepted": accepted, "emitted": emitted, "depth": depth, "size": size, "draft_s": draft_s,
                "verify_s": verify_s, "context_len": tab.prompt_len + t - emitted, "new_tokens": t,
                "prompt_index": self.prompt_index}
        if t >= tab.n:
            self._done = True
            info["finished_by"] = "eos" if tab.eos else "length"
            return reward, tab.eos, not tab.eos, info
        return reward, False, False, info

    def _observation(self, t: int, depth: int, prev: tuple[int, int] | None = None) -> np.ndarray:
        """A fresh copy of the cached observation at (t, depth) with the history `prev` (default: current)."""
        return set_history(self._obs[t, depth - 1].copy(), self.spec_obs, *(prev or self._prev))

    def _check_running(self) -> None:
        if self._tab is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode has ended (terminated or truncated): call reset()")


class ReplayDepthEnv(_ReplayEnv):
    """specpilot/Depth-v0 replayed from a trace: same spaces, observations, rewards and info, no model forwards.

    ## Description
    One episode replays one recorded prompt (seeded choice). After every (replayed) draft forward the agent
    chooses CONTINUE or STOP; the verification size comes from `size_controller`. Accepted lengths are exact
    (greedy decoding); times come from the latency profile (optionally with seeded Gaussian noise).

    ## Action Space
    `Discrete(2)`: 0 = CONTINUE, 1 = STOP; a CONTINUE that reaches max_depth verifies in the same step.

    ## Observation Space
    As specpilot/Depth-v0: `depth_observation` of the recorded level scores and the replayed history,
    `Box(2*W*W + 5)`.

    ## Rewards
    0 on CONTINUE; `reward(record)` of the replayed cycle on the step that ends it.

    ## Starting State
    Position 0 of the prompt's continuation, first level drafted.

    ## Episode End
    terminated at EOS, truncated at `max_new_tokens` (<= the trace's budget).

    ## Arguments
    trace: directory / trace.npz path or a Trace. profile: LatencyProfile or profile.json path (default:
    profile.json next to the trace). max_new_tokens (default: the trace's), reward, size_controller, max_context:
    as the live env. time_noise: std of added timing noise in units of the profile's measured std (0: none).
    prompts: indices of the trace's prompts to draw episodes from (default: all).

    ## Example
        >>> env = gym.make("specpilot/ReplayDepth-v0", trace="runs/record/train", size_controller=12)
    """

    def __init__(self, trace, profile=None, *, max_new_tokens: int | None = None,
                 reward: str | Reward = "throughput", size_controller: Controller | int | None = None,
                 max_context: int = 4096, time_noise: float = 0.0, prompts: list[int] | None = None) -> None:
        super().__init__(trace, profile, max_new_tokens=max_new_tokens, reward=reward, max_context=max_context,
                         time_noise=time_noise, prompts=prompts)
        if self.max_depth < 2:
            raise ValueError("the depth environment needs a trace with max_depth >= 2")
        self.size_controller = as_size_controller(size_controller, self.trace.header.get("device"))
        self._fixed_size = self.size_controller.size if type(self.size_controller) is FixedController else None
        self.spec_obs = ObservationSpec.for_depth(self.trace.width, self.max_depth, max_context=self.max_context)
        self.observation_space = observation_space(self.spec_obs)
        self.action_space = gym.spaces.Discrete(2)

    def _partner(self) -> Controller:
        return self.size_controller

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        info = self._start(seed, options)
        self._obs = self._tab.observations(self.spec_obs)
        self._d = 1
        return self._observation(0, 1), info

    def step(self, action):
        self._check_running()
        if action == CONTINUE:
            self._d += 1
            if self._d < self.max_depth:
                return self._observation(self._t, self._d), 0.0, False, False, {"depth": self._d}
        elif action != STOP:
            raise ValueError(f"action must be 0 (CONTINUE) or 1 (STOP), got {action}")
        depth = self._d
        size = self._fixed_size
        if size is None:
            size = int(self.size_controller.choose_size(self._tab.state(self._t, depth, *self._prev)))
        reward, terminated, truncated, info = self._verify(depth, size)
        if not (terminated or truncated):
            self._d = 1
            return self._observation(self._t, 1), reward, terminated, truncated, info
        final = self._observation(self._t - info["emitted"], depth, self._ended_prev)  # the state verified last
        return final, reward, terminated, truncated, info


class ReplaySizeEnv(_ReplayEnv):
    """specpilot/Size-v0 replayed from a trace: same spaces, observations, rewards and info, no model forwards.

    ## Description
    One episode replays one recorded prompt (seeded choice). Each cycle the depth comes from `depth_controller`
    (a fixed depth, random depths in a range, or any Controller, which then sees the recorded DraftStates); the
    agent picks the verification size.

    ## Action Space
    `Discrete(len(size_actions))`, an index into `size_actions` (default: the trace device's size actions).

    ## Observation Space
    As specpilot/Size-v0: `size_observation` of the recorded candidate scores and the replayed history,
    `Box(2*max(size_actions) + 5)`.

    ## Rewards
    `reward(record)` of the replayed cycle.

    ## Starting State
    Position 0 of the prompt's continuation, the first tree drafted.

    ## Episode End
    terminated at EOS, truncated at `max_new_tokens` (<= the trace's budget).

    ## Arguments
    trace, profile, max_new_tokens, reward, max_context, time_noise, prompts: as ReplayDepthEnv.
    size_actions: sizes (<= the trace's max_size). depth_controller: int, (low, high) or a Controller.

    ## Example
        >>> env = gym.make("specpilot/ReplaySize-v0", trace="runs/record/train", depth_controller=(1, 12))
    """

    def __init__(self, trace, profile=None, *, max_new_tokens: int | None = None,
                 reward: str | Reward = "throughput", size_actions: list[int] | None = None,
                 depth_controller: Controller | int | tuple | None = None, max_context: int = 4096,
                 time_noise: float = 0.0, prompts: list[int] | None = None) -> None:
        super().__init__(trace, profile, max_new_tokens=max_new_tokens, reward=reward, max_context=max_context,
                         time_noise=time_noise, prompts=prompts)
        device = self.trace.header.get("device")
        if size_actions is None:
            size_actions = default_size_actions(device)
        self.size_actions = [int(v) for v in size_actions]
        if not self.size_actions or min(self.size_actions) < 1:
            raise ValueError(f"size_actions must be a non-empty list of sizes >= 1, got {self.size_actions}")
        if max(self.size_actions) > self.trace.max_size:
            raise ValueError(f"size_actions go up to {max(self.size_actions)} but the trace was recorded with "
                             f"max_size {self.trace.max_size}: record with a larger --max-size or drop the sizes")
        self.depth_controller = as_depth_controller(depth_controller, device)
        self.spec_obs = ObservationSpec.for_size(self.trace.width, self.max_depth, size_actions=self.size_actions,
                                                 max_context=self.max_context)
        self.observation_space = observation_space(self.spec_obs)
        self.action_space = gym.spaces.Discrete(len(self.size_actions))

    def _partner(self) -> Controller:
        return self.depth_controller

    def _next_depth(self) -> int:
        """The depth the partner drafts at the current position (what the live env's draft loop does)."""
        partner, d_max = self.depth_controller, self.max_depth
        kind = type(partner)
        if kind is FixedController:
            return min(partner.depth, d_max)
        if kind is RandomDepthController:
            return 1 if d_max == 1 else min(partner.draw(), d_max)
        depth = 1
        while depth < d_max and not partner.should_stop(self._tab.state(self._t, depth, *self._prev)):
            depth += 1
        return depth

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        info = self._start(seed, options)
        self._obs = self._tab.observations(self.spec_obs)
        self._d = self._next_depth()
        return self._observation(0, self._d), info

    def step(self, action):
        self._check_running()
        depth = self._d
        reward, terminated, truncated, info = self._verify(depth, self.size_actions[action])
        if not (terminated or truncated):
            self._d = self._next_depth()
            return self._observation(self._t, self._d), reward, terminated, truncated, info
        final = self._observation(self._t - info["emitted"], depth, self._ended_prev)  # the state verified last
        return final, reward, terminated, truncated, info


# ---------------------------------------------------------------------------------------------------------------------
# evaluation under replay


def _summary(tokens: int, time_s: float, cycles: int) -> dict:
    return {"tokens": int(tokens), "time_s": float(time_s), "cycles": int(cycles),
            "tokens_per_s": tokens / time_s if time_s > 0 else float("nan"),
            "mean_accepted_length": tokens / cycles if cycles else float("nan")}


def _simulate(model: ReplayModel, choose: Callable[[PromptTables, int, int], tuple[int, int]],
              prompts: list[int] | None = None, reset: Callable[[], None] | None = None) -> dict:
    tokens = cycles = 0
    time_s = 0.0
    for i in (range(model.num_prompts) if prompts is None else prompts):
        tab = model.tables(i)
        if reset is not None:
            reset()
        t, n_new = 0, 1
        while t < tab.n:
            depth, size = choose(tab, t, n_new)
            size = model.clip_size(depth, size)
            emitted = min(int(tab.acc[t, depth - 1, size]) + 1, tab.n - t)
            time_s += model.draft[min(n_new, model.trace.max_depth + 1), depth] + tab.verify[t, size]
            tokens += emitted
            cycles += 1
            t, n_new = t + emitted, emitted
    return _summary(tokens, time_s, cycles)


def replay_static(trace, profile=None, depth: int = 4, size: int = 12, *, max_new_tokens: int | None = None,
                  prompts: list[int] | None = None) -> dict:
    """Predicted {tokens, time_s, cycles, tokens_per_s, mean_accepted_length} of a fixed (depth, size) config
    (policy time excluded, as the live envs' time)."""
    model = trace if isinstance(trace, ReplayModel) else ReplayModel(trace, profile, max_new_tokens=max_new_tokens)
    depth = min(int(depth), model.trace.max_depth)
    return _simulate(model, lambda tab, t, n: (depth, size), prompts)


def replay_controller(trace, profile=None, controller: Controller | None = None, *,
                      max_new_tokens: int | None = None, prompts: list[int] | None = None) -> dict:
    """Predicted throughput of any Controller under replay: it sees the recorded DraftStates after every level,
    exactly as `SpeculativeDecoder.generate` would show them, and observes replayed CycleRecords."""
    model = trace if isinstance(trace, ReplayModel) else ReplayModel(trace, profile, max_new_tokens=max_new_tokens)
    controller = controller or FixedController()
    d_max = model.trace.max_depth
    prev = [0, 0]  # previous cycle's (accepted, depth) of the current prompt

    def reset():
        prev[:] = [0, 0]
        controller.reset()

    def choose(tab, t, n_new):
        depth = 1
        state = tab.state(t, 1, *prev)
        while depth < d_max and not controller.should_stop(state):
            depth += 1
            state = tab.state(t, depth, *prev)
        size = int(controller.choose_size(state))
        clipped = model.clip_size(depth, size)
        accepted = int(tab.acc[t, depth - 1, clipped])
        emitted = min(accepted + 1, tab.n - t)
        controller.observe(CycleRecord(depth, clipped, accepted, emitted,
                                       float(model.draft[min(n_new, d_max + 1), depth]),
                                       float(tab.verify[t, clipped]), 0.0, tab.prompt_len + t))
        prev[:] = [accepted, depth]
        return depth, size

    return _simulate(model, choose, prompts, reset=reset)


def replay_oracle(trace, profile=None, depths: list[int] | None = None, sizes: list[int] | None = None, *,
                  max_new_tokens: int | None = None, prompts: list[int] | None = None) -> dict:
    """The ceiling any (depth, size) policy can reach on the trace, in hindsight.

    Returns {"oracle": ..., "greedy_oracle": ..., "best_static": {..., "depth", "size"}, "static": [...]}:
      oracle         exact hindsight optimum: per prompt, the cycle sequence minimising the total time to emit the
                     prompt's (fixed, greedy) tokens, by dynamic programming over (position, tokens caught up);
                     maximising throughput = minimising time, as the token count is fixed
      greedy_oracle  per-cycle greedy: each cycle picks the (d, V) with the best emitted/time of that cycle alone
                     (myopic: a longer cycle also moves the position; reported because it is the common "oracle")
      best_static    the best fixed (d, V) over `depths` x `sizes` (a grid search under replay)
    Choices range over `depths` (default 1..max_depth) and `sizes` (default 1..max_size).
    """
    model = trace if isinstance(trace, ReplayModel) else ReplayModel(trace, profile, max_new_tokens=max_new_tokens)
    d_max, max_size = model.trace.max_depth, model.trace.max_size
    depths = np.array(sorted({min(int(d), d_max) for d in (depths or range(1, d_max + 1))}))
    sizes = np.array(sorted({int(s) for s in (sizes or range(1, max_size + 1))}))
    clipped = np.minimum(sizes[None, :], np.array([model.num_candidates[d] for d in depths])[:, None])
    clipped = np.minimum(clipped, max_size)                                   # [nd, nv]
    draft = model.draft                                                        # [D+2, D+1]
    indices = list(range(model.num_prompts)) if prompts is None else prompts

    k_max = d_max + 1
    grid = (len(depths), len(sizes))
    di, vi = np.indices(grid)
    best_tokens, best_time, best_cycles = 0, 0.0, 0
    static_tokens, static_time, static_cycles = np.zeros(grid), np.zeros(grid), np.zeros(grid, dtype=np.int64)
    per_prompt: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for i in indices:
        tab = model.tables(i)
        n = tab.n
        acc = tab.acc[:, depths - 1, :]                                       # [n, nd, max_size+1]
        index = np.broadcast_to(clipped, (n,) + clipped.shape)
        emitted_all = np.minimum(np.take_along_axis(acc, index, axis=2).astype(np.int64) + 1,
                                 (n - np.arange(n))[:, None, None])           # [n, nd, nv]
        verify_all = tab.verify[:, clipped]                                   # [n, nd, nv]
        per_prompt[i] = (emitted_all, verify_all)
        # DP: cost[t, k] = least time to finish from position t when k tokens are to be caught up (k = 1..D+1)
        cost = np.zeros((n + 1, k_max + 1))
        cycles = np.zeros((n + 1, k_max + 1), dtype=np.int64)
        rows = np.arange(k_max)
        for t in range(n - 1, -1, -1):
            e = emitted_all[t]                                                # [nd, nv]
            rest = verify_all[t] + cost[t + e, e]                             # [nd, nv]
            best_v = rest.argmin(axis=1)                                      # [nd]
            rest_min = rest[np.arange(len(depths)), best_v]                   # [nd]
            totals = draft[1: k_max + 1, depths] + rest_min[None, :]          # [k, nd]
            best_d = totals.argmin(axis=1)                                    # [k]
            cost[t, 1:] = totals[rows, best_d]
            e_best = e[best_d, best_v[best_d]]
            cycles[t, 1:] = 1 + cycles[t + e_best, e_best]
        best_tokens += n
        best_time += cost[0, 1]
        best_cycles += int(cycles[0, 1])
        # every static config at once: walk all (d, V) grid cells in lock-step
        t = np.zeros(grid, dtype=np.int64)
        n_new = np.ones(grid, dtype=np.int64)
        while True:
            active = t < n
            if not active.any():
                break
            tt = np.minimum(t, n - 1)
            e = emitted_all[tt, di, vi]
            step_time = draft[np.minimum(n_new, k_max), depths[di]] + verify_all[tt, di, vi]
            static_time += np.where(active, step_time, 0.0)
            static_tokens += np.where(active, e, 0)
            static_cycles += active
            t = np.where(active, t + e, t)
            n_new = np.where(active, e, n_new)

    def greedy(tab, t, n_new):
        emitted_all, verify_all = per_prompt[tab.index]
        ratio = emitted_all[t] / (draft[min(n_new, k_max), depths][:, None] + verify_all[t])
        d_i, v_i = np.unravel_index(int(ratio.argmax()), ratio.shape)
        return int(depths[d_i]), int(sizes[v_i])

    static = [{"depth": int(depths[a]), "size": int(sizes[b]),
               **_summary(static_tokens[a, b], static_time[a, b], static_cycles[a, b])}
              for a in range(grid[0]) for b in range(grid[1])]
    best_static = max(static, key=lambda r: r["tokens_per_s"])
    return {"oracle": _summary(best_tokens, best_time, best_cycles),
            "greedy_oracle": _simulate(model, greedy, indices),
            "best_static": best_static, "static": static}
