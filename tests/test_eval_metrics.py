"""Evaluation metrics on known inputs: percentiles, inter-token latency, pooled speedup, tau."""
import math

import numpy as np
import pytest

from specpilot.eval.metrics import (RunRecord, aggregate, chunk_sizes, delivery_times, inter_token_latencies,
                                    percentiles)


@pytest.mark.parametrize("values, expected", [
    (list(range(1, 101)), [50.5, 90.1, 99.01]),
    ([0.0, 10.0], [5.0, 9.0, 9.9]),
    ([3.0], [3.0, 3.0, 3.0]),
])
def test_percentiles_linear(values, expected):
    assert percentiles(values) == pytest.approx(expected)
    assert percentiles(values) == pytest.approx(np.percentile(values, [50, 90, 99]))


def test_percentiles_empty_is_nan():
    assert all(math.isnan(v) for v in percentiles([]))


def test_itl_counts_bursts_as_one_delivery():
    times = [0.1, 0.1, 0.1, 0.3, 0.6, 0.6]
    assert delivery_times(times) == [0.1, 0.3, 0.6]
    assert inter_token_latencies(times) == pytest.approx([0.2, 0.3])
    assert chunk_sizes(times) == [3, 1, 2]


def _rec(pid, n, wall, cycles=(), times=None, method="m"):
    return RunRecord(prompt_id=pid, method=method, tokens=list(range(n)), wall_s=wall, cycles=list(cycles),
                     token_times=times if times is not None else [wall * (i + 1) / n for i in range(n)],
                     draft_s=wall / 4, verify_s=wall / 2, policy_s=wall / 100)


def test_speedup_is_ratio_of_pooled_throughputs():
    ar = [_rec("a", 10, 1.0, method="ar"), _rec("b", 30, 2.0, method="ar")]    # 40 tok / 3 s
    spec = [_rec("a", 10, 0.5, cycles=[(3, 6, 4), (2, 4, 6)]), _rec("b", 30, 1.5, cycles=[(4, 8, 5)] * 6)]
    row = aggregate(spec, ar, identical=True)
    assert row["speedup"] == pytest.approx((40 / 2.0) / (40 / 3.0))
    assert row["tau"] == pytest.approx((4 + 6 + 5 * 6) / 8)
    assert row["tokens_per_s"] == pytest.approx(20.0)
    assert row["draft_frac"] == pytest.approx(0.25) and row["policy_overhead"] == pytest.approx(0.01)
    assert row["n_prompts"] == 2 and row["n_tokens"] == 40 and row["identical_to_ar"] is True
    assert row["depth_dist"] == {"2": 1, "3": 1, "4": 6}
    assert [3, 6, 1, 4.0] in row["choices"]


def test_tau_from_stream_when_no_cycles():
    row = aggregate([_rec("a", 4, 1.0, times=[0.1, 0.1, 0.2, 0.2])], None, identical=None)
    assert row["tau"] == pytest.approx(2.0)
    assert math.isnan(row["speedup"])
    assert row["ttft_s"] == pytest.approx(0.1)
