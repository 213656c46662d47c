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


def profile_path(trace: str | Path) -> Path:
    """The profile.json of the trace at `trace` (its folder or its trace.npz)."""
    return trace_dir(trace) / PROFILE_FILE
