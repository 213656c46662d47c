"""Traces recorded on local processes side by side (`ProcessPool`), the clocks read by one process alone: the trace
equals a one-process recording, the profile and ar.json come from the timing process, a re-run resumes every shard
and the timing, a pool of another pair is refused, and the evaluation's held-out trace recorded on the pool is the
one `heldout_trace` then reuses."""
from __future__ import annotations

import json

import pytest

from specpilot.drafting.pair import ModelPair
from specpilot.envs.profile import LatencyProfile
from specpilot.envs.record import TIMING_DIR, Trace, record_task
from specpilot.envs.shards import CLUSTER_FILE
from specpilot.train.scale.cluster import PairSpec
from specpilot.train.scale.processes import ProcessPool, trace_worker_count
from sharded import PROMPTS, TREE, assert_same_tables


@pytest.fixture(scope="module")
def local_pair(saved_pair):
    return ModelPair.from_pretrained(str(saved_pair / "target"), str(saved_pair / "draft"), device="cpu")


@pytest.fixture(scope="module")
def pool(saved_pair):
    with ProcessPool(PairSpec(str(saved_pair / "target"), str(saved_pair / "draft"), device="cpu"), 2) as workers:
        yield workers


@pytest.mark.heavy
def test_traces_on_processes_with_the_timing_apart(pool, local_pair, tmp_path, capsys):
    apart, alone = tmp_path / "apart", tmp_path / "alone"
    record_task(local_pair, TREE, PROMPTS, apart, max_new_tokens=12, profile_prompts=3, ar=True, trace_workers=pool)
    record_task(local_pair, TREE, PROMPTS, alone, max_new_tokens=12, profile_prompts=3, ar=True)
    got, want = Trace.load(apart), Trace.load(alone)
    assert_same_tables(got, want)
    for key in ("tree", "prompts", "positions", "max_new_tokens", "eos_token_id", "device"):
        assert got.header[key] == want.header[key], key
    summary = json.loads((apart / CLUSTER_FILE).read_text())
    assert {s["worker"] for s in summary["shards"]} <= {0, 1}
    assert summary["timing_worker"]["pid"] not in {w["pid"] for w in pool.workers}
    # the shards hold traces only; the profile and the AR timing were measured by this process, after them
    assert not list((apart / "shards").glob("shard-*/samples.json"))
    assert (apart / "shards" / TIMING_DIR / "samples.json").is_file()
    profile = LatencyProfile.load(apart / "profile.json")
    assert profile.meta["cycles"] > 0 and profile.meta.get("ar_seconds_per_token", 0) > 0
    assert set(profile.to_dict()) == set(LatencyProfile.load(alone / "profile.json").to_dict())
    ar = json.loads((apart / "ar.json").read_text())
    assert ar["tokens"] > 0 and ar["prompts"] == 3 and "alone" in ar["shards"][0]["source"]
    # a re-run records and times nothing again
    capsys.readouterr()
    record_task(local_pair, TREE, PROMPTS, apart, max_new_tokens=12, profile_prompts=3, ar=True, trace_workers=pool,
                progress=True)
    assert "resuming" in capsys.readouterr().out
    again = json.loads((apart / CLUSTER_FILE).read_text())
    assert again["resumed_shards"] == list(range(len(summary["shards"])))
    assert_same_tables(Trace.load(apart), got)


def test_a_lost_timing_is_measured_again_and_the_shards_kept(pool, local_pair, tmp_path):
    record_task(local_pair, TREE, PROMPTS[:4], tmp_path, max_new_tokens=8, profile_prompts=1, trace_workers=pool)
    (tmp_path / "shards" / TIMING_DIR / "samples.json").write_text("{garbage")  # damaged after it finished
    record_task(local_pair, TREE, PROMPTS[:4], tmp_path, max_new_tokens=8, profile_prompts=1, trace_workers=pool)
    summary = json.loads((tmp_path / CLUSTER_FILE).read_text())
    assert summary["resumed_shards"] == list(range(len(summary["shards"])))
    assert LatencyProfile.load(tmp_path / "profile.json").meta["cycles"] > 0


def test_trace_workers_of_another_pair_are_refused(pool, tmp_path):
    from tiny import tiny_pair

    with pytest.raises(ValueError, match="another pair"):
        record_task(tiny_pair(), TREE, [[5, 17, 3, 42]], tmp_path, max_new_tokens=4, trace_workers=pool)
    assert not (tmp_path / "trace.npz").exists()


def test_the_heldout_trace_recorded_on_processes_is_reused(pool, local_pair, tmp_path, monkeypatch):
    import specpilot.envs.record as record
    from specpilot.eval.replay_eval import REPLAY_CACHE, heldout_trace, record_on_workers

    record_on_workers(pool, TREE, PROMPTS, tmp_path, max_new_tokens=10)
    ids = [local_pair.encode(p) for p in PROMPTS]
    want = record.record_trace(local_pair, TREE, ids, max_new_tokens=10)

    def must_not_record(*args, **kwargs):
        raise AssertionError("heldout_trace recorded again instead of reusing the trace recorded on the pool")

    monkeypatch.setattr(record, "record_trace", must_not_record)
    got = heldout_trace(local_pair, TREE, ids, tmp_path, max_new_tokens=10)
    assert got.header["recorded_by"] == REPLAY_CACHE and got.header["sharded"]["shards"] >= 2
    assert_same_tables(got, want)


@pytest.mark.parametrize("device, cores, available, count", [
    ("cpu", 2, 64 * 2**30, 2), ("cpu", 16, 64 * 2**30, 16), ("cpu", 1, 64 * 2**30, 0),
    ("cpu", 8, 3 * 10**6, 3), ("cpu", 8, 10**6, 0), ("meta", 8, 64 * 2**30, 0)])
def test_trace_worker_count(device, cores, available, count):
    import torch

    class Pair:  # 500,000 bytes of weights
        target = torch.nn.Linear(125, 1000, bias=False)
        draft = eagle = None

    Pair.device = torch.device(device)
    got, why = trace_worker_count(Pair(), cores=cores, available=available)
    assert got == count and why


def test_record_cli_on_processes(saved_pair, tmp_path, capsys):
    from specpilot.cli import main

    settings = ["record", "--suite", "train", "--limit", "3", "--max-new-tokens", "6", "--profile-prompts", "1",
                "--profile-cycles", "0", "--width", "2", "--max-depth", "3", "--max-size", "6", "--target",
                str(saved_pair / "target"), "--draft", str(saved_pair / "draft")]
    assert main([*settings, "--out", str(tmp_path / "t"), "--processes", "2"]) == 0
    assert "on 2 process(es) side by side" in capsys.readouterr().out
    assert (tmp_path / "t" / "trace.npz").is_file() and (tmp_path / "t" / "shards" / TIMING_DIR / "done.json").is_file()
    assert json.loads((tmp_path / "t" / CLUSTER_FILE).read_text())["timing_worker"]["worker"] == 0
    code = main([*settings, "--out", str(tmp_path / "r"), "--processes", "2", "--ray", "local"])
    err = capsys.readouterr().err
    assert code == 2 and "give one of them" in err and "Traceback" not in err and not (tmp_path / "r").exists()


def test_the_splits_share_one_measured_profile(pool, local_pair, tmp_path):
    from specpilot.train.rl.traces import TaskTraces, record_traces

    traces = record_traces(local_pair, tmp_path, train_prompts=PROMPTS[:4], val_prompts=PROMPTS[4:], tree=TREE,
                           max_new_tokens=8, profile_prompts=1, trace_workers=pool, shared_profile=True)
    TaskTraces.resolve(tmp_path)  # the contract of the two splits and their profiles holds
    train = LatencyProfile.load(traces.train / "profile.json")
    val = LatencyProfile.load(traces.validation / "profile.json")
    assert val.meta.pop("shared_from") == str(traces.train) and val.to_dict() == train.to_dict()
    assert json.loads((traces.validation / "ar.json").read_text())["shared_from"] == str(traces.train)
    assert not (traces.validation / "shards" / TIMING_DIR).exists()  # measured once, with the train split
    assert Trace.load(traces.validation).num_prompts == 2


def test_a_trace_without_measuring(local_pair, tmp_path):
    record_task(local_pair, TREE, PROMPTS[:2], tmp_path, max_new_tokens=6, ar=True, measure=False)
    assert Trace.load(tmp_path).num_prompts == 2
    assert not (tmp_path / "profile.json").exists() and not (tmp_path / "ar.json").exists()


def test_a_pool_whose_pair_cannot_load_fails_with_its_error(local_pair, tmp_path, capsys):
    from specpilot.demo import TraceWorkers

    # the process that fails aborts the start barrier: the others stop waiting, and the load error is raised
    with pytest.raises(Exception, match="missing"):
        ProcessPool(PairSpec(str(tmp_path / "missing"), str(tmp_path / "missing"), device="cpu"), 2)
    # the demo then records in its own process instead
    workers = TraceWorkers(local_pair, target=str(tmp_path / "missing"), draft=str(tmp_path / "missing"), count=2)
    assert workers.get() is None and workers.count == 0
    assert "did not start" in capsys.readouterr().out


def test_eval_cli_records_its_replay_trace_on_processes(saved_pair, tmp_path, capsys):
    from specpilot.artifacts.trace import TraceHeader
    from specpilot.cli import main
    from specpilot.eval.replay_eval import REPLAY_CACHE

    suite = tmp_path / "suite.txt"
    suite.write_text("def f(x):\ndef g(y):\nclass A:\n")
    settings = ["eval", "--suite", str(suite), "--target", str(saved_pair / "target"), "--draft",
                str(saved_pair / "draft"), "--width", "2", "--max-depth", "2", "--max-size", "4", "--methods", "fixed",
                "--temperatures", "0", "--rounds", "1", "--max-new-tokens", "4", "--no-plots", "--replay-dir",
                str(tmp_path / "t"), "--processes", "2", "--profile-cycles", "200"]
    assert main([*settings, "--out", str(tmp_path / "e")]) == 0
    assert "greedy trace of 3 prompts on 2 processes side by side" in capsys.readouterr().err
    assert TraceHeader.load(tmp_path / "t").data["recorded_by"] == REPLAY_CACHE
    assert main([*settings, "--out", str(tmp_path / "e2")]) == 0  # the trace is reused: no processes started
    assert "side by side" not in capsys.readouterr().err


@pytest.mark.parametrize("options, fragment", [([], "give --replay-dir"),
                                               (["--replay-dir", "{tmp}/t", "--ray", "local"], "give one of them")])
def test_eval_processes_without_a_trace_to_record_is_refused(tmp_path, capsys, options, fragment):
    from specpilot.cli import main

    options = [o.replace("{tmp}", str(tmp_path)) for o in options]
    code = main(["eval", "--methods", "fixed", "--out", str(tmp_path / "e"), "--processes", "2", *options])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "Traceback" not in err and not (tmp_path / "e").exists()


def test_eval_profile_cycles_without_a_replay_dir_is_refused(tmp_path, capsys):
    from specpilot.cli import main

    code = main(["eval", "--methods", "fixed", "--out", str(tmp_path / "e"), "--profile-cycles", "200"])
    err = capsys.readouterr().err
    assert code == 2 and "give --replay-dir" in err and "Traceback" not in err and not (tmp_path / "e").exists()
