"""Sharding and merging without Ray: shard plans, trace/profile/meta merges, group balancing, and that importing
specpilot (CLI included) never imports Ray."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from specpilot.drafting.types import TreeConfig
from specpilot.envs.profile import ProfileSamples
from specpilot.envs.record import record_trace
from specpilot.eval.suites import Prompt
from specpilot.drafting.executor import assign_groups, shard_ranges
from specpilot.envs.record import merge_traces
from specpilot.envs.shards import merge_samples, samples_from_dict, samples_to_dict
from specpilot.eval.runner import merge_meta

from tiny import tiny_pair

TREE = TreeConfig(width=2, max_depth=3, max_size=6)


def test_importing_specpilot_and_building_the_cli_never_imports_ray():
    code = ("import sys, specpilot, specpilot.cli, specpilot.train.scale.cluster, specpilot.drafting.executor, "
            "specpilot.envs.shards, specpilot.train.scale.ray_vecenv, specpilot.train.scale.cluster_cli\n"
            "specpilot.cli.build_parser()\n"
            "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


@pytest.mark.parametrize("n, workers, size, expected", [
    (8, 2, None, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8)]),
    (5, 1, 2, [(0, 2), (2, 4), (4, 5)]),
    (3, 4, None, [(0, 1), (1, 2), (2, 3)]),
])
def test_shard_ranges_cover_every_prompt_once_in_order(n, workers, size, expected):
    assert shard_ranges(n, workers, size) == expected


def test_shard_ranges_refuse_an_empty_prompt_list():
    with pytest.raises(ValueError, match="no prompts"):
        shard_ranges(0, 2)


def test_merged_shard_traces_equal_one_recording():
    pair = tiny_pair(noise=0.3, eos=5)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(6, 95, size=4 + i).tolist() for i in range(5)]
    whole = record_trace(pair, TREE, prompts, max_new_tokens=10)
    parts = [record_trace(pair, TREE, prompts[lo:hi], max_new_tokens=10) for lo, hi in shard_ranges(5, 1, 2)]
    merged = merge_traces(parts)
    assert set(merged.arrays) == set(whole.arrays)
    for key, value in whole.arrays.items():
        assert merged.arrays[key].dtype == value.dtype, key
        np.testing.assert_array_equal(merged.arrays[key], value, err_msg=key)
    assert merged.header["prompts"] == whole.header["prompts"]
    assert merged.header["positions"] == whole.header["positions"]
    assert merged.header["sharded"] == {"shards": 3, "devices": ["cpu"]}
    for i in range(5):  # per-prompt views agree too
        assert merged.prompt(i) == whole.prompt(i) and merged.budget(i) == whole.budget(i)


def test_merge_traces_refuses_shards_of_different_trees():
    pair = tiny_pair(noise=0.3)
    a = record_trace(pair, TREE, [[1, 2, 3]], max_new_tokens=4)
    b = record_trace(pair, TreeConfig(width=3, max_depth=3, max_size=6), [[1, 2, 3]], max_new_tokens=4)
    with pytest.raises(ValueError, match="tree"):
        merge_traces([a, b])


def test_merge_traces_matches_pairs_by_weights_not_by_folder():
    pair = tiny_pair(noise=0.3)
    a = record_trace(pair, TREE, [[1, 2, 3]], max_new_tokens=4)
    b = record_trace(pair, TREE, [[4, 5, 6]], max_new_tokens=4)
    hashes = {"drafter": "draft_lm", "target_hash": "t1", "draft_hash": "d1", "vocab_size": 100}
    a.header["pair"] = {**hashes, "target": "/host-a/models/target", "draft": "/host-a/models/draft"}
    b.header["pair"] = {**hashes, "target": "/host-b/target", "draft": "/host-b/draft"}
    assert merge_traces([a, b]).num_prompts == 2  # the same weights, loaded from another folder
    b.header["pair"] = {**b.header["pair"], "draft_hash": "d2"}
    with pytest.raises(ValueError, match="different pairs"):
        merge_traces([a, b])
    b.header["pair"], b.header["dtype"] = dict(a.header["pair"]), "torch.bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        merge_traces([a, b])


def _samples(offset: float, n_verify: int) -> ProfileSamples:
    s = ProfileSamples(max_depth=3, width=2, meta={"device": "x", "measured_s": 1.0})
    s.first[1].extend([offset, offset + 1])
    s.levels[2].append(offset + 2)
    s.verify.extend((4, 10 + k, offset + k) for k in range(n_verify))
    return s


def test_merged_samples_pool_every_sample_and_record_its_device():
    merged = merge_samples([("cuda:0@a", _samples(0.0, 2)), ("cpu", _samples(10.0, 1)),
                            ("cuda:0@a", _samples(20.0, 1))])
    assert merged.first[1] == [0.0, 1.0, 10.0, 11.0, 20.0, 21.0]
    assert len(merged.verify) == 4 and merged.meta["measured_s"] == 3.0
    assert merged.meta["devices"] == ["cpu", "cuda:0@a"]
    where = merged.meta["sample_device"]
    assert where["first"][1] == [1, 1, 0, 0, 1, 1] and where["verify"] == [1, 1, 0, 1]
    assert merged.profile().meta["cycles"] == 4


def _with_ar(samples, seconds: float, tokens: int):
    samples.meta.update(ar_s=seconds, ar_tokens=tokens)
    return samples


def test_merged_samples_pool_the_ar_timed_beside_every_shard():
    merged = merge_samples([("cpu", _with_ar(_samples(0.0, 2), 1.0, 100)), ("cpu", _with_ar(_samples(5.0, 1), 3.0, 100))])
    assert (merged.meta["ar_s"], merged.meta["ar_tokens"]) == (4.0, 200)
    assert merged.profile().meta["ar_seconds_per_token"] == pytest.approx(0.02)
    # a shard without it (recorded without ar, or by an older version): no AR reference rather than a partial one
    merged = merge_samples([("cpu", _samples(0.0, 2)), ("cpu", _with_ar(_samples(5.0, 1), 3.0, 100))])
    assert "ar_tokens" not in merged.meta and "ar_seconds_per_token" not in merged.profile().meta


def test_samples_survive_the_json_round_trip():
    s = _samples(1.5, 3)
    back = samples_from_dict(samples_to_dict(s))
    assert dict(back.first) == dict(s.first) and dict(back.levels) == dict(s.levels) and back.verify == s.verify


def _prompt(i: int, task: str, lang: str) -> Prompt:
    return Prompt(f"p{i}", task, lang, "heldout", "x")


def test_groups_stay_whole_and_balance_by_prompt_count():
    prompts = ([_prompt(i, "code", "en") for i in range(4)] + [_prompt(4 + i, "qa", "it") for i in range(2)]
               + [_prompt(6 + i, "math", "zh") for i in range(2)])
    plan = assign_groups(prompts, 2)
    assert plan == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert assign_groups(prompts, 5)[3:] == [[], []]
    assert assign_groups(prompts, 3, by_group=False) == [[0, 3, 6], [1, 4, 7], [2, 5]]  # single prompts


def test_merge_meta_keeps_equal_values_and_lists_the_workers():
    metas = [{"device": "cpu", "skipped": {"a": "x"}, "prompts_truncated": 1, "date": "d1"},
             {"device": "cpu", "skipped": {"b": "y"}, "prompts_truncated": 2, "date": "d2"}]
    meta = merge_meta(metas, [{"worker": 0}, {"worker": 1}])
    assert meta["device"] == "cpu" and meta["skipped"] == {"a": "x", "b": "y"}
    assert meta["prompts_truncated"] == 3
    assert meta["date"] == "d1" and meta["per_worker"]["date"] == ["d1", "d2"]
    assert meta["workers"] == [{"worker": 0}, {"worker": 1}]
    assert merge_meta(metas[:1], [{"worker": 0}])["per_worker"] == {}  # one worker: the same keys, nothing differs
