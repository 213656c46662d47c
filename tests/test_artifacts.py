"""Run artifacts (`specpilot.artifacts`) and run contracts: typed files round-trip, broken / newer files are named in
the error, older files without `format_version` still load; every kind of contract mismatch is refused in one line
naming both sides; a later stage refuses an interrupted earlier one unless `allow_partial`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpilot.artifacts.contract import (ContractError, RunContract, check_grid, check_stage_finished,
                                          record_contract)
from specpilot.artifacts.decoder import ExportedConfigError, read_decoder_config, write_decoder_config
from specpilot.artifacts.grid import GridResult, save_grid
from specpilot.artifacts.policies import PoliciesIndex, PolicyEntry
from specpilot.artifacts.run import RunManifest, read_best, read_progress
from specpilot.artifacts.trace import TraceHeader, read_ar
from specpilot.cli import main
from specpilot.drafting.errors import InputFileError, is_user_error, one_line

EAGLE = {"name": "specpilot-default", "drafter": "eagle3", "target_hash": "t" * 16, "draft_hash": "e" * 16}
DRAFT_LM = {"name": "specpilot-default+draft", "drafter": "draft", "target_hash": "t" * 16, "draft_hash": "d" * 16}
SPEC = {"kind": "depth", "width": 4, "max_depth": 6}


def _header(pair: dict = EAGLE, width: int = 4, max_depth: int = 6) -> dict:
    return {"version": 1, "pair": pair, "dtype": "torch.float32", "device": "cpu",
            "tree": {"width": width, "max_depth": max_depth, "max_size": 16}, "max_new_tokens": 8,
            "prompts": [{"text": "a", "num_tokens": 3}]}


def _trace(folder: Path, **kwargs) -> Path:
    """A trace folder as far as the contract reads it: trace.json (+ an empty trace.npz so it is found)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trace.json").write_text(json.dumps(_header(**kwargs)))
    (folder / "trace.npz").write_bytes(b"")
    return folder


def _grid(pair: dict = EAGLE, width: int = 4) -> dict:
    return {"best": {"width": width, "depth": 3, "size": 8, "source": "replay"},
            "best_drafting": {"width": width, "depth": 3, "size": 8},
            "best_by_temperature": {"0.7": {"width": width, "depth": 2, "size": 4}},
            "meta": {"traces": [{"trace": "t", "width": width, "max_depth": 6, "pair": pair}], "pair": None}}


# ---- round trips -----------------------------------------------------------------------------------------------------

def test_grid_round_trip_and_views(tmp_path):
    path = save_grid(tmp_path / "grid.json", _grid())
    grid = GridResult.load(path)
    assert json.loads(path.read_text())["format_version"] == 1
    assert grid.static_cell()["depth"] == 3 and grid.at_temperature(0.7)["size"] == 4
    assert grid.widths == [4] and grid.trace_pairs() == [EAGLE]
    grid.save(tmp_path / "again.json")
    assert GridResult.load(tmp_path / "again.json").best == grid.best


def test_policies_index_round_trip(tmp_path):
    index = PoliciesIndex(PolicyEntry("d/best.zip", SPEC), PolicyEntry("s/best.zip", {**SPEC, "kind": "size"}, [4, 8]),
                          {"depth": 3, "size": 8})
    index.save(tmp_path)
    back = PoliciesIndex.load(tmp_path)
    assert back.depth == index.depth and back.size == index.size and back.fallback == index.fallback
    assert back.tree() == {"width": 4, "max_depth": 6, "max_size": 8, "policies": ["depth", "size"]}
    assert back.resolve("size") == tmp_path / "s/best.zip"


def test_manifest_update_merges_sections_and_reads_stages(tmp_path):
    RunManifest.update(tmp_path, stages={"size_s1": {"status": "running", "timesteps_done": 0}})
    RunManifest.update(tmp_path, stages={"size_s1": {"status": "interrupted", "timesteps_done": 64,
                                                     "settings": {"total_timesteps": 256}}}, seeds={"size_s1": 1})
    manifest = RunManifest.load(tmp_path)
    stage = manifest.stage("size_s1")
    assert (stage.status, stage.timesteps_done, stage.total_timesteps, stage.finished) == ("interrupted", 64, 256,
                                                                                           False)
    assert manifest.data["format_version"] == 1 and manifest.data["seeds"] == {"size_s1": 1}


def test_trace_header_and_decoder_config_round_trip(tmp_path):
    header = TraceHeader.load(_trace(tmp_path / "tr", width=2))
    assert header.tree == {"width": 2, "max_depth": 6, "max_size": 16} and header.pair == EAGLE
    write_decoder_config(tmp_path / "exp", {"tree": {"width": 4}, "pair": EAGLE})
    meta = read_decoder_config(tmp_path / "exp")
    assert meta["pair"] == EAGLE and meta["_path"].endswith("decoder.json")


def test_files_written_before_versioning_still_load(tmp_path):
    """Existing runs (no format_version anywhere) read as they are."""
    (tmp_path / "grid.json").write_text(json.dumps(_grid()))
    (tmp_path / "policies.json").write_text(json.dumps({"depth": {"path": "x.zip", "spec": SPEC}, "size": None,
                                                        "fallback": {"depth": 3, "size": 8}}))
    (tmp_path / "manifest.json").write_text(json.dumps({"traces": {"train_pair": DRAFT_LM}}))
    assert GridResult.load(tmp_path / "grid.json").best["size"] == 8
    assert PoliciesIndex.load(tmp_path).depth.path == "x.zip"
    assert RunContract.of_run(tmp_path).pair == DRAFT_LM  # an older run: its traces' pair


# ---- broken, newer and older files -------------------------------------------------------------------------------------

LOADERS = {
    "grid.json": lambda p: GridResult.load(p),
    "policies.json": lambda p: PoliciesIndex.load(p),
    "manifest.json": lambda p: RunManifest.load(p.parent),
    "trace.json": lambda p: TraceHeader.load(p.parent),
    "ar.json": lambda p: read_ar(p.parent),
    "progress.json": lambda p: read_progress(p.parent.parent),
}


@pytest.mark.parametrize("name", list(LOADERS))
@pytest.mark.parametrize("content", ['{"best": {"depth": 3', "\xff\xfe\x00", "[1, 2]"])
def test_broken_files_are_named(tmp_path, name, content):
    path = tmp_path / ("stage/checkpoints" if name == "progress.json" else "") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content, encoding="latin-1")
    with pytest.raises(InputFileError) as info:
        LOADERS[name](path)
    assert str(path) in str(info.value) and is_user_error(info.value)


@pytest.mark.parametrize("name", ["grid.json", "policies.json", "manifest.json"])
def test_newer_format_version_is_refused(tmp_path, name):
    data = {"grid.json": _grid(), "policies.json": {"depth": None, "size": None}, "manifest.json": {}}[name]
    (tmp_path / name).write_text(json.dumps({**data, "format_version": 99}))
    with pytest.raises(InputFileError, match="newer than this specpilot"):
        LOADERS[name](tmp_path / name)


def test_broken_best_json_is_advisory_and_decoder_json_is_named(tmp_path):
    (tmp_path / "best.json").write_text("{trunc")
    assert read_best(tmp_path) is None
    (tmp_path / "decoder.json").write_text("{not json")
    with pytest.raises(ExportedConfigError, match="decoder.json is not valid JSON"):
        read_decoder_config(tmp_path)


# ---- contract mismatches: one per kind -------------------------------------------------------------------------------------

def _run_with_contract(run: Path, pair: dict = EAGLE, width: int = 4) -> Path:
    header = TraceHeader.load(_trace(run / "traces" / "train", pair=pair, width=width))
    record_contract(run, RunContract.from_traces(header, header), given="traces", fix="fix")
    return run


def _refused(call) -> str:
    with pytest.raises(ContractError) as info:
        call()
    assert is_user_error(info.value) and isinstance(info.value, ValueError)
    return one_line(info.value)


def test_contract_is_recorded_once_and_refuses_another_pair(tmp_path):
    run = _run_with_contract(tmp_path / "run")
    assert RunContract.of_run(run).pair == EAGLE and RunContract.of_run(run).tree["width"] == 4
    other = TraceHeader.load(_trace(tmp_path / "other", pair=DRAFT_LM))
    msg = _refused(lambda: record_contract(run, RunContract.from_traces(other), given="traces other", fix="x"))
    assert "draft drafter" in msg and "eagle3 drafter" in msg  # both sides named


@pytest.mark.parametrize("damage,fragment", [
    (lambda m: m.update(contract="x"), "its 'contract' section is a str, not a mapping"),
    (lambda m: m.update(stages=[]), "its 'stages' section is a list, not a mapping"),
    (lambda m: m["contract"].update(dtype=5), "dtype is 5 (int), not a dtype name"),
    (lambda m: m["contract"]["tree"].update(width="4"), "tree.width is '4', not an integer"),
    (lambda m: m["contract"].update(size_actions="2,4"), "size_actions is '2,4', not a list of integers"),
    (lambda m: m["contract"].update(pair=[1]), "pair is [1] (list), not a mapping"),
])
def test_a_damaged_manifest_section_or_contract_is_named_not_skipped(tmp_path, damage, fragment):
    """Read as empty, a damaged contract would skip every check of the run (and a number as its dtype travelled
    into the export): refused naming the file."""
    run = _run_with_contract(tmp_path / "run")
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    damage(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(InputFileError) as info:
        manifest = RunManifest.load(run)
        RunContract.of_run(manifest)
        manifest.stages
    assert str(path) in one_line(info.value) and fragment in one_line(info.value) and is_user_error(info.value)


def test_contract_refuses_another_tree(tmp_path):
    run = _run_with_contract(tmp_path / "run")
    w2 = TraceHeader.load(_trace(tmp_path / "w2", width=2))
    msg = _refused(lambda: record_contract(run, RunContract.from_traces(w2), given="traces w2", fix="x"))
    assert "W=2" in msg and "W=4" in msg


@pytest.mark.parametrize("grid, fragment", [
    (_grid(pair=DRAFT_LM), "draft drafter"),  # searched on another pair
    (_grid(width=2), "W=2"),                   # searched on another tree
])
def test_contract_refuses_a_grid_of_another_pair_or_tree(tmp_path, grid, fragment):
    contract = RunContract(pair=EAGLE, tree={"width": 4, "max_depth": 6, "max_size": 16})
    msg = _refused(lambda: check_grid(GridResult.from_dict(grid), contract, grid_from="grid g", run="run r",
                                      fix="x"))
    assert fragment in msg and "grid g" in msg and "run r" in msg


def test_train_stage_refuses_traces_or_grid_not_of_the_run(tmp_path):
    from specpilot.train.rl.stages import _record_contract
    from specpilot.train.rl.traces import TaskTraces

    run = _run_with_contract(tmp_path / "run")
    other = TaskTraces(_trace(tmp_path / "o" / "train", pair=DRAFT_LM), _trace(tmp_path / "o" / "validation",
                                                                              pair=DRAFT_LM))
    _refused(lambda: _record_contract(run, other, None, None))
    own = TaskTraces(run / "traces" / "train", _trace(run / "traces" / "validation"))
    save_grid(tmp_path / "w2.json", _grid(width=2))
    assert "W=2" in _refused(lambda: _record_contract(run, own, None, tmp_path / "w2.json"))
    _record_contract(run, own, [4, 8], None)  # its own traces: accepted, size actions recorded
    assert RunContract.of_run(run).size_actions == [4, 8]


class _Pair:
    def __init__(self, identity: dict) -> None:
        self.name, self._identity = identity["name"], identity

    def identity(self) -> dict:
        return self._identity


def test_eval_refuses_a_run_or_grid_of_another_pair(tmp_path):
    from specpilot.eval.inputs import check_inputs_pair

    run = _run_with_contract(tmp_path / "run", pair=DRAFT_LM)
    msg = _refused(lambda: check_inputs_pair(_Pair(EAGLE).identity(), run_dir=run))
    assert str(run) in msg and "eagle3 drafter" in msg and "draft drafter" in msg
    save_grid(tmp_path / "grid.json", _grid(pair=DRAFT_LM))
    _refused(lambda: check_inputs_pair(_Pair(EAGLE).identity(), grid=tmp_path / "grid.json"))
    check_inputs_pair(_Pair(DRAFT_LM).identity(), run_dir=run, grid=tmp_path / "grid.json")  # the run's own pair


@pytest.mark.parametrize("trace_kwargs, fragment", [({"pair": DRAFT_LM}, "draft drafter"), ({"width": 2}, "W=2")])
def test_export_refuses_a_trace_of_another_pair_or_tree(tmp_path, trace_kwargs, fragment):
    from specpilot.train.export.writer import _check_contract

    run = _run_with_contract(tmp_path / "run")
    PoliciesIndex(PolicyEntry("d.zip", SPEC)).save(run)
    trace = _trace(tmp_path / "t", **trace_kwargs)
    msg = _refused(lambda: _check_contract(run, PoliciesIndex.load(run), None, trace, True))
    assert fragment in msg and str(trace) in msg
    _check_contract(run, PoliciesIndex.load(run), None, run / "traces" / "train", False)  # its own trace
    assert "eagle3" in _refused(lambda: _check_contract(run, PoliciesIndex.load(run), _Pair(DRAFT_LM), None, False))


# ---- unfinished stages -------------------------------------------------------------------------------------------------------

def _interrupted_run(run: Path) -> Path:
    from specpilot.policies.observation import ObservationSpec

    _run_with_contract(run)
    _trace(run / "traces" / "validation")
    specs = {"size": ObservationSpec.for_size(4, 6, size_actions=[4, 8]), "depth": ObservationSpec.for_depth(4, 6)}
    for stage, kind, status in (("size_s1", "size", "interrupted"), ("depth_s1", "depth", "done")):
        (run / stage).mkdir(parents=True)
        (run / stage / "best.zip").write_bytes(b"zip")
        RunManifest.update(run, stage_setup={stage: {"kind": kind, "spec": specs[kind].to_dict(),
                                                     "size_actions": [4, 8] if kind == "size" else None}},
                           stages={stage: {"status": status, "timesteps_done": 64,
                                           "settings": {"total_timesteps": 256}}})
    return run


def test_a_later_stage_refuses_an_interrupted_one_unless_allowed(tmp_path):
    from specpilot.train.rl.stages import stage_result

    run = _interrupted_run(tmp_path / "run")
    msg = _refused(lambda: stage_result(run, "size_s1"))
    assert "interrupted (64/256 steps)" in msg and "--allow-partial" in msg
    check_stage_finished(run, "depth_s1")
    check_stage_finished(run, "size_s1", allow_partial=True)
    assert stage_result(run, "size_s1", allow_partial=True).size_actions == [4, 8]


def test_train_coadapt_after_an_interrupted_stage_is_one_line_exit_2(tmp_path, capsys):
    run = _interrupted_run(tmp_path / "run")
    code = main(["--threads", "1", "train", "coadapt", "--run", str(run), "--steps", "64", "--static", "3,8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "size_s1" in err[0] and "--allow-partial" in err[0]


def test_export_refuses_a_grid_of_another_tree(tmp_path):
    from specpilot.train.export.writer import _check_contract

    run = _run_with_contract(tmp_path / "run")
    PoliciesIndex(PolicyEntry("d.zip", SPEC)).save(run)
    save_grid(tmp_path / "w2.json", _grid(width=2))
    grid = str(tmp_path / "w2.json")
    msg = _refused(lambda: _check_contract(run, PoliciesIndex.load(run), None, None, False, grid=grid))
    assert "W=2" in msg and "w2.json" in msg
