"""A trace's latency profile file: profile.json beside trace.npz.

The profile's class, its fields, checked `load` and atomic `save` are `specpilot.envs.profile.LatencyProfile`
(versioned by its own "version" key, `PROFILE_VERSION`); this module holds the file's name and where it lives, so
no caller spells the name.
"""
from __future__ import annotations

from pathlib import Path

from specpilot.artifacts.trace import trace_dir

PROFILE_FILE = "profile.json"
PROFILE_VERSION = 2  # 2: optional per-batch-size profiles ("batch"); version-1 files (batch size 1 only) still load
PROFILE_VERSIONS_READ = (1, 2)
# cycles a profile keeps at least where specpilot measures one itself (`collect_samples(min_cycles=...)`): one pass
# over 6-8 prompts of 48 tokens kept 130-180 cycles (4-15 per verification size), and the replay verdicts of the
# same policies under two such profiles of one machine differed by up to 2.5% (ltd vs grid 1.042 and 1.064); 600
# cycles (30-40 per size, each size's mean +-1.5%) still put static configs' replay ratios up to 3.4 points off the
# ratios measured live in lockstep (three profiles of one machine); 3000 (145-350 per size, +-0.5%) at most 0.8 points
# off (`benchmarks/bench_profile_fit.py`; README, "Reading the report")
DEFAULT_PROFILE_CYCLES = 3000


def profile_path(trace: str | Path) -> Path:
    """The profile.json of the trace at `trace` (its folder or its trace.npz)."""
    return trace_dir(trace) / PROFILE_FILE
