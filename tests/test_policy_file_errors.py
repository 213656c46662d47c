"""Damaged or hand-edited policy files give one clear error naming the file, never a traceback or a silent value:

- an SB3 policy zip that is truncated, lacks a member, is empty or garbage: PolicyLoadError naming the zip, from
  every loader (run controllers, export, --init-from);
- --init-from with a policy of the other kind (or of another tree): refused before the run folder is touched,
  naming both shapes;
- policies.json / decoder.json values outside the policies' tree (size actions, fallback depth / size) and a
  decoder.json policy entry without its sha256: refused naming the file, the field, the value and the limit.
"""
from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
from test_bad_options import TINY_PPO, run  # noqa: F401 (module-scoped fixture: traces W=3, depth 4, max_size 8)
from test_cli_errors import assert_one_line, run_cli
from test_export import MAX_DEPTH, SIZE_ACTIONS, WIDTH, SpaceEnv, _edit_json, _truncate, make_policy, write_run
from tiny import tiny_pair

from specpilot.artifacts.policies import PoliciesIndex
from specpilot.drafting.errors import InputFileError, is_user_error, one_line
from specpilot.eval.inputs import run_tree
from specpilot.policies.exported import ExportedConfigError, file_sha256, load_exported
from specpilot.policies.observation import ObservationSpec
from specpilot.policies.ppo import PolicyLoadError, load_run_controllers, load_sb3_model, load_sb3_policy
from specpilot.train.export.writer import ExportError, export_run
from specpilot.train.rl.ppo import settings_for, train_policy, write_policies_index

TRACE_W, TRACE_D, TRACE_SIZES = 3, 4, [3, 4, 5, 7, 8]  # test_bad_options' traces; its CPU size actions that fit 8


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, pair):
    """test_export's run: depth + size policies (W=2, depth 5, size actions 1..8), fallback (3, 4)."""
    return write_run(tmp_path_factory.mktemp("policy_errors") / "run", pair)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, run_dir, pair):
    out = tmp_path_factory.mktemp("policy_errors_export") / "export"
    export_run(run_dir, out, pair=pair, num_prompts=1, max_new_tokens=8, num_random=200, log=lambda *a: None)
    return out


def _copy(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / folder.name
    shutil.copytree(folder, dst)
    return dst


# ---------------------------------------------------------------------------------------------------------------
# damaged SB3 zips




def _drop_member(name: str):
    def drop(path: Path) -> None:  # as `zip -d best.zip NAME`
        with zipfile.ZipFile(path) as src:
            members = {info: src.read(info) for info in src.infolist() if info.filename != name}
        with zipfile.ZipFile(path, "w") as dst:
            for info, data in members.items():
                dst.writestr(info, data)
    return drop


def _garble_data(path: Path) -> None:
    """A whole zip whose "data" member (SB3's JSON settings) is not JSON."""
    with zipfile.ZipFile(path) as src:
        members = {info: src.read(info) for info in src.infolist()}
    with zipfile.ZipFile(path, "w") as dst:
        for info, data in members.items():
            dst.writestr(info, b"{not json" if info.filename == "data" else data)


def _garble_tail(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


ZIP_DAMAGE = {
    "truncated": (_truncate, "is not a whole SB3 PPO zip"),
    "no data member": (_drop_member("data"), "lacks its 'data' member"),
    "no policy member": (_drop_member("policy.pth"), "lacks its 'policy.pth' member"),
    "data not JSON": (_garble_data, "corrupted or not an SB3 PPO zip"),
    "garbled tail": (_garble_tail, "corrupted or not an SB3 PPO zip"),
    "empty": (lambda p: p.write_bytes(b""), "corrupted or not an SB3 PPO zip"),
    "text": (lambda p: p.write_text("not a zip\n"), "corrupted or not an SB3 PPO zip"),
}


@pytest.mark.parametrize("damage", list(ZIP_DAMAGE))
def test_a_damaged_policy_zip_is_a_policy_load_error_naming_it(run_dir, tmp_path, damage):
    run = _copy(run_dir, tmp_path)
    zip_path = run / "size_s0" / "best.zip"
    breaker, message = ZIP_DAMAGE[damage]
    breaker(zip_path)
    for load in (load_sb3_model, load_sb3_policy, load_run_controllers):
        with pytest.raises(PolicyLoadError, match=message) as info:
            load(zip_path if load is not load_run_controllers else run)
        text = one_line(info.value)
        assert str(zip_path) in text and "retrain the stage that wrote it, or restore the file" in text
        assert is_user_error(info.value)  # the command line prints one line, exit 2


@pytest.mark.parametrize("damage", ["truncated", "no data member"])
def test_export_of_a_run_with_a_damaged_zip_fails_cleanly_and_writes_nothing(run_dir, pair, tmp_path, damage):
    run = _copy(run_dir, tmp_path)
    ZIP_DAMAGE[damage][0](run / "depth_s0" / "best.zip")
    out = tmp_path / "export"
    with pytest.raises(ExportError, match="depth_s0/best.zip is not a whole SB3 PPO zip") as info:
        export_run(run, out, pair=pair, num_prompts=1, max_new_tokens=8, num_random=200, log=lambda *a: None)
    assert is_user_error(info.value)
    assert not out.exists() and not list(tmp_path.glob(".export*"))


# ---------------------------------------------------------------------------------------------------------------
# --init-from: the policy must fit the stage


def _trace_policy(path: Path, kind: str, *, width: int = TRACE_W, sizes: list[int] = TRACE_SIZES) -> Path:
    """A policy zip of `kind` for test_bad_options' trace tree (or another width / size actions)."""
    spec = (ObservationSpec.for_size(width, TRACE_D, sizes) if kind == "size"
            else ObservationSpec.for_depth(width, TRACE_D))
    path.parent.mkdir(parents=True, exist_ok=True)
    make_policy(spec, len(sizes) if kind == "size" else 2, [16], seed=0).save(path)
    return path


INIT_MISMATCH = {
    "depth policy for a size stage": ("size", lambda d: _trace_policy(d / "depth.zip", "depth"),
                                      ["it is a depth policy (2 actions", "trains a size policy (5 actions",
                                       "start from a size policy"]),
    "size policy for a depth stage": ("depth", lambda d: _trace_policy(d / "size.zip", "size"),
                                      ["it is a size policy (5 actions", "trains a depth policy (2 actions",
                                       "start from a depth policy"]),
    "size policy of another tree": ("size", lambda d: _trace_policy(d / "w2.zip", "size", width=2, sizes=[2, 4, 8]),
                                    ["it is a size policy (3 actions", "trains a size policy (5 actions",
                                     "width 3, max_depth 4", "another tree"]),
    "truncated zip": ("size", lambda d: (_truncate(p := _trace_policy(d / "cut.zip", "size")), p)[1],
                      ["cut.zip", "SB3 PPO zip", "restore the file"]),
}


@pytest.mark.parametrize("case", list(INIT_MISMATCH))
def test_init_from_a_policy_that_does_not_fit_is_refused_before_any_work(run, tmp_path, capsys, case):  # noqa: F811
    stage, make, fragments = INIT_MISMATCH[case]
    init = make(tmp_path / "policies")
    run_dir = tmp_path / "r"
    code, err = run_cli(["train", stage, "--run", str(run_dir), "--traces", str(run / "traces"), "--steps", "64",
                         *TINY_PPO, "--stage", "s6", "--init-from", str(init)], capsys)
    assert_one_line(code, err, f"specpilot train {stage}:", *fragments)
    assert not run_dir.exists()  # no stage folder, manifest or TensorBoard log


def test_init_from_a_policy_that_fits_trains(run, tmp_path, capsys):  # noqa: F811
    init = _trace_policy(tmp_path / "size.zip", "size")
    run_dir = tmp_path / "r"
    code, err = run_cli(["train", "size", "--run", str(run_dir), "--traces", str(run / "traces"), "--steps", "64",
                         *TINY_PPO, "--stage", "s6", "--init-from", str(init)], capsys)
    assert code == 0, err
    assert (run_dir / "s6" / "best.zip").is_file()


@pytest.mark.parametrize("init_kind", ["depth", "truncated"])
def test_train_policy_called_directly_refuses_weights_that_do_not_load(tmp_path, init_kind):
    """Library callers that skip train_stage's check still get a PolicyLoadError naming the zip, and no stage
    folder."""
    spec = ObservationSpec.for_size(TRACE_W, TRACE_D, TRACE_SIZES)
    init = _trace_policy(tmp_path / "init.zip", "depth" if init_kind == "depth" else "size")
    if init_kind == "truncated":
        _truncate(init)
    settings = settings_for("size", total_timesteps=16, n_steps=16, batch_size=16, n_epochs=1, pi_arch=[16],
                            vf_arch=[32])
    with pytest.raises(PolicyLoadError, match="init.zip"):
        train_policy(lambda: SpaceEnv(spec, len(TRACE_SIZES)), None, settings, tmp_path / "r", "s6",
                     init_from=init)
    assert not (tmp_path / "r" / "s6").exists()


# ---------------------------------------------------------------------------------------------------------------
# policies.json values outside the policies' tree (width 2, max_depth 5, size actions 1..8)


POLICIES_EDITS = {
    "fallback depth": (lambda d: d["fallback"].update(depth=99), ["fallback.depth", "0..5", "got 99", "max_depth 5"]),
    "fallback size": (lambda d: d["fallback"].update(size=1000), ["fallback.size", "1..18", "got 1000",
                                                                   "depth-5 tree drafts 18 candidates"]),
    "fallback not an integer": (lambda d: d["fallback"].update(size="big"), ["fallback.size", "'big'"]),
    "size action": (lambda d: d["size"].update(size_actions=[1, 2, 4, 6, 800]),
                    ["size.size_actions", "1..8", "got 800", "num_scores"]),
    "size action zero": (lambda d: d["size"].update(size_actions=[0, 2, 4, 6, 8]), ["size.size_actions", "got 0"]),
}


@pytest.mark.parametrize("edit", list(POLICIES_EDITS))
def test_policies_json_values_outside_the_tree_are_refused(run_dir, tmp_path, edit):
    run = _copy(run_dir, tmp_path)
    fn, fragments = POLICIES_EDITS[edit]
    _edit_json(run / "policies.json", fn)
    for load, error in ((PoliciesIndex.load, InputFileError), (load_run_controllers, PolicyLoadError),
                        (run_tree, InputFileError)):  # what `specpilot eval --run` reads first
        with pytest.raises(error) as info:
            load(run)
        text = one_line(info.value)
        assert str(run / "policies.json") in text and all(f in text for f in fragments), text
        assert is_user_error(info.value)


@pytest.mark.parametrize("fallback", [(0, 0), (0, 8), (5, 1), (3, 8)])
def test_policies_json_values_inside_the_tree_load(run_dir, tmp_path, fallback):
    run = _copy(run_dir, tmp_path)
    _edit_json(run / "policies.json", lambda d: d["fallback"].update(depth=fallback[0], size=fallback[1]))
    controllers = load_run_controllers(run)
    assert controllers["depth_only"].fallback.describe()["size"] == fallback[1]


def test_a_fallback_beyond_the_tree_is_recorded_as_the_tree_runs_it(run_dir, tmp_path):
    """The built-in static config (4, 12) on a small trace without a grid result: the decoder caps it at the tree,
    so policies.json records the capped value and stays loadable."""
    index = PoliciesIndex.load(run_dir)
    out = tmp_path / "run"
    out.mkdir()
    depth_spec, size_spec = (ObservationSpec.from_dict(index.depth.spec), ObservationSpec.from_dict(index.size.spec))
    write_policies_index(out, run_dir / index.depth.path, run_dir / index.size.path, depth_spec=depth_spec,
                         size_spec=size_spec, size_actions=SIZE_ACTIONS, fallback_depth=9, fallback_size=12)
    assert PoliciesIndex.load(out).fallback == {"depth": MAX_DEPTH, "size": 12}  # (the decoder clips the size)
    assert set(load_run_controllers(out)) >= {"ltd", "depth_only", "size_only"}


# ---------------------------------------------------------------------------------------------------------------
# decoder.json values outside its tree section, and incomplete policy entries


DECODER_EDITS = {
    "size action": (lambda m: m["policies"]["size"].update(actions=[1, 2, 4, 6, 800]),
                    ["policies.size.actions", "1..8", "got 800", "max_size is 8"]),
    "fallback depth": (lambda m: m["policies"]["fallback"].update(depth=99),
                       ["policies.fallback.depth", "0..5", "got 99", "max_depth is 5"]),
    "fallback size": (lambda m: m["policies"]["fallback"].update(size=1000),
                      ["policies.fallback.size", "1..8", "got 1000", "max_size is 8"]),
    "tree size actions": (lambda m: m["tree"].update(size_actions=[1000]),
                          ["tree.size_actions", "1..8", "got 1000"]),
    "tree size actions differ": (lambda m: m["tree"].update(size_actions=[2, 4]),
                                 ["tree.size_actions [2, 4] differs from policies.size.actions [1, 2, 4, 6, 8]"]),
    "depth sha256 missing": (lambda m: m["policies"]["depth"].pop("sha256"),
                             ["(depth policy)", "lacks 'sha256'", "incomplete"]),
    "size sha256 empty": (lambda m: m["policies"]["size"].update(sha256=""),
                          ["(size policy)", "lacks 'sha256'", "incomplete"]),
    "layers missing": (lambda m: m["policies"]["size"].pop("layers"), ["(size policy)", "lacks 'layers'"]),
    "policies a string": (lambda m: m.update(policies="x"), ["'policies' is a str, not a mapping"]),
    "depth entry a string": (lambda m: m["policies"].update(depth="x"), ["policies.depth is a str, not a mapping"]),
    "fallback a list": (lambda m: m["policies"].update(fallback=[1]), ["policies.fallback is a list, not a mapping"]),
    "spec a string": (lambda m: m["policies"]["depth"].update(spec="x"),
                      ["(depth policy)", "an observation spec is a mapping of its fields, got str"]),
}


@pytest.mark.parametrize("edit", list(DECODER_EDITS))
def test_decoder_json_values_outside_the_tree_and_incomplete_entries_are_refused(export_dir, tmp_path, edit):
    d = _copy(export_dir, tmp_path)
    fn, fragments = DECODER_EDITS[edit]
    _edit_json(d / "decoder.json", fn)
    with pytest.raises(ExportedConfigError) as info:
        load_exported(d, load_pair=False)
    text = one_line(info.value)
    assert str(d / "decoder.json") in text and all(f in text for f in fragments), text
    assert is_user_error(info.value)


def test_generate_cli_refuses_an_edited_decoder_json_in_one_line(export_dir, tmp_path, capsys):
    d = _copy(export_dir, tmp_path)
    _edit_json(d / "decoder.json", DECODER_EDITS["size action"][0])
    code, err = run_cli(["generate", "--config", str(d), "--prompt", "x", "--max-new-tokens", "8"], capsys)
    assert_one_line(code, err, "specpilot generate:", "policies.size.actions", "got 800", "1..8")


def test_unreadable_weights_with_a_matching_sha256_still_fail_clearly(export_dir, tmp_path):
    """The safetensors parse error path, now that a missing sha256 is refused first: truncated weights whose
    recorded sha256 was updated to match."""
    d = _copy(export_dir, tmp_path)
    weights = d / "depth.safetensors"
    _truncate(weights)
    _edit_json(d / "decoder.json", lambda m: m["policies"]["depth"].update(sha256=file_sha256(weights)))
    with pytest.raises(ExportedConfigError, match="depth.safetensors is not a readable safetensors"):
        load_exported(d, load_pair=False)


def test_an_untouched_export_loads(export_dir):
    controller, tree, _ = load_exported(export_dir, load_pair=False)
    assert (tree.width, tree.max_depth, tree.max_size) == (WIDTH, MAX_DEPTH, max(SIZE_ACTIONS))
    assert controller.size_actions == SIZE_ACTIONS
