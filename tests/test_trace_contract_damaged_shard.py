"""Resuming a recording checks its finished shards before recording anything: a damaged one (truncated trace.npz,
garbage samples.json, missing ar.json) is recorded again instead of failing the merge after every other shard, with
advice ("record it again") that failed the same way while done.json still marked it finished."""
from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_pair

from specpilot.drafting.types import TreeConfig
from specpilot.envs import shards as sh
import specpilot.envs.record as record
from specpilot.envs.record import Trace, record_task

PROMPTS = [[5, 17, 3, 42], [60, 2, 2, 9], [7, 7, 1]]
TREE = TreeConfig(width=2, max_depth=3, max_size=4)


def _record(pair, out):
    record_task(pair, TREE, PROMPTS, out, max_new_tokens=6, shard_size=1, ar=True)
    return json.loads((out / sh.CLUSTER_FILE).read_text())


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def _garbage(path):
    path.write_text("{not json")


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(1)
    return tiny_pair(seed=0)


@pytest.mark.parametrize("file, damage", [("trace.npz", _truncate), ("samples.json", _garbage),
                                          (sh.AR_FILE, lambda p: p.unlink())])
def test_resume_records_a_damaged_finished_shard_again(pair, tmp_path, capsys, file, damage):
    out = tmp_path / "rec"
    whole = Trace.load(_record(pair, out)["out"])
    damaged = out / sh.SHARDS_DIR / "shard-0001"
    damage(damaged / file)
    capsys.readouterr()
    cluster = _record(pair, out)
    assert cluster["resumed_shards"] == [0, 2]  # the damaged shard was recorded again, the others kept
    assert f"shard {damaged} is damaged" in capsys.readouterr().err
    again = Trace.load(out)
    assert all((again.arrays[k] == whole.arrays[k]).all() for k in ("continuation", "onpath_rank"))


def test_a_recording_begun_with_more_workers_resumes_with_one(pair, tmp_path, monkeypatch):
    """The default shard layout depends on the worker count at the start (--ray, --workers): resume finds it from
    the finished shards instead of refusing them."""
    out = tmp_path / "rec"
    real = record.shard_ranges
    with monkeypatch.context() as m:  # as a 2-worker pool plans it: 6 shards of one prompt (1 worker: 3 of two)
        m.setattr(record, "shard_ranges", lambda n, workers, size=None: real(n, 2, size))
        prompts = PROMPTS * 2
        record_task(pair, TREE, prompts, out, max_new_tokens=6)
    for shard in sorted((out / sh.SHARDS_DIR).iterdir())[3:]:  # interrupted after three shards
        (shard / sh.DONE_FILE).unlink()
    record_task(pair, TREE, prompts, out, max_new_tokens=6)
    cluster = json.loads((out / sh.CLUSTER_FILE).read_text())
    assert len(cluster["shards"]) == 6 and cluster["resumed_shards"] == [0, 1, 2]
