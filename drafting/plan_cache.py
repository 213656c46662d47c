"""The row plans `linear_kernels.measure` makes, kept on disk per machine so later processes start without a probe.

Measuring a plan costs each process ~2 s per model on CPU (the embedded pair: 6 s to load instead of 2), and plans
for near ties differ between processes: a recording's latency profile could be taken under one plan and the
evaluation that trusts it run under another. So the first process on a machine stores its plan and later ones read
it: one file per (machine, layer shapes, dtype, thread count) under `$SPECPILOT_CACHE_DIR/row_plans/` (default
`$XDG_CACHE_HOME/specpilot`, else `~/.cache/specpilot`), written to a temporary file and renamed (concurrent
processes never read half a file). The machine is the CPU model and flags, the CPUs this process may use and the
torch build (version and BLAS configuration): another CPU, container size or torch measures anew. A file that
cannot be read or does not hold a valid plan is measured again and replaced; a folder that cannot be written is
skipped (the plan is still used in this process). SPECPILOT_ROW_PLAN_CACHE=0 measures in every process;
SPECPILOT_ROW_PLAN_CACHE=refresh measures and replaces the stored plans (after the machine changed in a way the key
does not see, e.g. a plan measured while other work loaded the CPU).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

CACHE_SWITCH = "SPECPILOT_ROW_PLAN_CACHE"  # "0": no cache, every process probes; "refresh": probe and store
CACHE_DIR_ENV = "SPECPILOT_CACHE_DIR"
FORMAT = 1  # bump when the probe or the record changes meaning: older files are then not read


def cache_dir() -> Path | None:
    """The folder plans are kept in, or None when the cache is switched off."""
    if os.environ.get(CACHE_SWITCH, "1").strip() == "0":
        return None
    base = os.environ.get(CACHE_DIR_ENV)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "specpilot")
    return Path(base) / "row_plans"


@functools.cache
def machine() -> dict:
    """What a plan depends on besides the layers: CPU model and flags, usable CPUs, torch build."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())  # the first CPU's (x86 "flags", ARM "Features")
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    flags = fields.get("flags") or fields.get("Features", "")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    build = hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:16]
    return {"cpu": model, "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "cpus": cpus, "torch": torch.__version__, "build": build}


def _path(folder: Path, key: str, dtype: str, threads: int) -> Path:
    ident = json.dumps([FORMAT, machine(), key, dtype, threads], sort_keys=True)
    return folder / f"{hashlib.sha256(ident.encode()).hexdigest()[:32]}.json"


def _valid(record: dict, key_layers: int, dtype: str, threads: int, max_rows: int) -> bool:
    try:
        plan = record["plan"]
        ok = record["dtype"] == dtype and record["threads"] == threads and record["layers"] == key_layers
        ok = ok and all(isinstance(r, int) and isinstance(w, int) and 1 <= r <= w <= max_rows for r, w in plan)
        return ok and record["rows"] == [r for r, _ in plan] and len({r for r, _ in plan}) == len(plan)
    except (KeyError, TypeError, ValueError):
        return False


def load(key: str, dtype: str, threads: int, layers: int, max_rows: int) -> dict | None:
    """The stored record for (this machine, key, dtype, threads) with "source": "cache", or None."""
    folder = cache_dir()
    if folder is None or os.environ.get(CACHE_SWITCH, "").strip() == "refresh":
        return None
    try:
        record = json.loads(_path(folder, key, dtype, threads).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not _valid(record, layers, dtype, threads, max_rows):
        return None
    return {**record, "source": "cache"}


def store(key: str, record: dict) -> None:
    """Keep `record` (a fresh measurement) for later processes; a folder that cannot be written is skipped."""
    folder = cache_dir()
    if folder is None:
        return
    path = _path(folder, key, record["dtype"], record["threads"])
    data = {k: v for k, v in record.items() if k not in ("widths", "source")}  # the file name holds the machine
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".plan-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
