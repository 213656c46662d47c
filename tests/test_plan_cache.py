"""Row plans kept on disk (`drafting/plan_cache.py`): a later process reads the plan an earlier one measured on the
same machine instead of probing; another machine, layer shapes, dtype or thread count measures anew; a corrupted
or invalid file is measured again and replaced, as with the switch at "refresh"; an unwritable folder or the
switch turned off only skips the cache."""
import json

import pytest
import torch

from specpilot.drafting import linear_kernels, plan_cache
from specpilot.drafting.linear_kernels import MAX_ROWS, measure, shapes_key
from specpilot.eval.report import measurement_label

KEY = shapes_key([(256, 512), (512, 256)])


@pytest.fixture
def probes(tmp_path, monkeypatch):
    """A cache in tmp_path and a fake probe that counts its calls (turned faster at widths 2 and 4..9: 1 row
    padded to 2, 3 to 4)."""
    monkeypatch.setenv(plan_cache.CACHE_SWITCH, "1")
    monkeypatch.setenv(plan_cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(linear_kernels, "_MEASURED", {})
    calls = []

    def fake_probe(shapes, dtype):
        calls.append((len(shapes), dtype))
        plain = {r: 10.0 for r in range(1, MAX_ROWS + 1)}
        turned = {r: (5.0 if 2 <= r <= 9 and r != 3 else 20.0) for r in range(1, MAX_ROWS + 1)}
        return plain, turned

    monkeypatch.setattr(linear_kernels, "_probe", fake_probe)
    return calls


def forget():  # a new process: nothing measured in memory
    linear_kernels._MEASURED.clear()


def files(tmp_path):
    return sorted((tmp_path / "row_plans").glob("*.json"))


def test_a_later_process_reads_the_plan_instead_of_probing(probes, tmp_path):
    first = measure(torch.float32, threads=2, key=KEY)
    assert first["source"] == "probe" and first["measured_at"] and len(probes) == 1 and len(files(tmp_path)) == 1
    assert first["widths"][3] == 4 and first["widths"][1] == 2 and first["rows"] == list(range(1, 10))
    forget()
    again = measure(torch.float32, threads=2, key=KEY)
    assert len(probes) == 1 and again["source"] == "cache"
    assert {k: again[k] for k in ("plan", "rows", "ratio", "widths", "measured_at", "layers")} == \
        {k: first[k] for k in ("plan", "rows", "ratio", "widths", "measured_at", "layers")}
    assert set(again) == set(first)  # reports carry the same keys either way (local and Ray runs are compared)


@pytest.mark.parametrize("other", ["threads", "dtype", "key", "machine"])
def test_another_machine_shapes_dtype_or_thread_count_measures_anew(other, probes, tmp_path, monkeypatch):
    measure(torch.float32, threads=2, key=KEY)
    forget()
    args = dict(dtype=torch.float32, threads=2, key=KEY)
    if other == "threads":
        args["threads"] = 3
    elif other == "dtype":
        args["dtype"] = torch.bfloat16
    elif other == "key":
        args["key"] = shapes_key([(256, 512)])
    else:
        monkeypatch.setattr(plan_cache, "machine", lambda: {"cpu": "another CPU"})
    assert measure(**args)["source"] == "probe" and len(probes) == 2 and len(files(tmp_path)) == 2


@pytest.mark.parametrize("content", ["{not json", "[]", json.dumps({"plan": [[5, 3]], "rows": [5], "dtype": "float32",
                                                                     "threads": 2, "layers": 2}),
                                     json.dumps({"plan": [[40, 40]], "rows": [40], "dtype": "float32", "threads": 2,
                                                 "layers": 2}),
                                     json.dumps({"plan": [[2, 2]], "rows": [2], "dtype": "float32", "threads": 2,
                                                 "layers": 9})])
def test_a_corrupted_or_invalid_file_is_measured_again_and_replaced(content, probes, tmp_path):
    measure(torch.float32, threads=2, key=KEY)
    (path,) = files(tmp_path)
    path.write_text(content)
    forget()
    got = measure(torch.float32, threads=2, key=KEY)
    assert got["source"] == "probe" and len(probes) == 2 and got["widths"][3] == 4
    assert json.loads(path.read_text())["plan"] == got["plan"]


def test_the_switch_off_or_an_unwritable_folder_only_skips_the_cache(probes, tmp_path, monkeypatch):
    monkeypatch.setenv(plan_cache.CACHE_SWITCH, "0")
    assert measure(torch.float32, threads=2, key=KEY)["source"] == "probe" and not files(tmp_path)
    forget()
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(plan_cache.CACHE_SWITCH, "1")
    monkeypatch.setenv(plan_cache.CACHE_DIR_ENV, str(blocker))  # row_plans/ cannot be made under a file
    got = measure(torch.float32, threads=2, key=KEY)
    assert got["source"] == "probe" and got["widths"][3] == 4 and len(probes) == 2


def test_refresh_measures_again_and_replaces_the_stored_plan(probes, tmp_path, monkeypatch):
    first = measure(torch.float32, threads=2, key=KEY)
    forget()
    monkeypatch.setenv(plan_cache.CACHE_SWITCH, "refresh")
    assert measure(torch.float32, threads=2, key=KEY)["source"] == "probe" and len(probes) == 2
    forget()
    monkeypatch.setenv(plan_cache.CACHE_SWITCH, "1")
    again = measure(torch.float32, threads=2, key=KEY)
    assert again["source"] == "cache" and len(files(tmp_path)) == 1 and again["plan"] == first["plan"]


def test_one_thread_is_neither_probed_nor_cached(probes, tmp_path):
    assert measure(torch.float32, threads=1, key=KEY)["source"] == "none" and not probes and not files(tmp_path)


def test_the_default_folder_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv(plan_cache.CACHE_SWITCH, "1")
    monkeypatch.delenv(plan_cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert plan_cache.cache_dir() == tmp_path / "specpilot" / "row_plans"
    assert set(plan_cache.machine()) == {"cpu", "flags", "cpus", "torch", "build"}


def test_the_report_label_says_a_plan_came_from_the_cache():
    meta = {"small_row_linears": {"enabled": True, "measured": [{"rows": [2, 3, 4], "source": "cache",
                                                                  "measured_at": "2026-12-05T20:03:26+0000"}]}}
    assert "linears of 2-4 rows as W @ x^T (plan cached 2026-12-05T20:03)" in measurement_label(meta)
    meta["small_row_linears"]["measured"][0]["source"] = "probe"
    assert "rows as W @ x^T) |" in measurement_label(meta)
