"""Training pipeline on a tiny recorded task: stage 1 + one co-adaptation round write loadable policies, validation
scores are the inference controllers' replay throughput, resume skips finished stages, the ablation reports."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specpilot.drafting.types import TreeConfig
from specpilot.envs.record import record_trace
from specpilot.envs.oracle import replay_controller
from specpilot.policies.ppo import load_run_controllers
from specpilot.train.rl import pipeline as P
from specpilot.train.rl.ppo import PPOOverrides

from test_grid import synthetic_profile
from tiny import tiny_pair

TREE = TreeConfig(width=3, max_depth=4, max_size=8)
SMALL = PPOOverrides(pi_arch=[16], vf_arch=[16], n_steps=64, batch_size=32, n_epochs=2)
STATIC = (2, 4)


def tiny_task_traces(root, tree: TreeConfig, *, noise: float, seed: int) -> P.TaskTraces:
    """train (3 prompts) and validation (2) traces of a tiny pair, each with a synthetic latency profile."""
    pair = tiny_pair(noise=noise, eos=None)
    rng = np.random.default_rng(seed)
    for split, n in (("train", 3), ("validation", 2)):
        prompts = [rng.integers(0, 95, size=5).tolist() for _ in range(n)]
        record_trace(pair, tree, prompts, max_new_tokens=16).save(root / split)
        synthetic_profile(tree).save(root / split / "profile.json")
    return P.TaskTraces.resolve(root)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return tiny_task_traces(tmp_path_factory.mktemp("traces"), TREE, noise=0.2, seed=1)


def _kw(**options):
    """The small-budget options of these tests (static config, tiny PPO, no wandb) with `options` changed."""
    return {"options": P.TrainOptions(**{"static": STATIC, "ppo": SMALL, **options}), "wandb": "disabled"}


def test_stage1_and_coadapt_write_loadable_policies(traces, tmp_path):
    run = tmp_path / "run"
    out = P.run_pipeline(run, traces, size_steps=192, depth_steps=192, coadapt_steps=128, rounds=1, **_kw())
    index = json.loads((run / "policies.json").read_text())
    assert index["fallback"] == {"depth": STATIC[0], "size": STATIC[1]}
    controllers = load_run_controllers(run)
    assert set(controllers) == {"ltd", "depth_only", "size_only"}
    stage1 = load_run_controllers(run / "stage1")
    assert set(stage1) == {"ltd", "depth_only", "size_only"}
    # the round trained the size policy against the frozen stage-1 depth policy
    assert out["coadapt"]["rounds"][0]["stage"] == "co1_size"
    assert (run / "co1_size" / "best.zip").is_file() and (run / "manifest.json").is_file()
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stage_setup"]["co1_size"]["partner"]["name"] == "frozen_depth"
    assert manifest["stages"]["size_s1"]["settings"]["n_steps"] == 64 and "torch" in manifest["versions"]
    # validation = the inference controller under replay on the validation trace
    s1_size = json.loads((run / "size_s1" / "best.json").read_text())["score"]
    replayed = replay_controller(traces.validation, controller=stage1["size_only"])["tokens_per_s"]
    assert s1_size == pytest.approx(replayed)
    s1_depth = json.loads((run / "depth_s1" / "best.json").read_text())["score"]
    assert s1_depth == pytest.approx(replay_controller(traces.validation, controller=stage1["depth_only"])["tokens_per_s"])
    # co-adaptation never hands on a policy worse on validation than the one it started from
    rnd = out["coadapt"]["rounds"][0]
    assert rnd["score"] >= rnd["validation"]["init_score"] - 1e-9

    ev = P.evaluate_run(run, traces, static=STATIC)
    assert {"static", "ltd", "depth_only", "size_only", "s1_ltd", "oracle", "ar"} <= set(ev)
    assert ev["oracle"]["tokens_per_s"] >= ev["ltd"]["tokens_per_s"] * (1 - 1e-9)


def test_resume_skips_finished_stages(traces, tmp_path, monkeypatch):
    run = tmp_path / "run"
    P.train_size(run, traces, steps=128, **_kw())
    P.train_depth(run, traces, steps=128, **_kw())
    first = P.coadapt(run, traces, rounds=2, steps=64, **_kw())

    import specpilot.train.rl.ppo as ppo

    def boom(*args, **kwargs):
        raise AssertionError("a finished stage was trained again")

    monkeypatch.setattr(ppo, "train_policy", boom)
    again = P.coadapt(run, traces, rounds=2, steps=64, **_kw(resume=True))
    assert [r["skipped"] for r in again["rounds"]] == [True, True]
    assert str(again["depth"]) == str(first["depth"]) and str(again["size"]) == str(first["size"])
    res = P.train_size(run, traces, steps=128, **_kw(resume=True))
    assert res.skipped
    with pytest.raises(FileExistsError):  # without --resume an existing stage is never overwritten
        monkeypatch.undo()
        P.train_size(run, traces, steps=128, **_kw())


def test_coadapt_needs_stage1(traces, tmp_path):
    with pytest.raises(FileNotFoundError, match="train stage"):
        P.coadapt(tmp_path / "empty", traces, rounds=1, steps=64, **_kw())


def test_reward_ablation_reports_every_mode(traces, tmp_path):
    res = P.reward_ablation(tmp_path / "run", traces, kind="size", rewards=("throughput", "acceptance"), steps=128,
                            **_kw())
    assert [r["reward"] for r in res["rows"]] == ["throughput", "acceptance"]
    data = json.loads((tmp_path / "run" / "ablation" / "ablation.json").read_text())
    for row in data["rows"]:
        # the best checkpoint's row is its validation score (replay of the policy on the validation trace)
        best = json.loads((tmp_path / "run" / "ablation" / row["stage"] / "best.json").read_text())
        assert row["best"]["tokens_per_s"] == pytest.approx(best["score"])
        assert row["final"]["speedup"] == pytest.approx(row["final"]["tokens_per_s"] / data["ar"]["tokens_per_s"])


def test_budget_settings_scale_and_keep_paper_defaults():
    big = P.budget_settings("size", 100_000)
    assert (big.n_steps, big.batch_size, big.n_epochs, big.pi_arch, big.gamma) == (2048, 256, 20, [1024, 256], 0.9)
    depth = P.budget_settings("depth", 1_000_000)
    assert (depth.pi_arch, depth.vf_arch, depth.gamma, depth.ent_coef) == ([1024], [1024, 256], 0.999, 0.01)
    small = P.budget_settings("size", 2000)
    assert small.n_steps == 128 and small.total_timesteps // small.n_steps >= 8 and small.n_epochs == 10
    assert P.budget_settings("size", 2000, ppo=PPOOverrides(n_epochs=3, n_steps=512)).n_epochs == 3


def test_evaluate_live_reports_speedup_and_policy_overhead(traces):
    from specpilot.policies import FixedController

    pair = tiny_pair(noise=0.2, eos=None)
    res = P.evaluate_live(pair, {"fixed": FixedController(2, 4), "plain": FixedController(0, 4)},
                          [[1, 2, 3], [4, 5, 6]], tree=TREE, max_new_tokens=8)
    assert res["ar"]["tokens"] == res["fixed"]["tokens"] == res["plain"]["tokens"] == 16
    assert res["plain"]["mean_accepted_length"] == 1.0 and res["plain"]["depth_mean"] == 0
    assert res["ar"]["speedup"] == pytest.approx(1.0)
    assert 0 <= res["fixed"]["policy_overhead"] < 1 and res["fixed"]["depth_mean"] <= 2


def test_live_backend_fine_tunes_a_replay_policy(traces, tmp_path):
    run = tmp_path / "run"
    replayed = P.train_size(run, traces, steps=64, **_kw())
    pair = tiny_pair(noise=0.2, eos=None)
    live = P.train_size(run, traces, steps=64, stage="size_live", init_from=replayed.best,
                        **_kw(backend="live", pair=pair, train_prompts=[[1, 2, 3, 4]]))
    assert live.best.is_file()
    # validation stays replay of the inference controller, whatever the training backend
    from specpilot.policies import FixedController, PPOController
    from specpilot.policies.ppo import load_sb3_policy

    ctrl = PPOController(None, load_sb3_policy(live.best), size_spec=live.spec, size_actions=live.size_actions,
                         fallback=FixedController(STATIC[0], 1))
    assert live.score == pytest.approx(replay_controller(traces.validation, controller=ctrl)["tokens_per_s"])
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stage_setup"]["size_live"]["backend"] == "live"
    assert manifest["stage_setup"]["size_live"]["init_from"] == str(replayed.best)


def test_off_switch_is_measured_and_loaders_honour_it(traces, tmp_path):
    """check_off_switch measures the policies against plain steps and writes its verdict; an index whose verdict is
    "plain steps" loads as controllers that never draft, under the same names, with the evidence attached."""
    from specpilot.policies.ppo import PlainSteps
    from specpilot.train.rl.sampled import check_off_switch

    run = tmp_path / "run"
    P.run_pipeline(run, traces, size_steps=64, depth_steps=64, coadapt_steps=64, rounds=0, **_kw())
    pair = tiny_pair(noise=0.2, eos=None)
    verdict = check_off_switch(run / "policies.json", pair, [[1, 2, 3], [4, 5, 6]], tree=TREE, temperature=1.0,
                               repeats=2, max_new_tokens=8)
    assert set(verdict) >= {"plain_steps", "ratio", "ci", "temperature", "units", "rule"}
    assert verdict["units"] == 4 and verdict["plain_steps"] == (not verdict["ci"][0] > 1.0)
    assert json.loads((run / "policies.json").read_text())["off_switch"] == verdict
    index = json.loads((run / "policies.json").read_text())
    index["off_switch"]["plain_steps"] = True
    (run / "policies.json").write_text(json.dumps(index))
    controllers = load_run_controllers(run)
    assert set(controllers) == {"ltd", "depth_only", "size_only"}
    assert all(isinstance(c, PlainSteps) and c.depth == 0 for c in controllers.values())
    assert controllers["ltd"].describe()["off_switch"]["plain_steps"] is True
    index["off_switch"]["plain_steps"] = False
    (run / "policies.json").write_text(json.dumps(index))
    assert not any(isinstance(c, PlainSteps) for c in load_run_controllers(run).values())


@pytest.mark.parametrize("policies_low, policies_vs_static, static_ci, grid_choice, expected", [
    (1.02, 1.01, (1.01, 1.04), False, "policies"),  # the policies pay and are no slower than the static config
    (1.02, None, None, False, "policies"),  # no drafting static config was measured
    (1.02, 0.98, (1.05, 1.09), True, "static"),  # the policies pay, the static config measured faster
    (0.99, 0.96, (1.01, 1.06), False, "static"),  # the policies do not pay, a static config does
    (0.99, 1.03, (1.01, 1.03), False, "static"),  # a paying static config before policies that do not measurably pay
    (0.99, 0.96, (0.99, 1.05), False, "plain"),  # neither pays, and the grid does not draft at T
    (0.99, 0.96, (0.99, 1.05), True, "static"),  # the grid's choice at T (the demo's T=1 d1 V1), not found slower
    (0.99, 1.20, (0.75, 0.81), True, "plain"),  # the grid's choice at T, found slower than plain steps now
    (0.99, 1.20, (0.75, 0.81), False, "plain"),  # the greedy config at T=1 (d3 V12: 0.78x of plain steps)
    (1.00, None, None, False, "plain"),  # an interval touching 1 does not pay
    (0.99, None, None, True, "plain"),
])
def test_off_switch_choice(policies_low, policies_vs_static, static_ci, grid_choice, expected):
    from specpilot.train.rl.sampled import off_switch_choice

    assert off_switch_choice(policies_low, policies_vs_static, static_ci, grid_choice) == expected


@pytest.mark.parametrize("policies_vs_static, same_as_static, expected", [
    (1.002, True, "static"),  # the policies chose the static config's depth and size on every cycle: decision time only
    (1.030, True, "static"),  # ... whatever timing noise made of it
    (1.002, False, "policies"),  # different decisions that did not measure slower
    (0.980, False, "static"),  # the static config measured faster
])
def test_policies_that_decide_like_the_static_config_give_way_to_it(policies_vs_static, same_as_static, expected):
    from specpilot.train.rl.sampled import off_switch_choice

    assert off_switch_choice(1.05, policies_vs_static, (1.20, 1.30), True, same_as_static) == expected


@pytest.mark.parametrize("other, same", [((2, 3), True), ((3, 3), False), ((2, 2), False)])
def test_measure_controllers_says_when_two_controllers_decided_alike(other, same):
    from specpilot.eval.runner import measure_controllers
    from specpilot.policies import FixedController

    pair = tiny_pair(noise=0.2, eos=None)
    out = measure_controllers(pair, {"a": FixedController(2, 3), "b": FixedController(*other)}, [[1, 2, 3], [4, 5]],
                              tree=TREE, max_new_tokens=6, repeats=2, warmup=0, baseline="b", temperature=1.0,
                              also_vs=["ar"])
    assert out["a"]["vs"]["b"]["same_decisions"] is same
    assert out["a"]["vs"]["ar"]["same_decisions"] is False  # plain decoding has no cycles to compare


@pytest.mark.parametrize("at_t1, grid_choice, static", [
    ({"width": 4, "depth": 1, "size": 1}, (1, 1), (1, 1)),  # the grid drafts at T=1: its config there
    ({"width": 4, "depth": 0, "size": 0}, None, (3, 8)),  # plain steps at T=1: the greedy config is measured
    (None, None, (3, 8)),  # no live phase at T=1
])
def test_the_static_config_measured_at_a_temperature(tmp_path, at_t1, grid_choice, static):
    from specpilot.train.rl.sampled import _grid_choice_at, _static_at

    grid = {"best": {"width": 4, "depth": 3, "size": 8, "source": "replay"},
            "best_drafting": {"width": 4, "depth": 3, "size": 8},
            "best_by_temperature": {"1": at_t1} if at_t1 else {},
            "meta": {"traces": [{"trace": "t", "width": 4, "max_depth": 6}], "pair": None}}
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    options = P.TrainOptions(static=tmp_path / "grid.json")
    assert _grid_choice_at(tmp_path, 1.0, options) == grid_choice
    assert tuple(_static_at(tmp_path, 1.0, options)) == static


def test_a_verdict_of_an_earlier_rule_is_measured_again():
    from specpilot.train.rl.sampled import OFF_SWITCH_RULE, verdict_stands

    basis = {"rule": OFF_SWITCH_RULE, "temperature": 1.0, "units": 4}
    assert verdict_stands({**basis, "plain_steps": True}, basis)
    assert not verdict_stands({**basis, "rule": "draft only when the policies' interval lies above 1"}, basis)
    assert not verdict_stands({k: v for k, v in basis.items() if k != "rule"}, basis)
    assert not verdict_stands(None, basis)


def test_switch_to_the_static_config_when_it_measured_faster(traces, tmp_path):
    """With a static config, check_off_switch also measures the policies against it; a verdict naming the static
    config (it measured faster, and the policies beat plain steps) loads as that config under the policies' names."""
    from specpilot.policies.ppo import PlainSteps, StaticSteps
    from specpilot.train.rl.sampled import OFF_SWITCH_RULE, check_off_switch, off_switch_choice

    run = tmp_path / "run"
    P.run_pipeline(run, traces, size_steps=64, depth_steps=64, coadapt_steps=64, rounds=0, **_kw())
    pair = tiny_pair(noise=0.2, eos=None)
    verdict = check_off_switch(run / "policies.json", pair, [[1, 2, 3], [4, 5, 6]], tree=TREE, temperature=1.0,
                               repeats=2, max_new_tokens=8, static=(2, 3))
    assert verdict["vs_static"]["config"] == [2, 3] and len(verdict["vs_static"]["ci"]) == 2
    assert isinstance(verdict["vs_static"]["same_decisions"], bool)
    assert verdict["static_vs_plain"]["config"] == [2, 3] and len(verdict["static_vs_plain"]["ci"]) == 2
    choice = off_switch_choice(verdict["ci"][0], verdict["vs_static"]["ratio"], verdict["static_vs_plain"]["ci"],
                               same_as_static=verdict["vs_static"]["same_decisions"])
    assert verdict["static_is_grid_choice"] is False
    assert verdict["static"] == ([2, 3] if choice == "static" else None)
    assert verdict["plain_steps"] == (choice == "plain") and verdict["rule"] == OFF_SWITCH_RULE
    index = json.loads((run / "policies.json").read_text())
    index["off_switch"].update(plain_steps=False, static=[2, 3])
    (run / "policies.json").write_text(json.dumps(index))
    controllers = load_run_controllers(run)
    assert all(isinstance(c, StaticSteps) and (c.depth, c.size) == (2, 3) for c in controllers.values())
    assert controllers["ltd"].describe()["off_switch"]["static"] == [2, 3]
    index["off_switch"].update(plain_steps=True)  # plain steps win over the static config
    (run / "policies.json").write_text(json.dumps(index))
    assert all(isinstance(c, PlainSteps) for c in load_run_controllers(run).values())
    index["off_switch"].update(plain_steps=False, static=None)
    (run / "policies.json").write_text(json.dumps(index))
    assert not any(isinstance(c, (PlainSteps, StaticSteps)) for c in load_run_controllers(run).values())
