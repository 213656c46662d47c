"""Output places `record` and `export` write besides --out itself are checked before any work, with one clear line
(exit 2): a read-only shards/ folder failed with a raw "[Errno 1]" after recording a shard, an export whose --out
parent is read-only with a raw "[Errno 1] ... .x.partial-PID" (the export is staged beside --out)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

import specpilot.drafting.files as files
import specpilot.envs.record as record
from specpilot.cli import main
from specpilot.drafting.errors import OutputPathError
from specpilot.drafting.types import TreeConfig


@pytest.fixture
def read_only(monkeypatch):
    """read_only(folder): the write probe fails in `folder` as a chattr +i folder makes it fail (even for root)."""
    folders: set[Path] = set()
    real = tempfile.TemporaryFile

    def probe(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve() in folders:
            raise PermissionError(1, "Operation not permitted")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(files.tempfile, "TemporaryFile", probe)
    return lambda folder: folders.add(Path(folder).resolve())


@pytest.fixture
def no_recording(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("recorded although an output folder is unwritable")

    monkeypatch.setattr(record, "record_shard", never)


@pytest.mark.parametrize("unwritable", ["shards", "shards/shard-0001"])
def test_record_refuses_an_unwritable_shards_folder_before_recording(tmp_path, read_only, no_recording, unwritable):
    out = tmp_path / "rec"
    (out / unwritable).mkdir(parents=True)
    read_only(out / unwritable)
    with pytest.raises(OutputPathError, match=f"cannot write in {out / unwritable} .Operation not permitted"):
        record.record_task(None, TreeConfig(2, 3, 4), [[1, 2], [3, 4]], out, max_new_tokens=4, shard_size=1,
                           executor=_FakeExecutor())


def test_record_cli_refuses_a_file_where_shards_belongs_before_loading_models(tmp_path, capsys):
    out = tmp_path / "rec"
    out.mkdir()
    (out / "shards").write_text("not a folder")
    code = main(["record", "--suite", "train", "--limit", "1", "--out", str(out), "--target", str(tmp_path / "none"),
                 "--draft", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 2 and f"{out / 'shards'} is an existing file" in err and "Errno" not in err


def test_export_refuses_an_out_whose_parent_is_unwritable(tmp_path, read_only, capsys):
    out = tmp_path / "pe" / "x"
    out.mkdir(parents=True)
    read_only(tmp_path / "pe")
    (tmp_path / "empty-run").mkdir()
    code = main(["export", "--out", str(out), "--run", str(tmp_path / "empty-run")])
    err = capsys.readouterr().err
    assert code == 2 and f"parent {tmp_path / 'pe'}: cannot write in {tmp_path / 'pe'}" in err
    assert "Errno" not in err and len(err.strip().splitlines()) == 1


class _FakeExecutor:
    """Just enough of an executor for record_task to plan its shards (it must refuse before mapping any)."""

    workers = [{"pair": {"target_hash": "t", "draft_hash": "d", "drafter": "draft", "vocab_size": 8},
                "dtype": "float32", "device": "cpu"}]
    device = "cpu"

    def __len__(self) -> int:
        return 1

    def map(self, *args, **kwargs):
        raise AssertionError("recorded although an output folder is unwritable")
