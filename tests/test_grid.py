"""Grid search: the exact replay sweep picks the replay-best cell, the live phase re-ranks the top cells, and the
result (JSON + heat map) is what `specpilot eval --grid` reads."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from specpilot.drafting.types import TreeConfig
from specpilot.envs.profile import LatencyProfile
from specpilot.envs.record import record_trace
from specpilot.envs.oracle import replay_static
from specpilot.train.grid.search import grid_search, pick_sampled, resolve_train_trace

from tiny import tiny_pair

TREE = TreeConfig(width=3, max_depth=4, max_size=12)


def synthetic_profile(tree: TreeConfig) -> LatencyProfile:
    first = {n: [1e-3 + 1e-4 * n] for n in range(1, tree.max_depth + 2)}
    levels = {level: [1.2e-3] for level in range(2, tree.max_depth + 1)}
    verify = [(v, c, 4e-3 + 2e-4 * v + 1e-6 * c) for v in range(0, tree.max_size + 1) for c in (10, 40)]
    return LatencyProfile.from_samples(first, levels, verify, max_depth=tree.max_depth, width=tree.width)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    pair = tiny_pair(noise=0.2, eos=None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 95, size=5).tolist() for _ in range(3)]
    root = tmp_path_factory.mktemp("traces")
    trace = record_trace(pair, TREE, prompts, max_new_tokens=16)
    trace.save(root / "train")
    synthetic_profile(TREE).save(root / "train" / "profile.json")
    return pair, prompts, root


def test_replay_sweep_picks_the_replay_best_and_writes_json_and_png(recorded, tmp_path):
    _, _, root = recorded
    out = tmp_path / "grid.json"
    result = grid_search(resolve_train_trace(root), sizes=[1, 2, 4, 8, 12], out=out)
    cells = {(r["depth"], r["size"]): r["tokens_per_s"] for r in result["table"]}
    assert len(cells) == TREE.max_depth * 5 + 1  # + depth 0 (plain target steps): one cell
    assert (0, 0) in cells
    # every cell equals an independent replay of that static config (through run_cycle)
    for (d, v), tps in cells.items():
        assert tps == pytest.approx(replay_static(root / "train", depth=d, size=v)["tokens_per_s"])
    best = result["best"]
    assert best["source"] == "replay" and best["width"] == TREE.width
    assert cells[(best["depth"], best["size"])] == max(cells.values())
    data = json.loads(out.read_text())
    assert data["best"]["depth"] == best["depth"] and data["best"]["size"] == best["size"]
    assert (tmp_path / "grid.png").stat().st_size > 1000
    assert data["oracle"][str(TREE.width)]["oracle"]["tokens_per_s"] >= max(cells.values()) * (1 - 1e-9)
    assert all(r["speedup"] > 0 for r in data["table"])


def test_live_phase_remeasures_the_top_cells_and_picks_the_best_live(recorded, tmp_path):
    pair, prompts, root = recorded
    result = grid_search(root / "train", sizes=[1, 4, 12], depths=[1, 2, 4], pair=pair, val_prompts=prompts[:2],
                         live_top=2, live_max_new_tokens=8, live_warmup=1, out=tmp_path / "g.json", heatmap=False)
    live = result["live"]
    assert len(live) == 2
    top2 = [(r["depth"], r["size"]) for r in result["table"][:2]]
    assert [(r["depth"], r["size"]) for r in live] == top2
    chosen = max(live, key=lambda r: r["tokens_per_s"])
    assert result["best"]["source"] == "live"
    assert (result["best"]["depth"], result["best"]["size"]) == (chosen["depth"], chosen["size"])
    assert all(r["tokens"] == 2 * 8 for r in live) and result["live_ar"]["tokens"] == 16
    assert not (tmp_path / "g.png").exists()


def test_grid_rejects_two_traces_of_one_width(recorded):
    _, _, root = recorded
    with pytest.raises(ValueError, match="one trace per width"):
        grid_search([root / "train", root / "train"])


def _cell(depth: int, tokens_per_s: float, low: float) -> dict:
    return {"width": 4, "depth": depth, "size": 4 * depth, "tokens_per_s": tokens_per_s, "speedup": 1.0,
            "vs_baseline": {"baseline": "cell0", "ratio": 1.0, "ci": [low, low + 0.1]}}


@pytest.mark.parametrize("cells, picked", [
    ([_cell(0, 100, 1.0), _cell(1, 101, 0.97), _cell(2, 103, 0.99)], 0),   # within noise of plain: plain steps
    ([_cell(0, 100, 1.0), _cell(1, 104, 1.01), _cell(2, 110, 1.03)], 2),   # proven faster: the fastest proven
    ([_cell(0, 100, 1.0), _cell(1, 104, 1.01), _cell(2, 110, 0.95)], 1),   # the fastest point estimate is noise
    ([_cell(1, 90, float("nan")), _cell(2, 95, float("nan"))], 2),          # no plain cell measured: the fastest
])
def test_sampled_pick_speculates_only_where_it_measurably_pays(cells, picked):
    assert pick_sampled(cells)["depth"] == picked


def batched_synthetic_profile(tree: TreeConfig, batch_sizes=(1, 2, 4)) -> LatencyProfile:
    """synthetic_profile per batch size, verification growing with the B * (V + 1) tokens verified."""
    def at(b):
        first = {n: [1e-3 + 1e-4 * n] for n in range(1, tree.max_depth + 2)}
        levels = {level: [1.2e-3] for level in range(2, tree.max_depth + 1)}
        verify = [(v, c, 4e-3 + 6e-4 * b * (v + 1) + 1e-6 * c) for v in range(0, tree.max_size + 1) for c in (10, 40)]
        return LatencyProfile.from_samples(first, levels, verify, max_depth=tree.max_depth, width=tree.width)
    return synthetic_profile(tree).with_batch({b: at(b) for b in batch_sizes})


def test_grid_per_batch_size_is_the_batch_replay_best_and_loads_typed(recorded, tmp_path):
    from specpilot.artifacts.grid import GridResult
    from specpilot.envs.batch_replay import replay_batch
    from specpilot.envs.replay import ReplayModel
    from specpilot.policies import FixedController

    _, _, root = recorded
    profile = batched_synthetic_profile(TREE)
    out = tmp_path / "grid.json"
    result = grid_search(root / "train", depths=[0, 1, 2, 4], sizes=[1, 3, 6, 12], live_top=0,
                         batch_sizes=[4, 1, 2], batch_profile=profile, out=out, heatmap=False)
    per_batch = result["per_batch_size"]
    assert [r["batch_size"] for r in per_batch] == [1, 2, 4]
    model = ReplayModel(root / "train", profile)
    for row in per_batch:
        at_b = [r for r in result["batch_table"] if r["batch_size"] == row["batch_size"]]
        assert len(at_b) == 1 + 3 * 4  # batched AR + every drafting cell
        assert row["tokens_per_s"] == max(r["tokens_per_s"] for r in at_b)
        ar = replay_batch(model, FixedController(0, 0), batch_size=row["batch_size"])
        assert row["ar_tokens_per_s"] == pytest.approx(ar["tokens_per_s"])
        if row["depth"]:
            direct = replay_batch(model, FixedController(row["depth"], row["size"]), batch_size=row["batch_size"])
            assert row["speedup_vs_ar"] == pytest.approx(direct["tokens_per_s"] / ar["tokens_per_s"])
    loaded = GridResult.load(out)
    assert [(r["batch_size"], r["depth"], r["size"]) for r in loaded.per_batch_size] == \
        [(r["batch_size"], r["depth"], r["size"]) for r in per_batch]
    from specpilot.train.grid.search import summary_lines
    assert any(line.startswith("  B=4:") for line in summary_lines(result))
    # the eval method reads the table the grid wrote (no hand-written grid.json between them)
    from specpilot.eval.methods import grid_batch_table
    assert {b: (c["depth"], c["size"]) for b, c in grid_batch_table(out).items()} == \
        {r["batch_size"]: (r["depth"], r["size"]) for r in per_batch}


def test_grid_files_without_per_batch_size_still_load_and_bad_rows_are_refused(tmp_path):
    from specpilot.artifacts.grid import GridResult
    from specpilot.drafting.errors import InputFileError

    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"version": 1, "best": {"width": 2, "depth": 2, "size": 4}}))
    assert GridResult.load(path).per_batch_size == []
    for bad in ([{"batch_size": 2, "depth": 1, "size": 2}, {"batch_size": 1, "depth": 1, "size": 2}],
                [{"depth": 1, "size": 2}], {"1": {}}, [{"batch_size": 0, "depth": 1, "size": 2}]):
        path.write_text(json.dumps({"version": 1, "best": {"width": 2, "depth": 2, "size": 4},
                                    "per_batch_size": bad}))
        with pytest.raises(InputFileError, match="per_batch_size"):
            GridResult.load(path)


def test_grid_measures_the_batch_profile_with_the_pair_when_the_trace_lacks_it(recorded, tmp_path):
    pair, _, root = recorded
    out = tmp_path / "grid.json"
    result = grid_search(root / "train", depths=[0, 1, 2], sizes=[1, 3], pair=pair, live_top=0,
                         batch_sizes=[1, 2], batch_prompts=3, max_new_tokens=12, out=out, heatmap=False)
    assert [r["batch_size"] for r in result["per_batch_size"]] == [1, 2]
    assert LatencyProfile.load(tmp_path / "grid.profile_w3.json").batch_sizes == [1, 2]
    with pytest.raises(ValueError, match="give a pair to measure them"):
        grid_search(root / "train", depths=[1], sizes=[1], live_top=0, batch_sizes=[2], heatmap=False)


def test_grid_cli_batch_sizes_writes_per_batch_size(recorded, tmp_path, capsys):
    from specpilot.cli import main

    _, _, root = recorded
    profile = batched_synthetic_profile(TREE).save(tmp_path / "batch_profile.json")
    out = tmp_path / "grid.json"
    assert main(["grid", "--traces", str(root), "--out", str(out), "--live-top", "0", "--depths", "0,1,2",
                 "--sizes", "1,3", "--batch-sizes", "1,2,4", "--batch-profile", str(profile)]) == 0
    assert "  B=4: W=3" in capsys.readouterr().out
    assert [r["batch_size"] for r in json.loads(out.read_text())["per_batch_size"]] == [1, 2, 4]
    assert main(["grid", "--traces", str(root), "--out", str(out), "--live-top", "0", "--batch-sizes", "8",
                 "--batch-profile", str(profile)]) == 2
    assert "not up to 8" in capsys.readouterr().err


def test_grid_batch_live_recheck_writes_live_fields_and_guards_against_ar(recorded, tmp_path):
    """--batch-sizes with a live phase: the smallest and largest batch sizes' top cells are re-measured live with
    generate_batch against batched AR; those rows carry live fields (loaded typed) and never keep a cell whose
    live interval lies below batched AR."""
    from specpilot.artifacts.grid import GridResult
    from specpilot.train.grid.search import summary_lines

    pair, prompts, root = recorded
    out = tmp_path / "grid.json"
    result = grid_search(root / "train", depths=[0, 1, 2], sizes=[1, 3], pair=pair, val_prompts=prompts,
                         live_top=2, live_max_new_tokens=8, batch_sizes=[1, 2, 4],
                         batch_profile=batched_synthetic_profile(TREE, (1, 2, 4)), out=out, heatmap=False)
    rows = {r["batch_size"]: r for r in result["per_batch_size"]}
    assert rows[2].get("source") == "replay" and "live_tokens_per_s" not in rows[2]
    for b in (1, 4):
        row = rows[b]
        assert row["source"] == "live" and row["live_cells"] == 2 and row["live_tokens_per_s"] > 0
        assert len(row["live_speedup_ci"]) == 2
        high = row["live_speedup_ci"][1]
        assert row["depth"] == 0 or (row["live_speedup_vs_ar"] > 1.0 and (high is None or high >= 1.0))
    assert {r["batch_size"] for r in result["batch_live"]} == {1, 4}
    loaded = GridResult.load(out).per_batch_size
    assert [isinstance(r.get("live_speedup_vs_ar"), float) for r in loaded] == [True, False, True]
    assert any("batched AR [" in line for line in summary_lines(result))


@pytest.mark.parametrize("ci,point,kept", [([0.80, 0.95], 0.9, False), ([0.9, 1.1], 1.02, True),
                                           ([0.8, 1.1], 0.97, False), ([None, None], 0.97, False),
                                           ([1.05, 1.3], 1.2, True)])
def test_pick_batch_live_never_keeps_a_cell_slower_than_ar(ci, point, kept):
    from specpilot.train.grid.search import pick_batch_live

    cells = [{"depth": 2, "size": 3, "live_tokens_per_s": 100 * point, "live_speedup_vs_ar": point,
              "live_speedup_ci": ci},
             {"depth": 1, "size": 1, "live_tokens_per_s": 50.0, "live_speedup_vs_ar": 0.5, "live_speedup_ci": ci}]
    chosen = pick_batch_live(cells)
    assert (chosen is cells[0]) if kept else chosen is None


@pytest.mark.parametrize("change, fragment", [
    ({"prompts": 2}, "were recorded with different prompts"),
    ({"max_new_tokens": 8}, "were recorded with different token budgets (16 vs 8)"),
])
def test_grid_refuses_widths_recorded_on_different_workloads(recorded, tmp_path, change, fragment):
    """The best cell of a multi-width grid is picked across the widths' tables: all must replay one workload."""
    pair, prompts, root = recorded
    other = TreeConfig(width=TREE.width + 1, max_depth=TREE.max_depth, max_size=TREE.max_size)
    trace = record_trace(pair, other, prompts[:change.get("prompts", len(prompts))],
                         max_new_tokens=change.get("max_new_tokens", 16))
    trace.save(tmp_path / "w")
    synthetic_profile(other).save(tmp_path / "w" / "profile.json")
    with pytest.raises(ValueError, match=re.escape(fragment)):
        grid_search([root / "train", tmp_path / "w"])
    same = record_trace(pair, other, prompts, max_new_tokens=16)
    same.save(tmp_path / "same")
    synthetic_profile(other).save(tmp_path / "same" / "profile.json")
    assert {r["width"] for r in grid_search([root / "train", tmp_path / "same"])["table"]} == {TREE.width,
                                                                                             TREE.width + 1}
