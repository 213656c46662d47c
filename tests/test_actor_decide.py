"""Actor.decide (the first layer folded with the observation layout, no observation vector) makes the decisions SB3's
policy makes on the observation vector, for depth and size policies, on synthetic and recorded states, through the
compiled kernel (`policies.kernel`, numba) and through numpy alike; and the fold itself reproduces the first layer's
output."""
from __future__ import annotations

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.logger import Logger
from tiny import tiny_pair

from specpilot.drafting import SpeculativeDecoder, TreeConfig
from specpilot.drafting.types import DraftState
from specpilot.envs.spaces import observation_space
from specpilot.policies import FixedController, kernel
from specpilot.policies.actor import Actor
from specpilot.policies.learned import LearnedController
from specpilot.policies.observation import ObservationSpec, fold_first_layer, observe, scalars
from specpilot.policies.ppo import PPOController
from specpilot.train.export.checks import RecordingController, sb3_actions, synthetic_states

W, DMAX, SIZES = 3, 5, [2, 4, 6, 9]
TREE = TreeConfig(width=W, max_depth=DMAX, max_size=max(SIZES))
SPECS = {
    "depth": ObservationSpec.for_depth(W, DMAX, max_context=256),
    "size": ObservationSpec.for_size(W, DMAX, size_actions=SIZES, max_context=256),  # with candidate depths
    "size-no-depths": ObservationSpec.for_size(W, DMAX, size_actions=SIZES, max_context=256, features=()),
    "depth+features": ObservationSpec.for_depth(W, DMAX, max_context=256, features=("top_prob", "entropy")),
    "size+features": ObservationSpec.for_size(W, DMAX, size_actions=SIZES, max_context=256,
                                              features=("top_prob", "entropy")),
    "size+batch": ObservationSpec.for_size(W, DMAX, size_actions=SIZES, max_context=256,
                                           features=("batch", "context_max")),
}


class SpaceEnv(gym.Env):
    """Only carries the spaces (the policies are built, not trained)."""

    def __init__(self, spec: ObservationSpec, n_actions: int) -> None:
        self.observation_space = observation_space(spec)
        self.action_space = gym.spaces.Discrete(n_actions)


def sb3_policy(spec: ObservationSpec, pi: list[int], activation, seed: int):
    n_actions = 2 if spec.kind == "depth" else len(SIZES)
    model = PPO("MlpPolicy", SpaceEnv(spec, n_actions), policy_kwargs={"net_arch": {"pi": pi, "vf": [8]},
                                                                      "activation_fn": activation},
                n_steps=16, batch_size=16, seed=seed, device="cpu")
    gen = torch.Generator().manual_seed(seed)  # SB3's action head starts near-uniform: redraw the actor
    with torch.no_grad():
        for layer in [*model.policy.mlp_extractor.policy_net, model.policy.action_net]:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 3.0 / layer.in_features ** 0.5)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen) * 0.5)
    model.policy.set_training_mode(False)
    return model.policy


def edge_states() -> list[DraftState]:
    """Depth 0 (no scores), one level, fewer candidates than size slots, scores at 0 and just above, at and past the
    floor, scalars past their ranges."""
    base = dict(max_depth=DMAX, width=W, context_len=300, new_tokens=5, max_new_tokens=0, prev_accepted=9,
                prev_depth=2, acceptance=1.5, last_top_prob=0.3, last_entropy=9.0, batch_size=6, context_max=400)
    return [DraftState.from_levels([], **base),
            DraftState.from_levels([[0.0, -0.5, -21.0]], **base),
            DraftState.from_levels([[-1.0, -2.0, -3.0], [-20.0, -40.0, 0.0] * 3], **base),
            DraftState.from_levels([[-1e-9, -1.0, -2.0]] + [[-5.0 - i] * (W * W) for i in range(DMAX - 1)], **base),
            DraftState.from_levels([[1e-7, 0.0, -1.0]], **base)]  # round-off above 0 (the observation clips it)


@pytest.fixture(scope="module")
def recorded_states() -> list[DraftState]:
    """Every state a tiny decoder produced over a few generations (all depths, real score vectors)."""
    recorder = RecordingController(FixedController(DMAX, max(SIZES)), max(SIZES), keep=100_000)
    decoder = SpeculativeDecoder(tiny_pair(), TREE)
    for prompt in ([7], [1, 2, 3, 4, 5], list(range(10, 30))):
        decoder.generate(prompt, controller=recorder, max_new_tokens=24)
    return recorder.states


@pytest.fixture(params=["kernel", "numpy"])
def decision_path(request, monkeypatch) -> str:
    """Decide through the numba kernel (where it is installed) or, without it, through numpy products."""
    if request.param == "numpy":
        monkeypatch.setattr(kernel, "KERNEL", None)
    elif kernel.KERNEL is None:
        pytest.skip("numba is not installed: decisions run on numpy")
    return request.param


@pytest.mark.parametrize("activation", [torch.nn.Tanh, torch.nn.ReLU, torch.nn.LeakyReLU])
@pytest.mark.parametrize("pi", [[], [16], [32, 16]])
@pytest.mark.parametrize("name", list(SPECS))
def test_decide_makes_sb3s_decisions(name, pi, activation, recorded_states, decision_path):
    spec = SPECS[name]
    states = recorded_states + edge_states() + synthetic_states(TREE, 1500, seed=len(name), max_context=300)
    obs = np.stack([observe(state, spec) for state in states])
    for seed in range(20):  # the first random actor whose decisions vary over the states
        policy = sb3_policy(spec, pi, activation, seed=seed)
        expected = sb3_actions(policy, obs)
        if len(set(expected.tolist())) > 1:
            break
    actor = Actor.from_sb3(policy)
    with torch.inference_mode():
        logits = actor.logits(torch.from_numpy(obs))
    top2 = logits.topk(2, dim=1).values
    clear = ((top2[:, 0] - top2[:, 1]) > 1e-5).numpy()  # float round-off may only flip exact near-ties
    assert clear.mean() > 0.99 and len(set(expected.tolist())) > 1  # the check is not vacuous
    decided = np.array([actor.decide(state, spec) for state in states])
    # the kernel runs tanh / relu / identity stacks; a LeakyReLU one stays on numpy
    assert actor.compiled == (decision_path == "kernel" and (activation is not torch.nn.LeakyReLU
                                                                             or not pi))
    acted = np.array([actor.act(o) for o in obs])
    np.testing.assert_array_equal(decided[clear], expected[clear])
    np.testing.assert_array_equal(acted[clear], expected[clear])


def test_controllers_decide_through_the_fold(recorded_states):
    """PPOController (SB3 policies) and LearnedController (Actor.from_layers, as exports load) answer alike."""
    depth = sb3_policy(SPECS["depth"], [16], torch.nn.Tanh, seed=1)
    size = sb3_policy(SPECS["size"], [16], torch.nn.Tanh, seed=2)
    ppo = PPOController(depth, size, SPECS["depth"], SPECS["size"], SIZES)
    exported = LearnedController(*(Actor.from_layers(*Actor.from_sb3(p).to_layers(k)) for k, p in
                                   (("depth", depth), ("size", size))), SPECS["depth"], SPECS["size"], SIZES)
    states = recorded_states + edge_states()
    for ctrl in (ppo, exported):
        assert [ctrl.should_stop(s) for s in states] == [
            bool(sb3_actions(depth, observe(s, SPECS["depth"])[None])[0]) for s in states]
        assert [ctrl.choose_size(s) for s in states] == [
            SIZES[sb3_actions(size, observe(s, SPECS["size"])[None])[0]] for s in states]


@pytest.mark.parametrize("name", list(SPECS))
def test_fold_first_layer_reproduces_the_layer(name, recorded_states):
    spec = SPECS[name]
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(12, spec.dim)).astype(np.float32)
    bias = rng.normal(size=12).astype(np.float32)
    folded = fold_first_layer(spec, weight, bias)
    slots = 2 if spec.candidate_depths else 1
    assert [m.shape for m in folded] == [(slots * k + spec.num_scalars + 1, 12) for k in range(spec.num_scores + 1)]
    for state in recorded_states[:200] + edge_states():
        values = (state.level_scores if spec.kind == "depth" else state.candidate_scores)[:spec.num_scores]
        depths = state.candidate_depths[:values.shape[0]] if spec.candidate_depths else []
        x = np.concatenate([np.maximum(values, spec.score_floor), depths, scalars(state, spec), [1.0]])
        np.testing.assert_allclose(x @ folded[values.shape[0]], weight @ observe(state, spec) + bias,
                                   rtol=1e-4, atol=1e-4)  # (a score clipped at 0 there is above 0 by round-off)


def test_decide_falls_back_where_numpy_cannot_run_the_stack(recorded_states):
    spec = SPECS["depth"]
    gen = torch.Generator().manual_seed(0)
    layers = [("linear", torch.randn(8, spec.dim, generator=gen), torch.randn(8, generator=gen)),
              ("activation", "gelu", {}), ("linear", torch.randn(2, 8, generator=gen), None)]
    gelu = Actor(layers)
    norm = Actor(layers[:1] + [("activation", "tanh", {})] + layers[2:],
                 obs_norm=(torch.zeros(spec.dim, dtype=torch.float64), torch.full((spec.dim,), 2.0,
                                                                                 dtype=torch.float64), 10.0))
    for actor in (gelu, norm):
        assert actor._numpy_steps is None
        for state in recorded_states[:50]:
            obs = torch.from_numpy(observe(state, spec))[None]
            assert actor.decide(state, spec) == int(actor.logits(obs).argmax())


def test_the_kernel_and_numpy_decide_alike_on_the_same_actor(recorded_states, monkeypatch):
    if kernel.KERNEL is None:
        pytest.skip("numba is not installed: decisions run on numpy")
    rng = np.random.default_rng(3)
    states = recorded_states + edge_states() + synthetic_states(TREE, 500, seed=9, max_context=300)
    states.append(DraftState.from_levels([[-1.0, -2.0, -3.0]], max_depth=DMAX, width=W, context_len=9,
                                         acceptance=1, last_top_prob=1, last_entropy=0))  # int fields
    for name, spec in SPECS.items():
        n_out = 2 if spec.kind == "depth" else len(SIZES)
        for activation in ("tanh", "relu", "identity"):
            actor = Actor([("linear", torch.from_numpy(rng.normal(size=(24, spec.dim)).astype(np.float32)),
                            torch.from_numpy(rng.normal(size=24).astype(np.float32))), ("activation", activation, {}),
                           ("linear", torch.from_numpy(rng.normal(size=(n_out, 24)).astype(np.float32)), None)])
            actor.prepare(spec)
            with monkeypatch.context() as patch:  # the same weights, folded without the kernel
                patch.setattr(kernel, "KERNEL", None)
                twin = copy.deepcopy(actor)
                twin.prepare(spec)
            assert actor.compiled and not twin.compiled
            assert [actor.decide(s, spec) for s in states] == [twin.decide(s, spec) for s in states], (name, activation)


def test_read_only_scores_decide_as_writable_ones():
    """The kernel's native entry point is called without numba's type dispatch (which would type a read-only array
    apart): a state built on read-only scores (np.frombuffer, a memory-mapped trace) decides as a writable one."""
    rng = np.random.default_rng(5)
    spec = SPECS["depth"]
    actor = Actor([("linear", torch.from_numpy(rng.normal(size=(24, spec.dim)).astype(np.float32)),
                    torch.from_numpy(rng.normal(size=24).astype(np.float32))), ("activation", "tanh", {}),
                   ("linear", torch.from_numpy(rng.normal(size=(2, 24)).astype(np.float32)), None)])
    actor.prepare(spec)
    for _ in range(20):
        scores = -rng.exponential(3.0, size=W + W * W).astype(np.float32)
        frozen = np.frombuffer(scores.tobytes(), dtype=np.float32)
        fields = dict(depth=2, max_depth=DMAX, width=W, context_len=9, level_start=W)
        state = DraftState(scores=frozen, **fields)
        assert not state.level_scores.flags.writeable
        assert actor.decide(state, spec) == actor.decide(DraftState(scores=scores, **fields), spec)


@pytest.mark.parametrize("copy_kind", ["pickle", "deepcopy"])
def test_a_copied_controller_decides_alike(copy_kind, recorded_states):
    """Partner controllers travel to Ray workers pickled: the copy rebuilds its buffers (views do not survive)."""
    import pickle

    depth = sb3_policy(SPECS["depth"], [16], torch.nn.Tanh, seed=1)
    size = sb3_policy(SPECS["size"], [16, 8], torch.nn.ReLU, seed=2)
    ctrl = PPOController(depth, size, SPECS["depth"], SPECS["size"], SIZES)
    ctrl.should_stop(recorded_states[-1])  # fold before copying
    twin = pickle.loads(pickle.dumps(ctrl)) if copy_kind == "pickle" else copy.deepcopy(ctrl)
    states = recorded_states + edge_states()
    assert [twin.should_stop(s) for s in states] == [ctrl.should_stop(s) for s in states]
    assert [twin.choose_size(s) for s in states] == [ctrl.choose_size(s) for s in states]


def test_an_algorithm_trained_under_vec_normalize_decides_on_normalised_observations():
    """PPO under VecNormalize(norm_obs=True) saw normalised observations: its Actor applies the same statistics."""
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    from specpilot.policies.actor import Actor

    venv = VecNormalize(DummyVecEnv([lambda: gym.make("CartPole-v1")]), norm_obs=True, clip_obs=3.0)
    model = PPO("MlpPolicy", venv, n_steps=64, batch_size=32, n_epochs=1, seed=0, policy_kwargs={"net_arch": [8]})
    model.set_logger(Logger(folder=None, output_formats=[]))  # SB3's default logger leaves a /tmp/SB3-* folder
    model.learn(128)
    venv.obs_rms.mean += 0.5  # statistics far from zero/one, so raw and normalised inputs decide differently
    venv.obs_rms.var *= 9.0
    actor = Actor.from_sb3(model)
    assert actor.obs_norm is not None and Actor.from_sb3(model.policy).obs_norm is None
    obs = np.random.default_rng(0).normal(0.5, 3.0, size=(64, 4)).astype(np.float32)
    expected = model.predict(venv.normalize_obs(obs), deterministic=True)[0]
    got = actor.logits(torch.as_tensor(obs)).argmax(-1).numpy()
    assert (got == expected).all()


@pytest.mark.parametrize("sizes", [[0, 2, 4], [-3, 2, 4]])
def test_size_actions_the_policy_cannot_have_observed_are_refused(sizes):
    from specpilot.policies.learned import probe_controller

    with pytest.raises(ValueError, match=r"outside 1\.\.\d+, the candidates the size policy observes"):
        probe_controller(2, 3, sizes)


def test_a_size_policy_reads_live_candidates_depths_from_the_trees_ranking(decision_path):
    """In the decoder a state's candidate ids come from the tree's own ranking (the sort verification uses), not from
    a sort of its own: they must be the ids and depths the observation sees, and decide as SB3 does on it."""
    spec = SPECS["size"]
    policies = [sb3_policy(spec, [16], torch.nn.Tanh, seed=seed) for seed in range(8)]
    actors = [Actor.from_sb3(policy) for policy in policies]
    seen: list[list[tuple]] = [[] for _ in policies]

    class Checking(FixedController):
        def choose_size(self, state: DraftState) -> int:
            detached = state.detached()  # no tree: ids from a stable sort of the scores
            np.testing.assert_array_equal(state.candidate_ids, detached.candidate_ids)
            obs = observe(detached, spec)[None]
            for actor, policy, decisions in zip(actors, policies, seen):
                decisions.append((actor.decide(state, spec), int(sb3_actions(policy, obs)[0])))
            return super().choose_size(state)

    decoder = SpeculativeDecoder(tiny_pair(), TREE)
    for prompt in ([7], list(range(10, 30))):
        decoder.generate(prompt, controller=Checking(DMAX, max(SIZES)), max_new_tokens=16)
    assert all(a == b for decisions in seen for a, b in decisions), seen
    assert any(len({b for _, b in decisions}) > 1 for decisions in seen)  # decisions that vary: informative
