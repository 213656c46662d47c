"""Resuming `specpilot record` finds its finished shards by what they hold (the models' content hashes, dtype, tree,
prompts, budget and settings), not by how the model paths were written: the same pair given by absolute path, by
relative path or as a byte-identical copy elsewhere resumes; another pair or budget is refused, naming what differs."""
from __future__ import annotations

import json
import shutil

import pytest

from specpilot.cli import main
from specpilot.drafting.errors import InputFileError
from specpilot.envs import shards as sh

SETTINGS = ["--suite", "train", "--limit", "2", "--max-new-tokens", "8", "--profile-cycles", "0", "--width", "2",
            "--max-depth", "4", "--max-size", "6"]


def _record(target, draft, out, *extra) -> int:
    return main(["record", *SETTINGS, "--out", str(out), "--target", str(target), "--draft", str(draft), *extra])


@pytest.fixture(scope="module")
def recorded(saved_pair, tmp_path_factory):
    """rp2/: a finished recording of saved_pair given by absolute paths, and the pair's folder."""
    root = tmp_path_factory.mktemp("resume")
    out = root / "rp2"
    assert _record((saved_pair / "target").resolve(), (saved_pair / "draft").resolve(), out) == 0
    return out, saved_pair.resolve()


@pytest.fixture(scope="module")
def other_pair(saved_pair, tmp_path_factory):
    """The same target with another draft (other weights, same vocabulary)."""
    from transformers import AutoModelForCausalLM

    from tiny import noisy_copy

    root = tmp_path_factory.mktemp("other")
    shutil.copytree(saved_pair / "target", root / "target")
    draft = noisy_copy(AutoModelForCausalLM.from_pretrained(str(saved_pair / "draft")), 0.3, seed=7)
    draft.save_pretrained(root / "draft")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (saved_pair / "draft" / name).exists():
            shutil.copy(saved_pair / "draft" / name, root / "draft" / name)
    return root


def _how(how, pair, tmp_path, monkeypatch):
    """(target, draft) of `pair` written the way `how` says."""
    if how == "absolute":
        return pair / "target", pair / "draft"
    if how == "relative":
        monkeypatch.chdir(pair.parent)
        return f"{pair.name}/target", f"{pair.name}/draft"
    copy = tmp_path / "elsewhere"  # byte-identical, under other folder names (the pair's name changes too)
    shutil.copytree(pair / "target", copy / "tgt-copy")
    shutil.copytree(pair / "draft", copy / "drf-copy")
    return copy / "tgt-copy", copy / "drf-copy"


@pytest.mark.parametrize("how", ["absolute", "relative", "copy"])
def test_the_same_pair_resumes_every_finished_shard(recorded, how, tmp_path, monkeypatch):
    out, pair = recorded
    target, draft = _how(how, pair, tmp_path, monkeypatch)
    assert _record(target, draft, out) == 0
    cluster = json.loads((out / sh.CLUSTER_FILE).read_text())
    assert len(cluster["shards"]) >= 2
    assert cluster["resumed_shards"] == list(range(len(cluster["shards"])))


@pytest.mark.parametrize("change, field", [("draft", "draft_hash"), ("max-new-tokens", "max_new_tokens")])
def test_another_recording_is_refused_naming_what_differs(recorded, other_pair, change, field, capsys):
    out, pair = recorded
    before = {p: p.read_bytes() for p in (out / sh.SHARDS_DIR).rglob(sh.DONE_FILE)}
    capsys.readouterr()
    if change == "draft":
        code = _record(pair / "target", other_pair / "draft", out)
    else:
        code = _record(pair / "target", pair / "draft", out, "--max-new-tokens", "9")
    err = capsys.readouterr().err
    assert code == 2
    assert "another recording" in err and field in err and "delete" not in err
    assert "target_hash" not in err  # only what differs is named
    assert {p: p.read_bytes() for p in (out / sh.SHARDS_DIR).rglob(sh.DONE_FILE)} == before  # finished work kept


@pytest.mark.parametrize("done, resumes", [({"key": "legacy-key"}, True), ({"key": "other"}, False)])
def test_a_shard_marked_by_an_older_version_resumes_only_with_its_own_key(tmp_path, done, resumes):
    (tmp_path / sh.DONE_FILE).write_text(json.dumps(done))
    if resumes:
        assert sh.read_done(tmp_path, "new-key", plan={"seed": 0}, also=("legacy-key",)) == done
    else:
        with pytest.raises(InputFileError, match="older specpilot"):
            sh.read_done(tmp_path, "new-key", plan={"seed": 0}, also=("legacy-key",))
