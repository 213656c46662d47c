"""The per-batch-size oracle ceiling, behaviour cloning over batches, and the validation guard: the oracle's shared
per-cycle decision is the argmax of the batch's tokens / time, its ceiling is never below a static cell; BC learns
the per-batch oracle's labels; the guard hands the batch sizes where the learned policy loses on validation to the
table (and the export's learned table follows it)."""
from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

from specpilot.drafting.control import FixedController
from specpilot.drafting.cycle import run_cycle
from specpilot.drafting.types import TreeConfig
from specpilot.envs.batch_replay import (BatchOracle, BatchOracleController, BatchReplaySession, BatchTimes,
                                         batch_static_sweep, batches_of, learned_batch_table, replay_batch,
                                         replay_batch_oracle)
from specpilot.envs.profile import LatencyProfile
from specpilot.envs.replay import ReplayModel
from specpilot.policies.heuristics import BatchGuardController, BatchTableController
from specpilot.policies.observation import BATCH_FEATURES, ObservationSpec
from specpilot.train.rl import pipeline as P
from specpilot.train.rl.imitation import (BatchOracleLabels, ImitationSettings, LabellingController, imitate,
                                       rollout_batches)
from specpilot.train.rl.ppo import PPOOverrides
from specpilot.train.rl.validation import batch_guard

from test_batch_learn import BATCH_SIZES, TREE, task, trained  # noqa: F401 (module-scoped fixtures)

SIZES = [1, 2, 4, 6]
DEPTHS = list(range(0, TREE.max_depth + 1))


def _one_cycle(session: BatchReplaySession, depth: int, size: int) -> float:
    """tokens / time of the session's next cycle under (depth, size), on a copy (brute force)."""
    trial = copy.deepcopy(session)
    before = trial.emitted_total
    record = run_cycle(trial, FixedController(depth, size))
    return (trial.emitted_total - before) / record.cycle_s


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_batch_oracle_decision_is_the_argmax_of_tokens_per_time(task, batch):
    model = ReplayModel(task.train)
    times = BatchTimes(model)
    oracle = BatchOracle(model, DEPTHS, SIZES, times=times)
    controller = BatchOracleController(oracle)
    session = controller.session = BatchReplaySession(model, batches_of(model.num_prompts, batch)[0], times=times)
    checked = 0
    while not session.done:
        brute = {(d, v): _one_cycle(session, d, v) for d in DEPTHS for v in (SIZES if d else SIZES[:1])}
        best = max(brute.values())
        choice = oracle.choice(session)
        # the oracle's choice reaches the best ratio (exact ties: any of them; sizes above the candidates tie)
        assert brute[(choice[0], choice[1] if choice[0] else SIZES[0])] == pytest.approx(best, rel=1e-12)
        run_cycle(session, controller)
        checked += 1
    assert checked > 1


@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_batch_oracle_ceiling_is_never_below_a_static_cell_or_the_table(task, batch):
    model = ReplayModel(task.validation)
    ceiling = replay_batch_oracle(model, batch_size=batch, sizes=SIZES)
    cells = [(d, v) for d in range(1, TREE.max_depth + 1) for v in SIZES]
    rows = batch_static_sweep(model, cells, [batch])
    assert ceiling["tokens"] == rows[0]["tokens"]  # every policy emits the same recorded tokens
    assert ceiling["tokens_per_s"] >= max(r["tokens_per_s"] for r in rows) * (1 - 1e-12)
    assert sum(ceiling["sources"].values()) == len(batches_of(model.num_prompts, batch))


@pytest.mark.parametrize("rates", [None, {1: 50.0, 4: 120.0}], ids=["ratio", "dinkelbach"])
def test_batch_labels_replay_to_the_per_cycle_oracle(task, rates):
    """Answering every question with its batch label, through run_cycle, takes the oracle's decisions."""
    from specpilot.policies.observation import DEFAULT_FEATURES, DEFAULT_SIZE_FEATURES

    model = ReplayModel(task.train)
    labels = BatchOracleLabels(model, SIZES, rates=rates)
    features = DEFAULT_FEATURES + BATCH_FEATURES
    spec_d = ObservationSpec.for_depth(TREE.width, TREE.max_depth, features=features)
    spec_s = ObservationSpec.for_size(TREE.width, TREE.max_depth, size_actions=SIZES, features=features)
    expert = LabellingController(labels, spec_d, spec_s, SIZES, None)
    got = rollout_batches(model, expert, [2], times=labels.times)
    assert expert.depth_data.agreed == expert.depth_data.asked > 0
    oracle_ctrl = BatchOracleController(labels.oracle(2))
    want = 0.0
    for batch in batches_of(model.num_prompts, 2):
        session = oracle_ctrl.session = BatchReplaySession(model, batch, times=labels.times)
        from specpilot.drafting.cycle import run_generation

        run_generation(session, oracle_ctrl)
        want += sum(r.cycle_s for r in session.cycles)
    assert got["time_s"] == pytest.approx(want)


def _load_dependent_profile(tree: TreeConfig, batch: int) -> LatencyProfile:
    """Free drafting and a flat verification at batch size 1 (drafting as deep and wide as possible is always among
    the best answers), verification that explodes with V at batch size 4 (plain steps always win): the oracle's
    labels are a function of the batch size, which the batch feature shows."""
    first = {n: [0.0] for n in range(1, tree.max_depth + 2)}
    levels = {level: [0.0] for level in range(2, tree.max_depth + 1)}
    slope = 0.0 if batch == 1 else 2e-3 * batch
    verify = [(v, c, 1e-3 + slope * v) for v in range(0, tree.max_size + 1) for c in (4, 30)]
    return LatencyProfile.from_samples(first, levels, verify, max_depth=tree.max_depth, width=tree.width)


def test_behaviour_cloning_over_batches_reproduces_the_batch_oracle_labels(task, tmp_path):
    root = tmp_path / "traces"
    profile = _load_dependent_profile(TREE, 1).with_batch({b: _load_dependent_profile(TREE, b) for b in (1, 4)})
    for split in ("train", "validation"):
        shutil.copytree(getattr(task, split), root / split)
        profile.save(root / split / "profile.json")
    traces = P.TaskTraces.resolve(root)
    options = P.TrainOptions(static=(2, 4), batch_sizes=(1, 4), bc_iters=1,
                             ppo=PPOOverrides(pi_arch=[64], vf_arch=[16], n_steps=64, batch_size=32, n_epochs=2))
    out = imitate(tmp_path / "run", traces, size_actions=SIZES, options=options,
                  settings=ImitationSettings(iters=1, epochs=200, lr=1e-2, loss="set"))
    fit = out["iterations"][0]["fit"]
    assert out["depth"].spec.features[-len(BATCH_FEATURES):] == BATCH_FEATURES
    # the profile's draft levels still cost 1 ns: answers that close count as tied (BatchOracleLabels.tie_s), so
    # every label is a function of the batch size and the networks fit all of them
    assert fit["depth"]["accuracy"] == 1.0 and fit["size"]["accuracy"] == 1.0
    # the cloned controller (loaded as any run, the inference path) answers every question whose answer matters
    # (a wrong answer costs > 1 us) as the per-batch oracle labels it
    from specpilot.policies.observation import DEFAULT_FEATURES, DEFAULT_SIZE_FEATURES
    from specpilot.policies.ppo import load_run_controllers
    from specpilot.train.rl.imitation import batch_rates

    ltd = load_run_controllers(tmp_path / "run" / "bc")["ltd"]
    model = ReplayModel(traces.train)
    labels = BatchOracleLabels(model, SIZES, rates=batch_rates(model, SIZES, (1, 4)))
    features = DEFAULT_FEATURES + BATCH_FEATURES
    expert = LabellingController(labels, ObservationSpec.for_depth(TREE.width, TREE.max_depth, features=features),
                                 ObservationSpec.for_size(TREE.width, TREE.max_depth, size_actions=SIZES,
                                                          features=features + DEFAULT_SIZE_FEATURES), SIZES, None)
    rollout_batches(model, expert, (1, 4), times=labels.times)
    for actor, data in ((ltd.depth_actor, expert.depth_data), (ltd.size_actor, expert.size_data)):
        obs, best = data.arrays()[0], data.best_mask()
        regret = np.nan_to_num(np.stack(data.regret), nan=np.inf)
        matters = [i for i in range(len(obs)) if regret[i].max() > 1e-6]
        assert len(matters) >= 3 and all(best[i, actor.act(obs[i])] for i in matters)
    # its own table: deep and wide alone, plain steps at batch size 4
    model = ReplayModel(traces.validation)
    rows = {r["batch_size"]: (r["depth"], r["size"]) for r in learned_batch_table(model, ltd, [1, 4])}
    assert rows == {1: (TREE.max_depth, max(SIZES)), 4: (0, 0)}
    assert set(out["iterations"][0]["val_per_batch_size"]) == {1, 4}
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["stage_setup"]["bc_depth"]["batch_sizes"] == [1, 4]


def test_pipeline_over_batch_sizes_uses_bc_then_ppo(task, tmp_path):
    run = tmp_path / "run"
    options = P.TrainOptions(static=(2, 4), batch_sizes=BATCH_SIZES, bc_iters=2, bc_epochs=5,
                             ppo=PPOOverrides(pi_arch=[16], vf_arch=[16], n_steps=64, batch_size=32, n_epochs=2))
    out = P.run_pipeline(run, task, coadapt_steps=64, rounds=1, size_actions=SIZES, options=options,
                         wandb="disabled")
    history = json.loads((run / "bc" / "imitation.json").read_text())["iterations"]
    assert [h["rollout"] for h in history] == ["oracle", "policy"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stage_setup"]["co1_size"]["init_from"].endswith("bc_size/best.zip")
    assert manifest["stage_setup"]["co1_size"]["batch_sizes"] == list(BATCH_SIZES)
    assert out["batch_guard"] is None  # no per-batch-size grid table in this run


class _Split(BatchTableController):
    """A 'learned' policy: one cell at batch size 1, another above it."""

    def __init__(self, at_one, above):
        super().__init__({1: at_one, 2: above})


def test_guard_falls_back_where_the_learned_policy_loses_on_validation(task):
    model = ReplayModel(task.validation)
    speed = {c: replay_batch(model, FixedController(*c), batch_size=1)["tokens_per_s"] for c in ((0, 0), (2, 4))}
    better, worse = sorted(speed, key=speed.get, reverse=True)
    assert speed[better] > speed[worse]
    table = {1: better, 2: (0, 0)}
    learned = _Split(worse, (0, 0))   # loses at B1, equals the table above (a tie keeps the learned policy)
    guard = batch_guard(learned, table, model, BATCH_SIZES)
    assert guard["fallback"] == [1]
    per = guard["per_batch_size"]
    assert per["1"]["learned"] < per["1"]["table"] and per["4"]["learned"] == per["4"]["table"]
    assert all(r["guarded"] >= r["table"] * (1 - 1e-9) for r in per.values())
    greedy = batch_guard(learned, table, model, BATCH_SIZES, exhaustive_up_to=0)   # the search past 6 sizes
    assert greedy["fallback"] == [1] and greedy["candidates"] == 1
    guarded = BatchGuardController.from_dict(learned, guard)
    table_ctrl = BatchTableController(table)
    for b in BATCH_SIZES:
        got = replay_batch(model, guarded, batch_size=b)["tokens_per_s"]
        best = max(replay_batch(model, learned, batch_size=b)["tokens_per_s"],
                   replay_batch(model, table_ctrl, batch_size=b)["tokens_per_s"])
        assert got == pytest.approx(best)   # on validation, the better of the two at every size
    # the guarded controller's own table (what export writes) is the table's entry at the fallback sizes
    rows = {r["batch_size"]: (r["depth"], r["size"]) for r in learned_batch_table(model, guarded, BATCH_SIZES)}
    assert rows[1] == better and rows[4] == (0, 0)


def test_guard_file_loads_as_ltd_guarded(task, tmp_path):
    from specpilot.policies.ppo import BATCH_GUARD_FILE, load_batch_guard

    (tmp_path / BATCH_GUARD_FILE).write_text(json.dumps({"table": {"1": [2, 4], "4": [0, 0]}, "fallback": [4]}))
    guarded = load_batch_guard(tmp_path, FixedController(3, 6))
    assert guarded.uses_table(4) and guarded.uses_table(16) and not guarded.uses_table(2)
    with pytest.raises(ValueError, match="must be keys"):
        BatchGuardController(FixedController(3, 6), {1: (2, 4)}, [2])


def test_one_row_batches_take_the_exact_single_sequence_labels(task):
    from specpilot.envs.replay import ReplaySession
    from specpilot.train.rl.imitation import OracleLabels

    model = ReplayModel(task.train)
    exact = BatchOracleLabels(model, SIZES, exact_single=True)
    single = OracleLabels(model, SIZES)
    batch, alone = BatchReplaySession(model, [1]), ReplaySession(model, 1)
    for depth in range(0, TREE.max_depth):
        assert np.array_equal(exact.depth_costs(batch, depth), single.depth_costs(alone, depth))
    assert np.array_equal(exact.size_costs(batch, 2), single.size_costs(alone, 2))
    # without exact_single a one-row batch is costed per cycle (seconds per token), not as time to finish
    assert not np.array_equal(BatchOracleLabels(model, SIZES).size_costs(batch, 2), single.size_costs(alone, 2))


def test_export_learned_table_goes_through_the_guard(task, trained, tmp_path):
    from specpilot.drafting.decoder import SpeculativeDecoder, autoregressive_generate
    from specpilot.policies.exported import load_exported
    from specpilot.policies.ppo import BATCH_GUARD_FILE
    from specpilot.train.export.writer import export_run
    from tiny import tiny_pair

    run, _ = trained
    # a guard that hands every size to the table: the exported learned table must be that table
    table = {"1": [2, 4], "2": [1, 2], "4": [0, 0]}
    (run / BATCH_GUARD_FILE).write_text(json.dumps({"table": table, "fallback": [1, 2, 4]}))
    meta = export_run(run, tmp_path / "export", pair=tiny_pair(noise=0.4, eos=None), num_prompts=1,
                      max_new_tokens=8, num_random=100, log=lambda *a: None)
    rows = meta["engine_configs"]["per_batch_size_learned"]["table"]
    assert [(r["batch_size"], r["depth"], r["size"]) for r in rows] == [(1, 2, 4), (2, 1, 2), (4, 0, 0)]
    # the guard travels in decoder.json: the exported decoder decides as the run's ltd_guarded
    assert meta["policies"]["batch_guard"] == {"table": table, "fallback": [1, 2, 4]}
    exported, _, _ = load_exported(tmp_path / "export", load_pair=False)
    assert isinstance(exported, BatchGuardController) and exported.fallback == [1, 2, 4]
    assert exported.name == "exported_guarded"
    pair = tiny_pair(noise=0.4, eos=None)
    decoder = SpeculativeDecoder.from_config(tmp_path / "export", pair=pair)
    assert isinstance(decoder.default_controller, BatchGuardController)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    outs = decoder.generate_batch(prompts, max_new_tokens=8)
    assert [o.tokens for o in outs] == [autoregressive_generate(pair, p, max_new_tokens=8).tokens for p in prompts]
    # every cycle is the table's (batch size 2: depth 1, size 2; 1 row left: depth 2, size 4)
    assert {(c.depth, c.size) for o in outs for c in o.cycles} <= {(1, 2), (2, 4)}


def test_export_refuses_a_guard_that_does_not_fit_the_tree(trained, tmp_path):
    from specpilot.policies.ppo import BATCH_GUARD_FILE
    from specpilot.train.export.writer import ExportError, export_run

    run, _ = trained
    path = run / BATCH_GUARD_FILE
    before = path.read_text() if path.is_file() else None
    path.write_text(json.dumps({"table": {"1": [TREE.max_depth + 5, 4]}, "fallback": [1]}))
    try:
        with pytest.raises(ExportError, match="validation guard cannot run on the exported tree"):
            export_run(run, tmp_path / "export", num_prompts=1, max_new_tokens=8, num_random=10, log=lambda *a: None)
    finally:
        path.unlink() if before is None else path.write_text(before)
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("guard, match", [
    ({"table": {"1": [2, 4]}, "fallback": [2]}, "must be keys"),
    ({"table": {"1": [99, 4]}, "fallback": [1]}, "max_depth"),
    ({"fallback": [1]}, "table"),
    ("yes", "batch_guard"),
])
def test_exported_batch_guard_is_checked_on_load(tmp_path, guard, match):
    from specpilot.artifacts.decoder import ExportedConfigError
    from specpilot.policies.exported import _guarded

    with pytest.raises(ExportedConfigError, match="invalid policies.batch_guard") as err:
        _guarded(FixedController(2, 4), guard, TREE, "decoder.json")
    assert match in str(err.value)
