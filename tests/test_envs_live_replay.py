"""Live and replay environments: env checkers, live == replay on a recorded trace, episode ends, seeding, oracle."""
from __future__ import annotations

import copy
import json
import pickle

import gymnasium as gym
import numpy as np
import pytest
import torch

import specpilot.envs  # noqa: F401  (registers the ids)
from specpilot.drafting.decoder import autoregressive_generate
from specpilot.drafting.pair import ModelPair
from specpilot.drafting.types import TreeConfig
from specpilot.envs.environments import (CYCLE_INFO_KEYS, live_depth_env, live_size_env, replay_depth_env,
                                         replay_size_env)
from specpilot.envs.oracle import replay_controller, replay_oracle, replay_static
from specpilot.envs.profile import LatencyProfile
from specpilot.envs.record import Trace, greedy_continuation, record_task, record_trace
from specpilot.policies import DDDController, FixedController, HFHeuristicController

TREE = TreeConfig(width=3, max_depth=4, max_size=16)
SIZES = [1, 2, 4, 8, 16]
MAX_NEW = 20
EOS_AFTER = 6  # the first prompt's continuation emits EOS as its (EOS_AFTER+1)-th token


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny models on a shared CPU: several intra-op threads only spin against each other
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny_pair(seed: int = 0) -> ModelPair:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=512, eos_token_id=95)
    target = LlamaForCausalLM(cfg).eval()
    draft = copy.deepcopy(target)  # a noisy copy: partial, position-dependent acceptance
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    return ModelPair(target, draft)


@pytest.fixture(scope="module")
def pair_prompts():
    """A tiny pair whose EOS id is chosen so the first prompt ends with EOS after EOS_AFTER+1 tokens."""
    pair = _tiny_pair()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 95, size=int(rng.integers(3, 8))).tolist() for _ in range(3)]
    for _ in range(50):
        cont = autoregressive_generate(pair, prompts[0], max_new_tokens=MAX_NEW).tokens
        if cont[EOS_AFTER] not in cont[:EOS_AFTER]:
            break
        prompts[0] = rng.integers(0, 95, size=5).tolist()
    eos = cont[EOS_AFTER]
    pair.target.generation_config.eos_token_id = eos
    pair.target.config.eos_token_id = eos
    assert pair.eos_token_id == eos
    return pair, prompts


def _synthetic_profile(tree: TreeConfig) -> LatencyProfile:
    first = {n: [1e-3 + 1e-4 * n] for n in range(1, tree.max_depth + 2)}
    levels = {level: [1.2e-3] for level in range(2, tree.max_depth + 1)}
    verify = [(v, c, 4e-3 + 1e-4 * v + 1e-6 * c) for v in range(0, tree.max_size + 1) for c in (10, 40)]
    return LatencyProfile.from_samples(first, levels, verify, max_depth=tree.max_depth, width=tree.width)


@pytest.fixture(scope="module")
def recorded(pair_prompts, tmp_path_factory):
    pair, prompts = pair_prompts
    trace = record_trace(pair, TREE, prompts, max_new_tokens=MAX_NEW)
    out = trace.save(tmp_path_factory.mktemp("trace"))
    profile = _synthetic_profile(TREE)
    profile.save(out / "profile.json")
    return out, Trace.load(out), profile


def _live(kind: str, pair, prompts, **kw):
    if kind == "depth":
        return live_depth_env(pair, prompts, max_new_tokens=kw.pop("max_new_tokens", MAX_NEW), tree=TREE,
                              size_controller=kw.pop("partner", 4), **kw)
    return live_size_env(pair, prompts, max_new_tokens=kw.pop("max_new_tokens", MAX_NEW), tree=TREE,
                         size_actions=SIZES, depth_controller=kw.pop("partner", (1, TREE.max_depth)), **kw)


def _replay(kind: str, trace, profile, **kw):
    if kind == "depth":
        return replay_depth_env(trace, profile, size_controller=kw.pop("partner", 4), **kw)
    return replay_size_env(trace, profile, size_actions=SIZES,
                           depth_controller=kw.pop("partner", (1, TREE.max_depth)), **kw)


def _learned_size_partner(recorded):
    """A PPOController choosing sizes with an (untrained, so arbitrary but deterministic) SB3 policy."""
    from stable_baselines3 import PPO

    from specpilot.policies import PPOController

    _, trace, profile = recorded
    env = _replay("size", trace, profile)
    model = PPO("MlpPolicy", env, n_steps=64, batch_size=64, seed=3, policy_kwargs={"net_arch": [16]})
    return PPOController(None, model.policy, size_spec=env.spec_obs, size_actions=SIZES,
                         fallback=FixedController(2, 4))


def _rollout(env, seed: int, action_seed: int, options=None, max_steps: int = 500):
    """(reset info, [(obs, reward, terminated, truncated, info)]) with actions drawn from action_seed."""
    obs, info = env.reset(seed=seed, options=options)
    rng = np.random.default_rng(action_seed)
    steps = [(np.array(obs), 0.0, False, False, info)]
    for _ in range(max_steps):
        if env.action_space.n == 2:
            action = int(rng.random() < 0.4)  # STOP with probability 0.4
        else:
            action = int(rng.integers(env.action_space.n))
        obs, reward, terminated, truncated, info = env.step(action)
        steps.append((np.array(obs), reward, terminated, truncated, info))
        if terminated or truncated:
            break
    return steps


# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env_id", ["specpilot/Depth-v0", "specpilot/Size-v0", "specpilot/ReplayDepth-v0",
                                    "specpilot/ReplaySize-v0"])
def test_env_checkers_pass(env_id, pair_prompts, recorded):
    from gymnasium.utils.env_checker import check_env as gym_check
    from stable_baselines3.common.env_checker import check_env as sb3_check

    pair, prompts = pair_prompts
    trace_dir, _, _ = recorded
    if env_id == "specpilot/Depth-v0":
        kwargs = dict(pair=pair, prompts=prompts, max_new_tokens=MAX_NEW, tree=TREE, size_controller=4)
    elif env_id == "specpilot/Size-v0":
        kwargs = dict(pair=pair, prompts=prompts, max_new_tokens=MAX_NEW, tree=TREE, size_actions=SIZES,
                      depth_controller=(1, 4))
    elif env_id == "specpilot/ReplayDepth-v0":
        kwargs = dict(trace=str(trace_dir), size_controller=4)
    else:
        kwargs = dict(trace=str(trace_dir), size_actions=SIZES, depth_controller=(1, 4))
    env = gym.make(env_id, **kwargs)
    gym_check(env.unwrapped)
    sb3_check(env.unwrapped, warn=True)
    # the wrapped env (passive checker, order enforcing) steps too
    env.reset(seed=0)
    env.step(env.action_space.sample())
    env.close()


@pytest.mark.parametrize("kind,partner", [("depth", None), ("size", None), ("size", "hf_heuristic"), ("depth", "learned"),
                                          ("depth", "ddd")])
def test_live_and_replay_accept_the_same_tokens(kind, partner, pair_prompts, recorded):
    pair, prompts = pair_prompts
    _, trace, profile = recorded
    kw = {}
    if partner == "hf_heuristic":  # depth follows the observed acceptance
        kw["partner"] = HFHeuristicController(initial_depth=2, max_depth=TREE.max_depth, size=4)
    elif partner == "ddd":  # a size partner that also decides depth (here only its size is used)
        kw["partner"] = DDDController(check_depths=(2,), threshold=-1.0, size=6)
    elif partner == "learned":
        kw["partner"] = _learned_size_partner(recorded)
    live, replay = _live(kind, pair, prompts, **kw), _replay(kind, trace, profile, **kw)
    cycles, depths, sizes = 0, set(), set()
    for index in range(len(prompts)):
        for action_seed in (0, 1):
            a = _rollout(live, seed=index, action_seed=action_seed, options={"prompt_index": index})
            b = _rollout(replay, seed=index, action_seed=action_seed, options={"prompt_index": index})
            assert len(a) == len(b)
            for (oa, _, ta, ua, ia), (ob, _, tb, ub, ib) in zip(a, b):
                np.testing.assert_allclose(oa, ob, atol=1e-5)  # same DraftState numbers -> same observation
                assert (ta, ua) == (tb, ub)
                if "accepted" in ia:
                    cycles += 1
                    depths.add(ia["depth"])
                    sizes.add(ia["size"])
                    for key in ("accepted", "emitted", "depth", "size", "context_len", "new_tokens"):
                        assert ia[key] == ib[key], (key, ia, ib)
                    assert set(CYCLE_INFO_KEYS) <= set(ia) and set(CYCLE_INFO_KEYS) <= set(ib)
            # the emitted text is the target's greedy text in both
            assert live.session.new_tokens == trace.continuation(index)[: len(live.session.new_tokens)].tolist()
    assert cycles > 10 and len(depths) > 1  # the decisions varied, so equality is not trivially met
    if partner == "learned":
        assert len(sizes) > 1


@pytest.mark.parametrize("kind", ["depth", "size"])
@pytest.mark.parametrize("source", ["live", "replay"])
def test_episode_ends_eos_terminated_length_truncated(kind, source, pair_prompts, recorded):
    pair, prompts = pair_prompts
    _, trace, profile = recorded
    for max_new, want in ((MAX_NEW, "eos"), (EOS_AFTER - 1, "length")):
        if source == "live":
            env = _live(kind, pair, prompts, max_new_tokens=max_new)
        else:
            env = _replay(kind, trace, profile, max_new_tokens=max_new)
        steps = _rollout(env, seed=0, action_seed=3, options={"prompt_index": 0})
        *_, (obs, _, terminated, truncated, info) = steps
        assert env.observation_space.contains(obs)
        assert info["finished_by"] == want
        assert (terminated, truncated) == ((True, False) if want == "eos" else (False, True))
        assert info["new_tokens"] == (EOS_AFTER + 1 if want == "eos" else max_new)
        assert not any(t or u for _, _, t, u, _ in steps[:-1])
        with pytest.raises(RuntimeError):
            env.step(0)


@pytest.mark.parametrize("kind", ["depth", "size"])
def test_replay_seed_reproduces_episode(kind, recorded):
    _, trace, profile = recorded
    env = _replay(kind, trace, profile, time_noise=1.0)
    a = _rollout(env, seed=7, action_seed=0)
    b = _rollout(env, seed=7, action_seed=0)
    assert a[0][4]["prompt_index"] == b[0][4]["prompt_index"]
    assert len(a) == len(b)
    for (oa, ra, *_), (ob, rb, *_) in zip(a, b):
        np.testing.assert_array_equal(oa, ob)
        assert ra == rb
    chosen = {_rollout(env, seed=s, action_seed=0)[0][4]["prompt_index"] for s in range(12)}
    assert len(chosen) > 1  # the seed picks the prompt


def test_live_seed_reproduces_prompt_and_tokens(pair_prompts):
    pair, prompts = pair_prompts
    env = _live("size", pair, prompts)
    a = _rollout(env, seed=5, action_seed=1)
    b = _rollout(env, seed=5, action_seed=1)
    assert a[0][4]["prompt_index"] == b[0][4]["prompt_index"]
    assert [s[4].get("accepted") for s in a] == [s[4].get("accepted") for s in b]
    assert [s[4].get("depth") for s in a] == [s[4].get("depth") for s in b]  # random partner depths reseeded


def test_depth_env_forces_stop_at_max_depth(recorded):
    _, trace, profile = recorded
    env = _replay("depth", trace, profile)
    env.reset(seed=0)  # the first question comes before drafting (depth 0)
    for _ in range(TREE.max_depth - 1):
        *_, info = env.step(0)
        assert "accepted" not in info
    *_, info = env.step(0)  # reaches max_depth: verified in the same step
    assert info["depth"] == TREE.max_depth and "accepted" in info


@pytest.mark.parametrize("source", ["live", "replay"])
def test_depth_env_stop_before_drafting_is_a_plain_step(source, pair_prompts, recorded):
    pair, prompts = pair_prompts
    _, trace, profile = recorded
    env = _live("depth", pair, prompts) if source == "live" else _replay("depth", trace, profile)
    env.reset(seed=0, options={"prompt_index": 1})
    obs, reward, _, _, info = env.step(1)
    assert (info["depth"], info["size"], info["accepted"], info["emitted"]) == (0, 0, 0, 1)
    assert info["draft_s"] == 0.0 and info["verify_s"] > 0
    assert env.unwrapped.state.depth == 0 and env.unwrapped.state.prev_depth == 0


@pytest.mark.parametrize("kind,action", [("depth", -1), ("depth", 2), ("depth", 0.5), ("size", -1),
                                         ("size", len(SIZES)), ("size", True)])
def test_actions_outside_the_space_raise(kind, action, recorded):
    _, trace, profile = recorded
    env = _replay(kind, trace, profile)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action space"):
        env.step(action)


def test_replay_static_and_controller_agree_and_oracle_bounds(recorded):
    _, trace, profile = recorded
    static = replay_static(trace, profile, depth=3, size=8)
    assert static["tokens"] == sum(trace.budget(i)[0] for i in range(trace.num_prompts))
    result = replay_oracle(trace, profile, sizes=SIZES)
    best = result["best_static"]
    assert best["tokens_per_s"] == max(r["tokens_per_s"] for r in result["static"])
    cell = next(r for r in result["static"] if (r["depth"], r["size"]) == (3, 8))
    assert cell["tokens"] == static["tokens"] and cell["time_s"] == pytest.approx(static["time_s"])
    assert result["oracle"]["tokens_per_s"] >= best["tokens_per_s"] * (1 - 1e-9)
    assert result["oracle"]["tokens_per_s"] >= result["greedy_oracle"]["tokens_per_s"] * (1 - 1e-9)


@pytest.mark.parametrize("index", [0, 1])  # prompt 0 ends with EOS within the budget
def test_greedy_continuation_timed_keeps_the_tokens(pair_prompts, index):
    pair, prompts = pair_prompts
    timing = []
    plain = greedy_continuation(pair, prompts[index], MAX_NEW, TREE.max_depth)
    assert greedy_continuation(pair, prompts[index], MAX_NEW, TREE.max_depth, timing) == plain
    (tokens, seconds), = timing  # one timed call: the AR generation measure_ar would have run
    assert tokens == len(autoregressive_generate(pair, prompts[index], max_new_tokens=MAX_NEW).tokens)
    assert seconds > 0


def test_record_task_takes_the_ar_timing_from_the_recording(pair_prompts, tmp_path):
    pair, prompts = pair_prompts
    record_task(pair, TREE, prompts, tmp_path, max_new_tokens=MAX_NEW, profile_prompts=1, ar=True)
    ar = json.loads((tmp_path / "ar.json").read_text())
    assert ar["tokens"] == sum(len(autoregressive_generate(pair, p, max_new_tokens=MAX_NEW).tokens) for p in prompts)
    assert ar["prompts"] == len(prompts) and ar["time_s"] > 0 and "recording" in ar["shards"][0]["source"]


def test_record_task_times_ar_beside_the_profile_and_replay_divides_by_it(pair_prompts, tmp_path):
    from specpilot.envs.replay import ReplayModel
    from specpilot.train.rl.validation import replay_ar

    pair, prompts = pair_prompts
    record_task(pair, TREE, prompts, tmp_path / "ar", max_new_tokens=MAX_NEW, profile_prompts=2, ar=True)
    profile = LatencyProfile.load(tmp_path / "ar" / "profile.json")
    # one AR generation after each profile prompt: its tokens, not the trace's
    assert profile.meta["ar_tokens"] == sum(len(autoregressive_generate(pair, p, max_new_tokens=MAX_NEW).tokens)
                                            for p in prompts[:2])
    assert profile.meta["ar_seconds_per_token"] == pytest.approx(profile.meta["ar_s"] / profile.meta["ar_tokens"])
    ar = replay_ar(ReplayModel(tmp_path / "ar"))
    assert ar["source"] == "profile" and ar["tokens_per_s"] == pytest.approx(1 / profile.meta["ar_seconds_per_token"])

    profile.meta.pop("ar_seconds_per_token")  # a profile without it: the recording's ar.json, then plain steps
    profile.save(tmp_path / "ar" / "profile.json")
    assert replay_ar(ReplayModel(tmp_path / "ar"))["source"] == "live"
    (tmp_path / "ar" / "ar.json").unlink()
    assert replay_ar(ReplayModel(tmp_path / "ar"))["source"] == "plain_steps"

    record_task(pair, TREE, prompts[:1], tmp_path / "no_ar", max_new_tokens=MAX_NEW)
    assert "ar_seconds_per_token" not in LatencyProfile.load(tmp_path / "no_ar" / "profile.json").meta


def test_record_task_writes_trace_and_measured_profile(pair_prompts, tmp_path):
    pair, prompts = pair_prompts
    trace_dir, profile_path = record_task(pair, TREE, prompts[:1], tmp_path, max_new_tokens=8)
    assert {p.name for p in tmp_path.iterdir()} >= {"trace.npz", "trace.json", "profile.json"}
    profile = LatencyProfile.load(profile_path)
    assert profile.draft_table().shape == (TREE.max_depth + 2, TREE.max_depth + 1)
    assert np.all(profile.verify_table(TREE.max_size, np.array([5, 50]))[:, 1:] > 0)
    env = gym.make("specpilot/ReplaySize-v0", trace=trace_dir, size_actions=SIZES)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)


@pytest.mark.parametrize("env_id,kwargs,error,fragment", [
    ("specpilot/ReplaySize-v0", dict(time_noise=float("nan")), ValueError, "time_noise must be a finite number"),
    ("specpilot/ReplaySize-v0", dict(time_noise=-1.0), ValueError, "time_noise must be a finite number >= 0"),
    ("specpilot/ReplayDepth-v0", dict(max_new_tokens=0), ValueError, "max_new_tokens must be an integer >= 1"),
    ("specpilot/ReplayDepth-v0", dict(max_new_tokens=5.5), TypeError, "max_new_tokens must be an integer"),
    ("specpilot/ReplayDepth-v0", dict(size_controller=999), ValueError, "size 999 is larger than the tree's"),
    ("specpilot/ReplaySize-v0", dict(depth_controller=(0, 99)), ValueError, "random depths up to 99"),
    ("specpilot/ReplaySize-v0", dict(depth_controller=50), ValueError, "depth 50 is deeper than the tree's"),
    ("specpilot/ReplaySize-v0", dict(depth_controller=(1.9, 3.2)), TypeError, "low must be an integer"),
])
def test_replay_env_arguments_the_tree_or_rewards_cannot_take_are_refused(recorded, env_id, kwargs, error, fragment):
    trace_dir, _, _ = recorded
    if env_id.endswith("Size-v0"):
        kwargs = dict(size_actions=SIZES, **kwargs)
    with pytest.raises(error, match=fragment):
        gym.make(env_id, trace=str(trace_dir), **kwargs)


def test_live_env_partner_past_the_tree_is_refused(pair_prompts):
    pair, prompts = pair_prompts
    with pytest.raises(ValueError, match="is larger than the tree's max_size"):
        gym.make("specpilot/Depth-v0", pair=pair, prompts=prompts, max_new_tokens=MAX_NEW, tree=TREE,
                 size_controller=TREE.max_size + 1)


@pytest.mark.parametrize("options,error,fragment", [
    ({"prompt_index": 1.5}, TypeError, "reset option prompt_index must be an integer, got 1.5"),
    ({"prompt_index": "1"}, TypeError, "must be an integer"),
    ({"prompt_idx": 1}, ValueError, r"unknown reset option\(s\) \['prompt_idx'\]"),
    ([("prompt_index", 1)], TypeError, "reset options must be a dict"),
])
def test_reset_options_are_checked(recorded, options, error, fragment):
    env = gym.make("specpilot/ReplayDepth-v0", trace=str(recorded[0]))
    with pytest.raises(error, match=fragment):
        env.reset(seed=0, options=options)


@pytest.mark.parametrize("action", [torch.tensor(1.7), np.array([1, 0]), np.array([1]), torch.tensor([1]), 1.0,
                                    True])
def test_actions_that_are_not_one_integer_are_refused(recorded, action):
    env = gym.make("specpilot/ReplaySize-v0", trace=str(recorded[0]), size_actions=SIZES).unwrapped
    env.reset(seed=0)
    with pytest.raises(ValueError, match="outside SizeEnv's action space: give an integer"):
        env.step(action)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(prompts=[1.5]), "prompts \\(trace prompt indices\\) must be an integer"),
    (dict(size_actions=[2.5, 8]), "size_actions must be an integer"),
    (dict(features="entropy"), "features must be a list of feature names"),
])
def test_replay_env_lists_take_integers_and_names_only(recorded, kwargs, fragment):
    kwargs.setdefault("size_actions", SIZES)
    with pytest.raises(TypeError, match=fragment):
        gym.make("specpilot/ReplaySize-v0", trace=str(recorded[0]), **kwargs)


def test_render_draws_nothing_and_a_render_mode_is_refused(recorded):
    env = gym.make("specpilot/ReplayDepth-v0", trace=str(recorded[0]))
    env.reset(seed=0)
    assert env.render() is None and env.unwrapped.render_mode is None
    with pytest.raises(ValueError, match="render nothing"):
        gym.make("specpilot/ReplayDepth-v0", trace=str(recorded[0]), render_mode="rgb_array")


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda env: pickle.loads(pickle.dumps(env))])
def test_envs_copy_between_episodes_and_refuse_mid_episode(recorded, copier):
    env = gym.make("specpilot/ReplayDepth-v0", trace=str(recorded[0])).unwrapped
    copier(env)                                   # before reset
    env.reset(seed=0)
    with pytest.raises(TypeError, match="cannot be copied or pickled during an episode"):
        copier(env)
    done = False
    while not done:
        _, _, terminated, truncated, _ = env.step(1)
        done = terminated or truncated
    twin = copier(env)                            # after the episode: the copy starts its own
    assert twin.reset(seed=3)[1] == env.reset(seed=3)[1]


def test_a_seed_past_64_bits_is_taken_as_gymnasium_takes_it(recorded):
    env = gym.make("specpilot/ReplayDepth-v0", trace=str(recorded[0])).unwrapped
    assert env.reset(seed=2 ** 70)[1] == env.reset(seed=2 ** 70)[1]


def test_sb3_make_vec_env_builds_the_envs(recorded):
    """SB3's make_vec_env asks for render_mode="rgb_array" first and falls back on a TypeError: the refusal is one."""
    from stable_baselines3.common.env_util import make_vec_env

    venv = make_vec_env("specpilot/ReplaySize-v0", n_envs=2, env_kwargs=dict(trace=str(recorded[0]),
                                                                             size_actions=SIZES))
    assert venv.reset().shape == (2, *venv.observation_space.shape)
    venv.close()


@pytest.mark.parametrize("kind", ["depth", "size"])
@pytest.mark.parametrize("source", ["live", "replay"])
def test_the_last_observation_is_the_state_the_generation_ended_in(kind, source, pair_prompts, recorded):
    """Not the last question's state: SB3 bootstraps a truncated episode's value from this observation."""
    pair, prompts = pair_prompts
    _, trace, profile = recorded
    max_new = EOS_AFTER - 1
    env = (_live(kind, pair, prompts, max_new_tokens=max_new) if source == "live"
           else _replay(kind, trace, profile, max_new_tokens=max_new))
    steps = _rollout(env, seed=0, action_seed=3, options={"prompt_index": 0})
    (before, *_), (last, _, _, truncated, info) = steps[-2], steps[-1]
    spec, n = env.unwrapped.spec_obs, env.unwrapped.spec_obs.num_scores
    a = spec.scalar_start  # (a size policy's observation also holds the candidates' depths before the scalars)
    assert truncated and env.observation_space.contains(last) and not np.array_equal(last, before)
    assert last[a] == 0.0 and not last[n:a].any()                              # nothing drafted
    assert last[a + 2] == 1.0                                                   # the budget is spent
    assert last[a + 1] == pytest.approx((len(prompts[0]) + max_new) / spec.max_context)
    assert last[a + 3] == pytest.approx(min(info["accepted"] / spec.max_depth, 1))
    assert last[a + 4] == pytest.approx(min(info["depth"] / spec.max_depth, 1))


def test_the_last_observation_of_a_replay_is_the_next_cycles_state(recorded):
    """What the replay session itself would show before a next cycle's drafting (depth 0), field for field."""
    from specpilot.policies.observation import depth_observation

    _, trace, profile = recorded
    env = _replay("depth", trace, profile, max_new_tokens=EOS_AFTER - 1).unwrapped
    steps = _rollout(env, seed=0, action_seed=3, options={"prompt_index": 0})
    session = env.session
    expected = session.tables.state(session.t, 0, *session.prev, acceptance=session.acceptance)
    np.testing.assert_array_equal(steps[-1][0], depth_observation(expected, env.spec_obs))


@pytest.mark.parametrize("reward", ["dinkelbach", "time"])
def test_a_seeded_reset_forgets_running_reward_statistics(recorded, reward):
    """Gymnasium's determinism (its checker): the same seed and actions give the same rewards; unseeded resets
    keep the statistics across episodes, as training needs them."""
    from gymnasium.utils.env_checker import check_env as gym_check

    _, trace, profile = recorded
    env = _replay("depth", trace, profile, reward=reward)
    first = [r for _, r, *_ in _rollout(env, seed=4, action_seed=1)]
    assert [r for _, r, *_ in _rollout(env, seed=4, action_seed=1)] == first
    env.reset()
    assert env.unwrapped.reward_fn is env.unwrapped._reward_proto
    kept = env.unwrapped.reward_fn._time.value if reward == "dinkelbach" else env.unwrapped.reward_fn._scale.value
    assert kept is not None                                                     # an unseeded reset keeps them
    gym_check(_replay("depth", trace, profile, reward=reward).unwrapped, skip_render_check=True)


def test_reset_does_not_touch_torchs_global_random_stream(recorded):
    _, trace, profile = recorded
    env = _replay("size", trace, profile)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    env.reset(seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_a_controller_partner_is_copied_per_env(recorded):
    """Envs built from the same keyword arguments (a vector env) do not share a stateful partner."""
    from specpilot.policies.heuristics import RandomDepthController

    trace_dir, _, _ = recorded
    partner = RandomDepthController(1, TREE.max_depth)
    alone = gym.make("specpilot/ReplaySize-v0", trace=str(trace_dir), size_actions=SIZES, depth_controller=partner)
    depths = [s[4].get("depth") for s in _rollout(alone, seed=2, action_seed=0)]
    venv = gym.make_vec("specpilot/ReplaySize-v0", num_envs=2, vectorization_mode="sync",
                        trace=str(trace_dir), size_actions=SIZES, depth_controller=partner)
    first = venv.envs[0].unwrapped
    second = venv.envs[1].unwrapped
    assert first.depth_controller is not partner and first.depth_controller is not second.depth_controller
    venv.reset(seed=[2, 9])
    rng, seen = np.random.default_rng(0), []
    for _ in range(len(depths) - 1):
        _, _, terminated, truncated, info = venv.step(rng.integers(len(SIZES), size=2))
        seen.append(int(info["depth"][0]))
        if terminated[0] or truncated[0]:
            break
    assert seen == depths[1:len(seen) + 1]


@pytest.mark.parametrize("kwargs,error,fragment", [
    (dict(max_context=4.5), TypeError, "max_context must be an integer"),
    (dict(max_context="4096"), TypeError, "max_context must be an integer"),
    (dict(max_context=0), ValueError, "max_context must be an integer >= 1"),
    (dict(skip_decisions="no"), TypeError, "skip_decisions must be True or False"),
])
def test_env_arguments_are_checked_not_coerced(recorded, kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        gym.make("specpilot/ReplayDepth-v0", trace=str(recorded[0]), **kwargs)


def test_a_refused_reset_leaves_the_running_episode_as_it_was(recorded):
    env = gym.make("specpilot/ReplayDepth-v0", trace=str(recorded[0])).unwrapped
    env.reset(seed=0, options={"prompt_index": 1})
    state = env.state
    with pytest.raises(ValueError, match="is not one of this env's prompts"):
        env.reset(seed=5, options={"prompt_index": 99})
    assert env.state is state and env.prompt_index == 1
    env.step(0)


def _batch_env(recorded, batch_sizes=(1, 2)):
    from test_batch_replay import known_profile

    trace_dir, trace, _ = recorded
    profile = known_profile(TREE).with_batch({b: known_profile(TREE, b) for b in (1, 2, 4)})
    env = gym.make("specpilot/ReplaySize-v0", trace=str(trace_dir), profile=profile, size_actions=SIZES,
                   depth_controller=(1, TREE.max_depth), batch_sizes=list(batch_sizes)).unwrapped
    return env, trace


def test_a_batch_episode_is_terminated_only_when_every_row_ended_with_its_end_token(recorded):
    from specpilot.envs.replay import ReplaySession

    env, trace = _batch_env(recorded)
    ends = {i: trace.budget(i, MAX_NEW)[1] for i in range(trace.num_prompts)}
    eos, cut = [i for i, e in ends.items() if e], [i for i, e in ends.items() if not e]
    assert eos and cut
    for lead, other, want in ((eos[0], cut[0], "length"), (cut[0], eos[0], "length"), (eos[0], eos[0], "eos")):
        env.reset(seed=0, options={"prompt_index": lead, "batch_size": 2})
        env.session.rows[1] = ReplaySession(env.source.model, other)   # the second row, chosen (before any cycle)
        done = False
        while not done:
            obs, _, terminated, truncated, info = env.step(0)
            done = terminated or truncated
        assert info["finished_by"] == want and (terminated, truncated) == (want == "eos", want != "eos")
        assert env.observation_space.contains(obs)


@pytest.mark.parametrize("batch_size,fragment", [(5, "the latency profile measured batch sizes"),
                                                 (0, "batch_size must be an integer >= 1")])
def test_a_reset_batch_size_the_profile_cannot_time_is_refused_up_front(recorded, batch_size, fragment):
    env, _ = _batch_env(recorded, batch_sizes=(1, 2, 4))
    with pytest.raises(ValueError, match=fragment):
        env.reset(seed=0, options={"batch_size": batch_size})
    assert env.reset(seed=0, options={"batch_size": 3})[1]["batch_size"] == 3   # within the curves: interpolated


@pytest.mark.parametrize("env_id", ["specpilot/Depth-v0", "specpilot/Size-v0"])
@pytest.mark.parametrize("prompts", [None, [], "def f(x):", [1, 2, 3]])
def test_live_env_prompts_are_checked_before_the_default_pair_loads(env_id, prompts, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the default pair was loaded before the prompts were checked")

    monkeypatch.setattr(ModelPair, "from_pretrained", no_load)
    with pytest.raises(TypeError, match="non-empty list of prompts"):
        gym.make(env_id, prompts=prompts)
