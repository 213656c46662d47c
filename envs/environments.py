"""The Gymnasium environments: one depth env and one size env, over live or replayed decoding.

An environment is a thin adapter over `specpilot.drafting.cycle.cycle_steps`, the cycle `generate()` runs: it answers
the agent's questions with its actions and the other questions with a partner Controller. What decodes is a session
source: `LiveSource` starts `DecodingSession`s on real models (wall-clock rewards), `ReplaySource` starts
`ReplaySession`s over a recorded trace and its latency profile (exact accepted lengths, modelled times). Both give
the same spaces, observations, rewards and info.

    specpilot/Depth-v0        live_depth_env(pair, prompts, ...)        DepthEnv(LiveSource(...))
    specpilot/Size-v0         live_size_env(pair, prompts, ...)         SizeEnv(LiveSource(...))
    specpilot/ReplayDepth-v0  replay_depth_env(trace, profile, ...)     DepthEnv(ReplaySource(...))
    specpilot/ReplaySize-v0   replay_size_env(trace, profile, ...)      SizeEnv(ReplaySource(...))
"""
from __future__ import annotations

import operator
import warnings
from copy import deepcopy
from typing import Any, Sequence

import gymnasium as gym
import numpy as np

from specpilot.drafting.checks import check_float, check_int
from specpilot.drafting.control import Controller, FixedController, fits_tree
from specpilot.drafting.cycle import SIZE, SKIP, STOP, check_size, cycle_steps
from specpilot.drafting.types import CycleRecord, DraftState, TreeConfig
from specpilot.envs.batch_replay import BatchReplaySession, BatchTimes
from specpilot.envs.replay import ReplayModel, ReplaySession
from specpilot.envs.rewards import Reward, make_reward
from specpilot.envs.spaces import observation_space
from specpilot.policies.heuristics import RandomDepthController
from specpilot.policies.learned import STOP as STOP_ACTION
from specpilot.policies.observation import (BATCH_FEATURES, DEFAULT_FEATURES, DEFAULT_SIZE_FEATURES, ObservationSpec,
                                            default_size_actions, depth_observation, size_observation)

RESET_OPTIONS = ("prompt_index", "batch_size")  # what reset(options=...) takes
CYCLE_INFO_KEYS = ("accepted", "emitted", "depth", "size", "draft_s", "verify_s")


class RenderModeError(TypeError, ValueError):
    """A render mode the envs do not have. A TypeError too, because that is what SB3's `make_vec_env` (which asks
    for render_mode="rgb_array" first) and other callers catch before building an env without one."""


def own_copy(partner: Any, what: str) -> Any:
    """An env's own copy of a Controller partner (`copy.deepcopy`), so that envs built from the same keyword
    arguments (a vector env, SB3's make_vec_env) never share a controller's per-generation state; any other value
    passes through. A controller that cannot be copied is shared, with a warning."""
    if not isinstance(partner, Controller):
        return partner
    try:
        return deepcopy(partner)
    except Exception as err:  # noqa: BLE001 - any failure to copy leaves the documented fallback: share it
        warnings.warn(f"{what} {type(partner).__name__} cannot be copied ({type(err).__name__}: {err}); this env "
                      "uses the object itself, so envs given the same one share its state", stacklevel=3)
        return partner


def as_depth_controller(partner: Any, device: str | None = None) -> Controller:
    """None -> FixedController (default depth for the device); int d -> FixedController(depth=d);
    (low, high) -> RandomDepthController(low, high); a Controller passes through."""
    if partner is None:
        return FixedController(device=device)
    if isinstance(partner, Controller):
        return partner
    if isinstance(partner, (tuple, list)) and len(partner) == 2:
        return RandomDepthController(partner[0], partner[1], device=device)  # checked there, not truncated
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


def cycle_info(record: CycleRecord, **extra) -> dict:
    """The info of a step that ends a cycle (train/rl/logging.py's CycleMetricsCallback reads CYCLE_INFO_KEYS)."""
    info = {"accepted": record.accepted, "emitted": record.emitted, "depth": record.depth, "size": record.size,
            "draft_s": record.draft_s, "verify_s": record.verify_s, "context_len": record.context_len}
    info.update(extra)
    return info


# ---------------------------------------------------------------------------------------------------------------------
# session sources


class LiveSource:
    """Generations of `prompts` (token-id lists or strings) on `pair` with the speculative decoder."""

    kind = "live"

    def __init__(self, pair, prompts, *, tree: TreeConfig | None = None, max_new_tokens: int = 128,
                 temperature: float = 0.0) -> None:
        from specpilot.drafting.decoder import SpeculativeDecoder

        _check_prompts(prompts)
        check_int("max_new_tokens", max_new_tokens, minimum=1)
        self.pair, self.tree = pair, tree or TreeConfig()
        self.decoder = SpeculativeDecoder(pair, self.tree)
        self.prompts = [pair.encode(getattr(p, "prompt", p)) for p in prompts]
        self.indices = list(range(len(self.prompts)))
        self.max_new_tokens, self.temperature = int(max_new_tokens), float(temperature)
        self.device = str(pair.device)

    def start(self, index: int, rng: np.random.Generator):
        seed = int(rng.integers(2**31 - 1))
        return self.decoder.start(self.prompts[index], max_new_tokens=self.max_new_tokens,
                                  temperature=self.temperature, seed=seed)


class ReplaySource:
    """Replays of a recorded trace (dir / trace.npz / Trace) timed by its latency profile; `prompts` selects the
    trace's prompt indices episodes are drawn from; `time_noise` adds seeded timing noise (see ReplaySession).

    batch_sizes: None (default) replays one sequence per episode; a tuple of batch sizes (e.g. (1, 2, 4, 8, 16))
    makes every episode a batch (`specpilot.envs.batch_replay.BatchReplaySession`): its size drawn uniformly from
    `batch_sizes` with the env's seeded generator, the episode's prompt leading B - 1 others drawn from `prompts`
    (without replacement while there are enough), timed by the profile's batch curves (`LatencyProfile.batch`;
    batches take no time_noise)."""

    kind = "replay"

    def __init__(self, trace, profile=None, *, max_new_tokens: int | None = None, time_noise: float = 0.0,
                 prompts: list[int] | None = None, batch_sizes: Sequence[int] | None = None) -> None:
        if max_new_tokens is not None:
            check_int("max_new_tokens", max_new_tokens, minimum=1)
        check_float("time_noise", time_noise, minimum=0.0)  # a relative spread: nan or < 0 would poison rewards
        self.model = ReplayModel(trace, profile, max_new_tokens=max_new_tokens)
        self.batch_sizes = check_batch_sizes(batch_sizes, self.model.profile) if batch_sizes is not None else None
        if self.batch_sizes and time_noise:
            raise ValueError(f"time_noise={time_noise}: batch replay has no timing noise model; drop one of "
                             "time_noise and batch_sizes")
        self.times = BatchTimes(self.model) if self.batch_sizes else None
        trace = self.model.trace
        self.tree = TreeConfig(width=trace.width, max_depth=trace.max_depth, max_size=trace.max_size)
        self.indices = list(range(trace.num_prompts)) if prompts is None else \
            [check_int("prompts (trace prompt indices)", i) for i in prompts]
        if not self.indices or not all(0 <= i < trace.num_prompts for i in self.indices):
            raise ValueError(f"prompts must select prompts of the trace (0..{trace.num_prompts - 1}), got {prompts}")
        self.max_new_tokens, self.time_noise = self.model.max_new_tokens, float(time_noise)
        self.device = trace.header.get("device")
        self.prompts = self.indices

    def start(self, index: int, rng: np.random.Generator, batch_size: int | None = None):
        """A ReplaySession of prompt `index`; with batch sizes a BatchReplaySession led by it (`batch_size` or a
        drawn one)."""
        if not self.batch_sizes:
            return ReplaySession(self.model, index, rng=rng, time_noise=self.time_noise)
        b = int(batch_size) if batch_size is not None else int(rng.choice(self.batch_sizes))
        others = [i for i in self.indices if i != index] or [index]
        rest = rng.choice(others, size=b - 1, replace=len(others) < b - 1).tolist() if b > 1 else []
        return BatchReplaySession(self.model, [index, *(int(i) for i in rest)], times=self.times)


def check_batch_sizes(batch_sizes: Sequence[int], profile) -> tuple[int, ...]:
    """Batch sizes >= 1 a profile can time: sizes above 1 need its batch curves (`grid --batch-sizes` measures
    them); refused otherwise, naming the fix."""
    sizes = tuple(sorted({int(b) for b in batch_sizes}))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_sizes must be a non-empty list of sizes >= 1, got {list(batch_sizes)}")
    measured = profile.batch_sizes
    if sizes[-1] > 1 and (not measured or sizes[-1] > measured[-1]):
        raise ValueError(f"batch_sizes {list(sizes)}: the latency profile measured batch sizes {measured or [1]}; "
                         "measure them with `specpilot grid --batch-sizes ...` (it saves <stem>.profile_w<W>.json) "
                         "and replay with that profile")
    return sizes


def env_features(source, features: Sequence[str] | None, kind: str = "depth") -> tuple[str, ...]:
    """The optional observation features of a `kind` env: `features` when given, else the defaults (a size env's
    include `DEFAULT_SIZE_FEATURES`, the candidates' depths), plus the batch features (`BATCH_FEATURES`) when the
    source replays batches."""
    if isinstance(features, (str, bytes)):
        raise TypeError(f"features must be a list of feature names, got the string {features!r} (write "
                        f"[{features!r}])")
    if features is not None:
        return tuple(features)
    return (DEFAULT_FEATURES + (DEFAULT_SIZE_FEATURES if kind == "size" else ())
            + (BATCH_FEATURES if getattr(source, "batch_sizes", None) else ()))


# ---------------------------------------------------------------------------------------------------------------------
# environments


class _DecisionEnv(gym.Env):
    """Episode handling shared by both envs: prompt choice, seeding, driving the cycle protocol."""

    metadata = {"render_modes": []}
    agent_questions: tuple[str, ...] = ()

    def __init__(self, source, *, reward: str | Reward, max_context: int, render_mode: str | None = None) -> None:
        if render_mode is not None:
            raise RenderModeError(f"render_mode={render_mode!r}: specpilot's envs render nothing (metadata "
                                  "render_modes is empty); each step's info dict reports the cycle instead")
        self.render_mode = None
        self.source = source
        self.tree = source.tree
        self.device = source.device
        self.max_new_tokens = source.max_new_tokens
        self.max_context = check_int("max_context", max_context, minimum=1)
        self.reward_fn = self._reward_proto = make_reward(reward)
        self._rewards: dict[int, Reward] = {}   # batch size -> its reward (batch episodes; see _start)
        self.session = None
        self.state: DraftState | None = None
        self.prompt_index = -1
        self._steps = None       # the running cycle (a generator) between reset() and the episode's end
        self._pending = None

    def __getstate__(self) -> dict:
        # a running cycle is a generator, which neither copy nor pickle can take: say so instead of "cannot pickle
        # 'generator' object", and name when a copy works
        if self._steps is not None:
            raise TypeError(f"{type(self).__name__} cannot be copied or pickled during an episode (its decoder cycle "
                            "is running): copy it before reset() or after the episode has ended")
        return self.__dict__.copy()

    # the partner answers the questions the agent does not (and observes every cycle)
    def _partner(self) -> Controller:
        raise NotImplementedError

    def _observe(self, state: DraftState) -> np.ndarray:
        raise NotImplementedError

    def _partner_answer(self, question: str, state: DraftState):
        partner = self._partner()
        if question == SKIP:
            return partner.skip_drafting(state)
        if question == STOP:
            return partner.should_stop(state)
        return partner.choose_size(state)

    def _check_options(self, options: dict | None) -> dict:
        """The reset options, checked before the reset touches anything (a refused reset leaves the env as it was)."""
        options = {} if options is None else options
        if not isinstance(options, dict):
            raise TypeError(f"reset options must be a dict (or None), got {type(options).__name__}")
        unknown = sorted(set(options) - set(RESET_OPTIONS))
        if unknown:
            raise ValueError(f"unknown reset option(s) {unknown}: this env takes {list(RESET_OPTIONS)}")
        checked = dict(options)
        if "prompt_index" in options:
            index = check_int("reset option prompt_index", options["prompt_index"])
            if index not in self.source.indices:
                raise ValueError(f"prompt_index {index} is not one of this env's prompts {self.source.indices}")
            checked["prompt_index"] = index
        if options.get("batch_size") is not None:
            if not getattr(self.source, "batch_sizes", None):
                raise ValueError("reset(options={'batch_size': ...}) needs a source with batch_sizes")
            batch_size = check_int("reset option batch_size", options["batch_size"], minimum=1)
            check_batch_sizes((batch_size,), self.source.model.profile)  # a size its profile cannot time: refused
            checked["batch_size"] = batch_size
        return checked

    def _start(self, seed: int | None, options: dict | None) -> dict:
        options = self._check_options(options)
        # seeds only the env's own generators (np_random; the live decoder's draws are seeded from it), never
        # torch's global one, which belongs to the caller (SB3 samples its actions from it)
        super().reset(seed=seed)
        if seed is not None:  # a seeded reset starts the env afresh (Gymnasium: same seed and actions, same
            # rewards): running reward statistics (dinkelbach's throughput estimate, time's scale) are forgotten.
            # Training seeds only its first reset, so across its episodes they still persist
            self._rewards.clear()
            forget = getattr(self._reward_proto, "reset_statistics", None)
            if callable(forget):
                forget()
        if "prompt_index" in options:
            index = options["prompt_index"]
        else:
            index = self.source.indices[int(self.np_random.integers(len(self.source.indices)))]
        self.prompt_index = index
        partner = self._partner()
        seed_fn = getattr(partner, "seed", None)
        if callable(seed_fn):  # a partner that draws (RandomDepthController) follows the env's seed
            seed_fn(int(self.np_random.integers(2**31 - 1)))
        partner.reset()
        batch_size = options.get("batch_size")
        if batch_size is None:
            self.session = self.source.start(index, self.np_random)
        else:
            self.session = self.source.start(index, self.np_random, batch_size=batch_size)
        rows = len(getattr(self.session, "rows", ())) or 1
        # a batch reward scores the batch's tokens/s, which scales with its size: a running reward (dinkelbach's
        # throughput estimate) keeps one set of statistics per batch size
        self.reward_fn = self._rewards.setdefault(rows, deepcopy(self._reward_proto)) if rows > 1 else \
            self._reward_proto
        self.reward_fn.reset()
        self._steps = cycle_steps(self.session)
        self._pending = None
        return {"prompt_index": index, "prompt_len": self.session.prompt_len, "batch_size": rows}

    def _advance(self, answer: Any = None) -> tuple[float, bool, bool, dict]:
        """Send the agent's answer (None: prime the protocol), let the partner answer its questions, and run until
        the agent's next question or the episode's end. Returns (reward of the cycles finished, terminated,
        truncated, info); `self.state` is the state of the agent's pending question (or the last one)."""
        reward, info = 0.0, {}
        while True:
            try:
                question, state = next(self._steps) if self._pending is None else self._steps.send(answer)
            except StopIteration as end:
                record = end.value
                self._partner().observe(record)
                batch_record = getattr(self.session, "batch_record", None)
                scored = batch_record() if batch_record is not None else record  # a batch: all rows' tokens
                reward += float(self.reward_fn(scored))
                info = cycle_info(record, new_tokens=self.session.tokens_emitted, prompt_index=self.prompt_index)
                if batch_record is not None:
                    info.update(batch_size=self.session.batch_sizes[-1], batch_emitted=scored.emitted)
                if self.session.done:
                    finished = self.session.finished_by
                    info["finished_by"] = finished
                    self._steps = self._pending = None
                    self.state = self._end_state(record)
                    return reward, finished == "eos", finished != "eos", info
                self._steps, self._pending = cycle_steps(self.session), None
                continue
            self._pending = question
            self.state = state
            if question in self.agent_questions:
                return reward, False, False, info
            answer = self._partner_answer(question, state)

    def _end_state(self, record: CycleRecord) -> DraftState:
        """The state the generation ended in, for the observation a step returns at the episode's end (SB3
        bootstraps a truncated episode's value from it): nothing drafted (depth 0, no scores), the final context
        length and token count, the last cycle as the previous one, the final acceptance rate; a batch keeps its
        last load (every row has finished)."""
        last, session = self.state, self.session
        rows = getattr(session, "rows", None)
        if rows:  # a batch: its lead row's counts, as its states give them, and the rows' final lengths
            lengths = [r.prompt_len + r.tokens_emitted for r in rows]
            lead = getattr(session, "last_lead", rows[0])
            context_len, new_tokens = lead.prompt_len + lead.tokens_emitted, lead.tokens_emitted
            acceptance = getattr(lead, "acceptance", last.acceptance)
            load = dict(batch_size=last.batch_size, context_max=max(lengths), context_mean=sum(lengths) / len(lengths))
        else:
            new_tokens = session.tokens_emitted
            context_len, load = session.prompt_len + new_tokens, {}
            acceptance = getattr(session, "acceptance", last.acceptance)
        return DraftState(depth=0, max_depth=last.max_depth, width=last.width, context_len=context_len,
                          new_tokens=new_tokens, max_new_tokens=last.max_new_tokens, prev_accepted=record.accepted,
                          prev_depth=record.depth, acceptance=float(acceptance), **load)

    def _action_index(self, action) -> int:
        """The action as an int in the action space, or a clear error (no negative indexing, no floats)."""
        n = int(self.action_space.n)
        try:  # an integer scalar of any kind (int, numpy, 0-d tensor); never a bool, float or array of several
            # (a torch tensor of shape (1,) has __index__; Gymnasium's Discrete.contains takes shape () only)
            scalar = not isinstance(action, (bool, np.bool_)) and getattr(action, "ndim", 0) == 0
            index = operator.index(action) if scalar else None
        except TypeError:
            index = None
        if index is None or not 0 <= index < n:
            raise ValueError(f"action {action!r} is outside {type(self).__name__}'s action space: give an integer "
                             f"in 0..{n - 1}")
        return index

    def render(self) -> None:
        """Nothing to draw (render_mode is always None): each step's info dict reports the cycle."""
        return None

    def _check_running(self) -> None:
        if self.session is None:
            raise RuntimeError("call reset() before step()")
        if self.session.done:
            raise RuntimeError("the episode has ended (terminated or truncated): call reset()")

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        info = self._start(seed, options)
        self._advance()
        return self._observe(self.state), info


class DepthEnv(_DecisionEnv):
    """Learn when to draft and when to stop: one decision before drafting and after every draft forward.

    ## Description
    Each episode generates one prompt (drawn with the seeded generator from the source's prompts). Before each
    cycle's first draft forward the agent decides whether to draft at all (STOP there skips drafting: the target
    takes one plain step); after every draft forward below `max_depth` it decides whether to draft another level
    or to stop and verify. The verification size comes from `size_controller`.

    ## Action Space
    `Discrete(2)`: 0 = CONTINUE (draft one more level), 1 = STOP (verify now; before drafting: a plain step). When
    a CONTINUE reaches max_depth the cycle is verified in the same step (the decoder never asks at max_depth).

    ## Observation Space
    `Box(2*W*W + 6)` float32, `specpilot.policies.observation.depth_observation`: the last level's W*W cumulative
    log-probabilities (W at depth 1, none before drafting) in drafting order, scaled into [-1, 0], padded with -1
    and an explicit validity mask; then depth/max_depth, context length/max_context, new tokens/max_new_tokens,
    the previous cycle's accepted length and depth / max_depth, and the running acceptance rate.

    ## Rewards
    0 until a cycle ends; then `reward(record)` of the cycle (see `specpilot.envs.rewards`; "throughput" is
    emitted tokens per second of draft + verify time).

    ## Starting State
    The prompt is prefilled (not timed); the first question is the first cycle's skip decision (depth 0).

    ## Episode End
    terminated: the target emitted EOS (a batch: every row did). truncated: `max_new_tokens` tokens were emitted
    (a batch: some row's budget ended it). The last step's observation is of the state the generation ended in:
    nothing drafted, the final context length and progress, the last cycle as the previous one.

    ## Info
    A step that ends a cycle: `accepted, emitted, depth, size, draft_s, verify_s, context_len, new_tokens,
    prompt_index` (+ `finished_by` at the end); other steps: `depth`. Reset: `prompt_index, prompt_len, batch_size`
    (1 unless the source replays batches).

    ## Arguments
    source: LiveSource or ReplaySource (or use `gym.make` with the registered ids). reward: a name or reward
    object; a seeded reset forgets its running statistics (same seed and actions, same rewards), unseeded resets
    keep them. size_controller: Controller (the env keeps its own copy: envs of a vector env never share one), int
    size, or None (FixedController with the device's default size).
    max_context: context length mapped to 1.0 in the observation. skip_decisions: False leaves the skip decision to
    the partner (the agent then only decides after draft forwards). reset(options={"prompt_index": i}) picks a
    prompt explicitly (options are checked before the reset changes anything). features: optional observation
    features (default: none; a SizeEnv's: `candidate_depths`; plus the batch features `batch, context_max` when the
    source replays batches). Batches
    (`ReplaySource(batch_sizes=...)`): one decision per cycle for the whole batch, the reward scores the batch's
    cycle (every row's emitted tokens: batch tokens/s), reset(options={"batch_size": b}) fixes the size, info adds
    `batch_size` (reset; cycles: the rows in the cycle) and `batch_emitted`.

    ## Example
        >>> import gymnasium as gym, specpilot.envs
        >>> env = gym.make("specpilot/Depth-v0", pair=pair, prompts=["def f(x):"], max_new_tokens=64)
        >>> obs, info = env.reset(seed=0)
        >>> obs, reward, terminated, truncated, info = env.step(0)
    """

    def __init__(self, source, *, reward: str | Reward = "throughput",
                 size_controller: Controller | int | None = None, max_context: int = 4096,
                 skip_decisions: bool = True, features: Sequence[str] | None = None,
                 render_mode: str | None = None) -> None:
        super().__init__(source, reward=reward, max_context=max_context, render_mode=render_mode)
        if not isinstance(skip_decisions, (bool, np.bool_)):
            raise TypeError(f"skip_decisions must be True or False, got {skip_decisions!r}")
        # without skip decisions the partner answers them (a size-only partner never skips)
        self.agent_questions = (SKIP, STOP) if skip_decisions else (STOP,)
        self.size_controller = as_size_controller(own_copy(size_controller, "size_controller"), self.device)
        fits_tree(self.size_controller, self.tree)
        self.spec_obs = ObservationSpec.for_depth(self.tree.width, self.tree.max_depth, max_context=self.max_context,
                                                  features=env_features(source, features))
        self.observation_space = observation_space(self.spec_obs)
        self.action_space = gym.spaces.Discrete(2)

    def _partner(self) -> Controller:
        return self.size_controller

    def _observe(self, state: DraftState) -> np.ndarray:
        return depth_observation(state, self.spec_obs)

    def step(self, action):
        self._check_running()
        reward, terminated, truncated, info = self._advance(self._action_index(action) == STOP_ACTION)
        return self._observe(self.state), reward, terminated, truncated, info or {"depth": self.state.depth}


class SizeEnv(_DecisionEnv):
    """Learn how many drafted candidates to verify: one decision per draft-and-verify cycle.

    ## Description
    Each episode generates one prompt (drawn with the seeded generator from the source's prompts). Every cycle the
    tree is drafted as deep as `depth_controller` decides (`should_stop` after each level, never past `max_depth`;
    every cycle drafts at least one level: the partner's skip decisions are not consulted, since sizes only matter
    when something is drafted); the agent then picks how many of the best-scored candidates the target verifies.

    ## Action Space
    `Discrete(len(size_actions))`: index into `size_actions` (default: `default_size_actions(device)`). Sizes above
    the candidates drafted are clipped by the decoder (`info["size"]` is the size actually verified).

    ## Observation Space
    `Box(2*max(size_actions) + 6)` float32, `specpilot.policies.observation.size_observation`: the best
    max(size_actions) candidate scores of the whole tree sorted, scaled, padded with -1 and masked; then the same
    scalars as the depth env.

    ## Rewards
    `reward(record)` of the cycle.

    ## Starting State
    The prompt is prefilled (not timed) and the first tree is drafted.

    ## Episode End
    As DepthEnv (the last observation has no candidate scores).

    ## Info
    Every step: `accepted, emitted, depth, size, draft_s, verify_s, context_len, new_tokens, prompt_index`
    (+ `finished_by` at the end). Reset: `prompt_index, prompt_len, batch_size`.

    ## Arguments
    source, reward, max_context: as DepthEnv. size_actions: verification sizes (<= the tree's max_size).
    depth_controller: Controller (copied, as DepthEnv's size_controller), int depth, (low, high) for random depths,
    or None (the device's default depth).
    features, batches: as DepthEnv.

    ## Example
        >>> env = gym.make("specpilot/ReplaySize-v0", trace="runs/demo/traces/train", depth_controller=(1, 8))
    """

    agent_questions = (SIZE,)

    def __init__(self, source, *, reward: str | Reward = "throughput", size_actions: list[int] | None = None,
                 depth_controller: Controller | int | tuple | None = None, max_context: int = 4096,
                 features: Sequence[str] | None = None, render_mode: str | None = None) -> None:
        super().__init__(source, reward=reward, max_context=max_context, render_mode=render_mode)
        sizes = [check_int("size_actions", v) for v in
                 (default_size_actions(self.device) if size_actions is None else size_actions)]
        if not sizes or min(sizes) < 1:
            raise ValueError(f"size_actions must be a non-empty list of sizes >= 1, got {sizes}")
        if max(sizes) > self.tree.max_size:
            raise ValueError(f"size_actions go up to {max(sizes)} but the tree's max_size is {self.tree.max_size}: "
                             "record / build the tree with a larger max_size or drop the larger sizes")
        self.size_actions = sizes
        self.depth_controller = as_depth_controller(own_copy(depth_controller, "depth_controller"), self.device)
        fits_tree(self.depth_controller, self.tree)
        self.spec_obs = ObservationSpec.for_size(self.tree.width, self.tree.max_depth, size_actions=sizes,
                                                 max_context=self.max_context,
                                                 features=env_features(source, features, "size"))
        self.observation_space = observation_space(self.spec_obs)
        self.action_space = gym.spaces.Discrete(len(sizes))

    def _partner(self) -> Controller:
        return self.depth_controller

    def _partner_answer(self, question: str, state: DraftState):
        if question == SKIP:  # asked (a partner may draw its depth here) but every cycle drafts: sizes only matter
            super()._partner_answer(question, state)  # there, and a partner that always skipped would starve the agent
            return False
        return super()._partner_answer(question, state)

    def _observe(self, state: DraftState) -> np.ndarray:
        return size_observation(state, self.spec_obs)

    def step(self, action):
        self._check_running()
        size = check_size(self.size_actions[self._action_index(action)])
        reward, terminated, truncated, info = self._advance(size)
        return self._observe(self.state), reward, terminated, truncated, info


# ---------------------------------------------------------------------------------------------------------------------
# registered constructors


def resolve_live_tree(size_actions, tree: TreeConfig | None, pair) -> TreeConfig:
    """The tree of a live size env: a default tree is sized to verify the largest size action."""
    if tree is None:
        sizes = size_actions or default_size_actions(str(pair.device))
        tree = TreeConfig(max_size=max(max(int(v) for v in sizes), TreeConfig().max_size))
    return tree


def _check_prompts(prompts) -> None:
    if isinstance(prompts, (str, bytes)) or not prompts or isinstance(prompts[0], (int, np.integer)):
        raise TypeError("prompts must be a non-empty list of prompts (strings or token-id lists)")


def _pair(pair, prompts):
    _check_prompts(prompts)  # before loading the default pair: a missing prompt list should not cost a model load
    if pair is None:
        from specpilot.drafting.pair import ModelPair

        return ModelPair.from_pretrained()
    return pair


def live_depth_env(pair=None, prompts=None, *, max_new_tokens: int = 128, tree: TreeConfig | None = None,
                   temperature: float = 0.0, **kwargs) -> DepthEnv:
    """specpilot/Depth-v0: DepthEnv over live decoding of `prompts` (strings or token-id lists)."""
    pair = _pair(pair, prompts)
    source = LiveSource(pair, prompts, tree=tree, max_new_tokens=max_new_tokens, temperature=temperature)
    return DepthEnv(source, **kwargs)


def live_size_env(pair=None, prompts=None, *, max_new_tokens: int = 128, tree: TreeConfig | None = None,
                  temperature: float = 0.0, size_actions: list[int] | None = None, **kwargs) -> SizeEnv:
    """specpilot/Size-v0: SizeEnv over live decoding of `prompts` (strings or token-id lists)."""
    pair = _pair(pair, prompts)
    source = LiveSource(pair, prompts, tree=resolve_live_tree(size_actions, tree, pair),
                        max_new_tokens=max_new_tokens, temperature=temperature)
    return SizeEnv(source, size_actions=size_actions, **kwargs)


def replay_depth_env(trace, profile=None, *, max_new_tokens: int | None = None, time_noise: float = 0.0,
                     prompts: list[int] | None = None, batch_sizes: Sequence[int] | None = None,
                     **kwargs) -> DepthEnv:
    """specpilot/ReplayDepth-v0: DepthEnv over replays of a recorded trace (`specpilot record`); `batch_sizes`
    replays batches (see ReplaySource)."""
    source = ReplaySource(trace, profile, max_new_tokens=max_new_tokens, time_noise=time_noise, prompts=prompts,
                          batch_sizes=batch_sizes)
    return DepthEnv(source, **kwargs)


def replay_size_env(trace, profile=None, *, max_new_tokens: int | None = None, time_noise: float = 0.0,
                    prompts: list[int] | None = None, batch_sizes: Sequence[int] | None = None,
                    **kwargs) -> SizeEnv:
    """specpilot/ReplaySize-v0: SizeEnv over replays of a recorded trace (`specpilot record`); `batch_sizes`
    replays batches (see ReplaySource)."""
    source = ReplaySource(trace, profile, max_new_tokens=max_new_tokens, time_noise=time_noise, prompts=prompts,
                          batch_sizes=batch_sizes)
    return SizeEnv(source, **kwargs)
