"""Gymnasium spaces matching the policies' observation layout (`specpilot.policies.observation`)."""
from __future__ import annotations

import gymnasium as gym
import numpy as np

from specpilot.policies.observation import ObservationSpec


def observation_space(spec: ObservationSpec) -> gym.spaces.Box:
    """Box matching the layout (bounds exact, so check_env and SB3 agree with the features)."""
    n = spec.num_scores
    slots = spec.scalar_start - n  # the mask, and the candidates' depths where the spec has them: in [0, 1]
    low = np.concatenate([np.full(n, -1.0), np.zeros(slots), np.zeros(spec.num_scalars)]).astype(np.float32)
    high = np.concatenate([np.zeros(n), np.ones(slots), np.ones(spec.num_scalars)]).astype(np.float32)
    return gym.spaces.Box(low=low, high=high, dtype=np.float32)
