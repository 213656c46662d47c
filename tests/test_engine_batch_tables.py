"""The per-batch-size tables the export writes, read the way the engines' own code reads them: batch size b gets the
K measured at the largest measured batch size <= b.

The lookups below re-implement, line for line in substance, the engines' sources (checked in vLLM 0.33 and SGLang
0.5.23; re-check these paths in the release you target):
  vLLM    vllm/config/speculative.py (the `num_speculative_tokens_per_batch_size` field of SpeculativeConfig),
          vllm/v1/spec_decode/dynamic/utils.py (`validate_and_normalize_dynamic_sd_schedule`,
          `build_dynamic_sd_schedule_lookup`: dense[bs] = min(num_speculative_tokens, K), gaps and the tail carry
          the previous K), read by vllm/v1/core/sched/scheduler.py with the number of scheduled requests.
  SGLang  python/sglang/srt/speculative/adaptive_spec_params.py (`_load_adaptive_config`: digit keys are batch-size
          slots, candidate_steps ints >= 0; `AdaptiveStepSlot`: current_steps = the static num_steps when it is a
          candidate, else the middle candidate; slot cfg = {**top level, **slot}),
          python/sglang/srt/speculative/adaptive_step_router.py (`batch_size_key_for_batch`: pad to the CUDA-graph
          batch size, then the largest key not above it, the smallest key below all keys).
"""
from __future__ import annotations

import bisect
import json

import pytest

from specpilot.policies.engine_configs import (batch_size_steps, sglang_adaptive_config, vllm_batch_schedule,
                                               vllm_speculative_config, write_engine_configs)

_CTX_INFINITY = 2**31 - 1


def vllm_lookup(schedule, max_batch_size: int, num_speculative_tokens: int) -> list[int]:
    """vllm/v1/spec_decode/dynamic/utils.py, 3-item form: validate, then expand into dense[bs] (index 0 unused)."""
    assert isinstance(schedule, list) and schedule
    parsed = []
    for entry in schedule:
        assert isinstance(entry, (list, tuple)) and len(entry) == 3
        lo, hi, k = int(entry[0]), int(entry[1]), int(entry[2])
        if lo <= 0 or hi <= 0 or lo > hi or k < 0:
            raise ValueError(f"bad entry {entry}")
        parsed.append((lo, hi, k))
    prev_end = 0
    for lo, hi in sorted({(lo, hi) for lo, hi, _ in parsed}):
        if lo <= prev_end:
            raise ValueError("Batch-size ranges must be non-overlapping and sorted.")
        prev_end = hi
    if min(lo for lo, _, _ in parsed) != 1:
        raise ValueError("The first batch-size range must start at 1")
    if num_speculative_tokens <= 0:
        raise ValueError("vllm_num_speculative_tokens must be > 0.")
    dense = [0] * (max_batch_size + 1)
    next_bs, last_k = 1, None
    for lo, hi, k in sorted(parsed):
        if lo > next_bs and last_k is not None:
            for bs in range(next_bs, min(lo, max_batch_size + 1)):
                dense[bs] = min(num_speculative_tokens, last_k)
        for bs in range(max(lo, next_bs), min(hi, max_batch_size) + 1):
            dense[bs] = min(num_speculative_tokens, k)
        next_bs, last_k = max(next_bs, hi + 1), k
        if next_bs > max_batch_size:
            break
    if last_k is not None:
        for bs in range(next_bs, max_batch_size + 1):
            dense[bs] = min(num_speculative_tokens, last_k)
    return dense


def sglang_steps(cfg: dict, initial_steps: int, batch_size: int, cuda_graph_bs: list[int] | None = None) -> int:
    """adaptive_spec_params.py + adaptive_step_router.py: the steps a batch of `batch_size` runs with."""
    slots = {}
    for key, entry in cfg.items():
        if not key.isdigit():
            continue
        steps = entry.get("candidate_steps")
        assert isinstance(steps, list) and steps and all(isinstance(s, int) and s >= 0 for s in steps)
        candidates = sorted(set({**cfg, **entry}["candidate_steps"]))
        slots[int(key)] = initial_steps if initial_steps in candidates else candidates[len(candidates) // 2]
    assert slots
    keys = sorted(slots)
    if cuda_graph_bs:
        graphs = sorted(cuda_graph_bs)
        i = bisect.bisect_left(graphs, batch_size)
        if i < len(graphs):
            batch_size = graphs[i]
    return slots[keys[max(0, bisect.bisect_right(keys, batch_size) - 1)]]


def table(pairs):
    return [{"batch_size": b, "width": 1, "depth": k, "size": k, "tokens_per_s": 100.0 / b, "speedup_vs_ar": 1.1}
            for b, k in pairs]


def expected_k(pairs, b: int) -> int:
    """The K measured at the largest measured batch size <= b (the smallest's below them all)."""
    below = [k for size, k in sorted(pairs) if size <= b]
    return below[-1] if below else sorted(pairs)[0][1]


TABLES = [[(1, 4), (2, 3), (4, 3), (8, 1), (16, 0)], [(1, 2)], [(2, 3), (8, 0)], [(1, 0), (4, 2), (16, 5)],
          [(1, 5), (2, 5), (4, 5)], [(1, 3), (4, 0), (8, 2)]]


@pytest.mark.parametrize("pairs", TABLES, ids=lambda p: "-".join(f"{b}:{k}" for b, k in p))
def test_vllm_reads_k_of_the_measured_batch_size(pairs):
    schedule = vllm_batch_schedule(table(pairs))
    config = vllm_speculative_config("DRAFT", 7, schedule=schedule)
    assert config["num_speculative_tokens_per_batch_size"] == schedule
    assert config["num_speculative_tokens"] == max(1, max(k for _, k in pairs))  # holds the largest K
    assert schedule[0][0] == 1 and all(a[1] < b[0] for a, b in zip(schedule, schedule[1:]))
    assert all(a[2] != b[2] for a, b in zip(schedule, schedule[1:]))  # equal neighbours merged
    dense = vllm_lookup(config["num_speculative_tokens_per_batch_size"], 64, config["num_speculative_tokens"])
    for b in range(1, 65):
        assert dense[b] == expected_k(pairs, b), b


@pytest.mark.parametrize("pairs", TABLES, ids=lambda p: "-".join(f"{b}:{k}" for b, k in p))
@pytest.mark.parametrize("graphs", [None, [1, 2, 4, 8, 16, 24, 32, 48, 64]], ids=["eager", "cuda-graphs"])
def test_sglang_reads_k_of_the_measured_batch_size(pairs, graphs, tmp_path):
    """The exported EAGLE-3 chain: one single-candidate slot per measured batch size; the static num_steps is the
    smallest size's K (the slot's start); SGLang pads the batch to its CUDA-graph size before routing."""
    section = write_engine_configs(tmp_path, pair={"target": "T", "draft": "H", "drafter": "eagle3"}, width=1,
                                   grid_best={"width": 1, "depth": 3, "size": 3}, choices={}, fallback=(3, 3),
                                   per_batch_size=table(pairs))
    engines = tmp_path / "engines"
    cfg = json.loads((engines / "sglang" / "sglang_adaptive.json").read_text())
    args = json.loads((engines / "sglang" / "sglang_args.json").read_text())
    assert sorted(int(k) for k in cfg if k.isdigit()) == sorted(b for b, _ in pairs)
    assert args["speculative_num_draft_tokens"] == args["speculative_num_steps"] + 1 >= 2
    steps = {s for k, e in cfg.items() if k.isdigit() for s in e["candidate_steps"]}
    assert args["speculative_num_steps"] in steps  # SGLang refuses a static num_steps outside the candidates
    for b in range(1, 65):
        padded = b if graphs is None else next(g for g in graphs if g >= b)
        assert sglang_steps(cfg, args["speculative_num_steps"], b, graphs) == expected_k(pairs, padded), b
    vllm = json.loads((engines / "vllm" / "speculative_config.json").read_text())
    dense = vllm_lookup(vllm["num_speculative_tokens_per_batch_size"], 64, vllm["num_speculative_tokens"])
    assert [dense[b] for b in range(1, 65)] == [expected_k(pairs, b) for b in range(1, 65)]
    assert section["per_batch_size"]["vllm_num_speculative_tokens_per_batch_size"] == \
        vllm["num_speculative_tokens_per_batch_size"]
    assert "Per batch size" in (engines / "README.md").read_text()


def test_draft_lm_export_writes_the_vllm_table_and_no_sglang_adaptive(tmp_path):
    pairs = [(1, 4), (4, 2), (16, 0)]
    section = write_engine_configs(tmp_path, pair={"target": "T", "draft": "D", "drafter": "draft_lm"}, width=3,
                                   grid_best={"width": 3, "depth": 4, "size": 8}, choices={}, fallback=(3, 3),
                                   per_batch_size=table(pairs))
    vllm = json.loads((tmp_path / "engines" / "vllm" / "speculative_config.json").read_text())
    assert vllm["method"] == "draft_model" and vllm["num_speculative_tokens"] == 4
    assert vllm["num_speculative_tokens_per_batch_size"] == [[1, 3, 4], [4, 15, 2], [16, 16, 0]]
    assert not (tmp_path / "engines" / "sglang" / "sglang_adaptive.json").exists()
    assert section["per_batch_size"]["sglang_adaptive_keys"] is None


def test_without_a_table_the_configs_are_as_before():
    assert "num_speculative_tokens_per_batch_size" not in vllm_speculative_config("D", 3)
    assert list(sglang_adaptive_config({}, 3)) == ["1"]
    assert batch_size_steps(table([(4, 2), (1, 3)])) == [(1, 3), (4, 2)]


def test_no_sglang_adaptive_file_when_drafting_lost_at_every_batch_size(tmp_path):
    """K = 0 in every slot leaves no --speculative-num-steps (>= 1) SGLang would start with: the file is not
    written and the README says why; vLLM's table turns drafting off everywhere."""
    section = write_engine_configs(tmp_path, pair={"target": "T", "draft": "H", "drafter": "eagle3"}, width=1,
                                   grid_best={"width": 1, "depth": 3, "size": 3}, choices={}, fallback=(3, 3),
                                   per_batch_size=table([(1, 0), (2, 0), (8, 0)]))
    engines = tmp_path / "engines"
    assert not (engines / "sglang" / "sglang_adaptive.json").exists()
    assert "lost to batched AR at every measured batch size" in section["skipped"]["sglang_adaptive"]
    assert "speculative-adaptive" not in (engines / "sglang" / "config.yaml").read_text()
    assert "Not written: sglang/sglang_adaptive.json" in (engines / "README.md").read_text()
    vllm = json.loads((engines / "vllm" / "speculative_config.json").read_text())
    assert vllm["num_speculative_tokens_per_batch_size"] == [[1, 8, 0]]
    section = write_engine_configs(tmp_path, pair={"target": "T", "draft": "H", "drafter": "eagle3"}, width=1,
                                   grid_best={"width": 1, "depth": 3, "size": 3}, choices={}, fallback=(3, 3),
                                   per_batch_size=table([(1, 0), (8, 0)]), learned_per_batch_size=table([(1, 2)]))
    assert "as for the grid's table" in section["skipped"]["sglang_adaptive_learned"]
    assert "Not written: sglang/sglang_adaptive.learned.json" in (engines / "README.md").read_text()


@pytest.mark.parametrize("learned,written", [([(1, 3), (8, 1)], True), ([(1, 4), (8, 0)], False)])
def test_learned_sglang_table_is_written_only_when_config_yaml_can_start_with_it(tmp_path, learned, written):
    """The learned adaptive file replaces the grid's under the same config.yaml, whose num_steps (the grid's
    smallest size's K, 3 here) must be among its candidates."""
    section = write_engine_configs(tmp_path, pair={"target": "T", "draft": "H", "drafter": "eagle3"}, width=1,
                                   grid_best={"width": 1, "depth": 3, "size": 3}, choices={}, fallback=(3, 3),
                                   per_batch_size=table([(1, 3), (8, 2)]), learned_per_batch_size=table(learned))
    path = tmp_path / "engines" / "sglang" / "sglang_adaptive.learned.json"
    assert path.exists() == written
    if written:
        steps = {s for k, e in json.loads(path.read_text()).items() if k.isdigit() for s in e["candidate_steps"]}
        assert 3 in steps
    else:
        assert "needs --speculative-num-steps (3) among" in section["skipped"]["sglang_adaptive_learned"]


@pytest.mark.parametrize("drafter", ["draft_lm", "eagle3"])
def test_no_engine_file_when_the_run_found_plain_decoding_fastest(tmp_path, drafter):
    """Grid best depth 0: every engine needs at least one speculative token, which the run measured slower, so no
    file speculates; decoder.json's section and the README say why. A batch size where drafting pays keeps them."""
    pair = {"target": "T", "draft": "D", "drafter": drafter}
    section = write_engine_configs(tmp_path, pair=pair, width=4, grid_best={"width": 4, "depth": 0, "size": 0},
                                   choices={}, fallback=(4, 12))
    engines = tmp_path / "engines"
    assert not section["files"] and not [p for p in engines.rglob("*.json")] + [p for p in engines.rglob("*.yaml")]
    assert all(key in section["skipped"] for key in ("hf", "vllm", "sglang", "sglang_config"))
    assert "plain target decoding (depth 0) faster" in section["skipped"]["vllm"]
    assert "Not written: vllm/speculative_config.json" in (engines / "README.md").read_text()
    # without a grid: the policies' median depth 0 says the same
    section = write_engine_configs(tmp_path, pair=pair, width=4, grid_best=None, choices={"depths": [0, 0, 0, 2]},
                                   fallback=(4, 12))
    assert "vllm" in section["skipped"] and "chose plain target steps" in section["skipped"]["vllm"]
    # drafting pays at batch size 1: the tables are written
    section = write_engine_configs(tmp_path, pair=pair, width=4, grid_best={"width": 4, "depth": 0, "size": 0},
                                   choices={}, fallback=(4, 12), per_batch_size=table([(1, 2), (8, 0)]))
    assert "vllm" in section["files"]
