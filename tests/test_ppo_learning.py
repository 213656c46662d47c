"""PPO must actually learn (a toy stopping problem where the best depth depends on an observed feature), and the
PPOController must reproduce the trained policy's deterministic decisions from DraftStates."""
from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
import torch
from stable_baselines3 import PPO

from specpilot.drafting.types import DraftState
from specpilot.envs.spaces import observation_space
from specpilot.policies import FixedController
from specpilot.policies.actor import Actor, ActorError
from specpilot.policies.observation import ObservationSpec, depth_observation, size_observation
from specpilot.policies.ppo import PPOController
from specpilot.train.rl.ppo import WarmupLinearSchedule, settings_for, train_policy

MAX_DEPTH = 10
ACCEPT = {0: 0.2, 1: 0.95}  # per-token acceptance rate given the observed feature x
DRAFT_COST, VERIFY_COST = 0.25, 1.0


def throughput(depth: int, x: int) -> float:
    """Expected tokens per cycle / cycle time: geometric acceptance, plus the bonus token."""
    a = ACCEPT[x]
    return ((1 - a ** (depth + 1)) / (1 - a)) / (VERIFY_COST + DRAFT_COST * depth)


class ToyStopEnv(gym.Env):
    """One episode = one draft cycle. Observation [x, depth/MAX_DEPTH]; action 0 CONTINUE / 1 STOP; reward at STOP
    (or at MAX_DEPTH) = expected throughput. Best depth: 1 when x=0, ~8-10 when x=1."""

    observation_space = gym.spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.x = int(self.np_random.integers(2))
        self.depth = 1
        return self._obs(), {}

    def _obs(self):
        return np.array([self.x, self.depth / MAX_DEPTH], dtype=np.float32)

    def step(self, action):
        if action == 1 or self.depth >= MAX_DEPTH:
            r = throughput(self.depth, self.x)
            t = VERIFY_COST + DRAFT_COST * self.depth
            info = {"accepted": self.depth * ACCEPT[self.x], "emitted": r * t, "depth": self.depth, "size": 4,
                    "draft_s": DRAFT_COST * self.depth, "verify_s": VERIFY_COST}
            return self._obs(), r, True, False, info
        self.depth += 1
        return self._obs(), 0.0, False, False, {}


def exact_value(model) -> float:
    """Mean per-cycle throughput of the deterministic policy over both (equally likely) features."""
    total = 0.0
    for x in (0, 1):
        depth = 1
        while depth < MAX_DEPTH:
            action, _ = model.predict(np.array([x, depth / MAX_DEPTH], dtype=np.float32), deterministic=True)
            if int(action) == 1:
                break
            depth += 1
        total += throughput(depth, x)
    return total / 2


def best_fixed_value() -> float:
    return max((throughput(d, 0) + throughput(d, 1)) / 2 for d in range(1, MAX_DEPTH + 1))


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny MLPs: threads only contend with other jobs on a shared machine
    yield
    torch.set_num_threads(old)


def test_ppo_beats_best_fixed_depth(tmp_path, one_thread):
    optimum = (throughput(1, 0) + max(throughput(d, 1) for d in range(1, MAX_DEPTH + 1))) / 2
    fixed = best_fixed_value()
    assert optimum - fixed > 0.2  # the toy problem leaves room for adaptivity
    settings = settings_for("depth", total_timesteps=2048, n_steps=256, batch_size=64, n_epochs=10,
                            pi_arch=[32], vf_arch=[32], seed=3, eval_every=512, checkpoint_every=10**9)
    best = train_policy(ToyStopEnv, exact_value, settings, tmp_path, "toy")
    learned = exact_value(PPO.load(best, device="cpu"))
    assert learned > fixed + 0.15, f"learned {learned:.3f} vs best fixed {fixed:.3f} (optimum {optimum:.3f})"
    assert json.loads((tmp_path / "toy" / "best.json").read_text())["score"] == pytest.approx(learned)


@pytest.mark.parametrize("progress_remaining, expected", [(1.0, 0.01), (0.995, 0.5), (0.99, 1.0), (0.5, 0.505),
                                                          (0.0, 0.0)])
def test_warmup_linear_schedule(progress_remaining, expected):
    schedule = WarmupLinearSchedule(peak=1.0, warmup_fraction=0.01)
    assert schedule(progress_remaining) == pytest.approx(expected, rel=1e-2, abs=1e-6)


def test_settings_for_paper_defaults():
    depth, size = settings_for("depth"), settings_for("size")
    assert (depth.pi_arch, depth.vf_arch, depth.gamma) == ([1024], [1024, 256], 0.999)
    assert (size.pi_arch, size.vf_arch, size.gamma) == ([1024, 256], [1024, 256], 0.9)
    assert (depth.n_epochs, depth.ent_coef, depth.n_steps, depth.batch_size) == (20, 0.01, 2048, 256)
    with pytest.raises(TypeError, match="nope"):
        settings_for("depth", nope=1)


# ---------------------------------------------------------------------------------------------------------------
# PPOController reproduces SB3's deterministic predictions

W, DMAX = 2, 6
DEPTH_SPEC = ObservationSpec.for_depth(W, DMAX, max_context=64)
SIZE_ACTIONS = [2, 4, 6, 8]
SIZE_SPEC = ObservationSpec.for_size(W, DMAX, size_actions=SIZE_ACTIONS, max_context=64)


class SpaceOnlyEnv(gym.Env):
    def __init__(self, spec: ObservationSpec, n_actions: int) -> None:
        self.observation_space = observation_space(spec)
        self.action_space = gym.spaces.Discrete(n_actions)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, True, False, {}


def random_state(rng: np.random.Generator) -> DraftState:
    depth = int(rng.integers(0, DMAX + 1))
    levels = [-np.abs(rng.normal(0, 4, size=W if d == 1 else W * W)) for d in range(1, depth + 1)]
    return DraftState.from_levels(levels, max_depth=DMAX, width=W, context_len=int(rng.integers(1, 100)),
                                  last_top_prob=0.5, last_entropy=1.0, new_tokens=3, max_new_tokens=16,
                                  prev_accepted=int(rng.integers(0, 4)), prev_depth=int(rng.integers(0, 5)),
                                  acceptance=float(rng.uniform()))


def perturbed(model: PPO, seed: int) -> PPO:
    # random init gives near-uniform logits; scale the action head so decisions vary across states
    with torch.no_grad():
        torch.manual_seed(seed)
        model.policy.action_net.weight.normal_(0, 3.0)
    return model


def test_ppo_controller_matches_sb3_predict():
    depth_model = perturbed(PPO("MlpPolicy", SpaceOnlyEnv(DEPTH_SPEC, 2), policy_kwargs={"net_arch": [16]}, seed=5), 5)
    size_model = perturbed(PPO("MlpPolicy", SpaceOnlyEnv(SIZE_SPEC, len(SIZE_ACTIONS)),
                               policy_kwargs={"net_arch": [16]}, seed=1), 1)
    ctrl = PPOController(depth_model, size_model, DEPTH_SPEC, SIZE_SPEC, SIZE_ACTIONS)
    rng = np.random.default_rng(0)
    stops, sizes = set(), set()
    for _ in range(200):
        state = random_state(rng)
        want_stop = int(depth_model.predict(depth_observation(state, DEPTH_SPEC), deterministic=True)[0]) == 1
        want_size = SIZE_ACTIONS[int(size_model.predict(size_observation(state, SIZE_SPEC), deterministic=True)[0])]
        assert (ctrl.skip_drafting(state) if state.depth == 0 else ctrl.should_stop(state)) == want_stop
        assert ctrl.choose_size(state) == want_size
        stops.add(want_stop)
        sizes.add(want_size)
    assert len(stops) == 2 and len(sizes) > 1  # the comparison exercised different decisions


def test_ppo_controller_fallback_decides_missing_parts():
    depth_model = PPO("MlpPolicy", SpaceOnlyEnv(DEPTH_SPEC, 2), policy_kwargs={"net_arch": [8]}, seed=0)
    ctrl = PPOController(depth_policy=depth_model, depth_spec=DEPTH_SPEC, fallback=FixedController(3, 5))
    state = random_state(np.random.default_rng(1))
    assert ctrl.choose_size(state) == 5
    size_model = PPO("MlpPolicy", SpaceOnlyEnv(SIZE_SPEC, len(SIZE_ACTIONS)), policy_kwargs={"net_arch": [8]}, seed=0)
    size_only = PPOController(size_policy=size_model, size_spec=SIZE_SPEC, size_actions=SIZE_ACTIONS,
                              fallback=FixedController(3, 5))
    state3 = DraftState.from_levels([np.zeros(W), np.zeros(W * W), np.zeros(W * W)], max_depth=DMAX, width=W,
                                    context_len=1, max_new_tokens=8)
    assert size_only.should_stop(state3) and not size_only.skip_drafting(state)


def test_ppo_controller_needs_a_policy():
    with pytest.raises(ValueError, match="actor"):
        PPOController(fallback=FixedController(3, 5))


def test_ppo_controller_rejects_mismatched_spec():
    depth_model = PPO("MlpPolicy", SpaceOnlyEnv(DEPTH_SPEC, 2), policy_kwargs={"net_arch": [8]}, seed=0)
    with pytest.raises(ValueError, match="spec"):
        PPOController(depth_policy=depth_model, depth_spec=ObservationSpec.for_depth(3, DMAX))


@pytest.mark.parametrize("activation", ["tanh", "relu", "leakyrelu", "sigmoid", "silu", "identity"])
def test_actor_numpy_path_matches_torch_functionals(activation):
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 21), (64, 64), (5, 64)]
    layers = []
    for i, shape in enumerate(shapes):
        layers.append(("linear", torch.randn(*shape, generator=gen) * 0.3, torch.randn(shape[0], generator=gen) * 0.1))
        if i < len(shapes) - 1:
            layers.append(("activation", activation, {"negative_slope": 0.2} if activation == "leakyrelu" else {}))
    actor = Actor(layers)
    assert actor._numpy_steps is not None  # single decisions take the numpy path
    obs = torch.rand(200, 21, generator=gen) * 2 - 1
    logits = actor.logits(obs)  # torch functionals
    top2 = logits.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # float round-off may only flip near-ties
    got = torch.tensor([actor.act(o.numpy()) for o in obs])
    assert bool((got[clear] == logits.argmax(dim=1)[clear]).all())
    np.testing.assert_array_equal(actor.act_batch(obs)[clear.numpy()], logits.argmax(dim=1)[clear].numpy())


def test_actor_falls_back_to_torch_and_rejects_unknown_layers():
    w, b = torch.randn(3, 4), torch.zeros(3)
    gelu = Actor([("linear", torch.randn(4, 4), None), ("activation", "gelu", {}), ("linear", w, b)])
    assert gelu._numpy_steps is None  # no numpy gelu: the torch path decides
    obs = np.random.default_rng(0).normal(size=4).astype(np.float32)
    assert gelu.act(obs) == int(gelu.logits(torch.from_numpy(obs)[None]).argmax())
    assert Actor([("linear", w.double(), b.double())])._numpy_steps is None
    with pytest.raises(ActorError, match="supported"):
        Actor([("linear", w, b), ("activation", "softmax", {})])
    with pytest.raises(ActorError, match="inputs"):
        Actor([("linear", w, b), ("linear", torch.zeros(2, 5), None)])


def test_actor_round_trips_through_the_exported_layer_list():
    model = perturbed(PPO("MlpPolicy", SpaceOnlyEnv(SIZE_SPEC, len(SIZE_ACTIONS)),
                          policy_kwargs={"net_arch": [16, 8], "activation_fn": torch.nn.LeakyReLU}, seed=2), 2)
    live = Actor.from_sb3(model.policy)
    entries, tensors = live.to_layers("size")
    loaded = Actor.from_layers(entries, tensors)
    obs = np.stack([SpaceOnlyEnv(SIZE_SPEC, 4).observation_space.sample() for _ in range(100)])
    np.testing.assert_array_equal(loaded.act_batch(obs), live.act_batch(obs))
    np.testing.assert_array_equal(loaded.act_batch(obs), model.predict(obs, deterministic=True)[0])
