"""LearnedController: the decision logic shared by every controller backed by a pair of learned actors.

PPOController (SB3 policies) and ExportedController (safetensors actors) differ only in how an actor turns an
observation into an action index; the observation features, the action meanings (depth: 0 CONTINUE / 1 STOP; size:
an index into `size_actions`) and the static fallback for a missing actor (depth_only / size_only) live here once.
"""
from __future__ import annotations

import numpy as np

from specpilot.drafting.types import CycleRecord, DraftState
from specpilot.envs.observation import ObservationSpec, depth_observation, size_observation
from specpilot.policies.base import Controller

CONTINUE, STOP = 0, 1  # depth actions


class LearnedController(Controller):
    """Subclasses set depth_spec, size_spec, size_actions and fallback, and implement the two hooks below; a hook
    is only called when `has_depth` / `has_size` is true."""

    depth_spec: ObservationSpec | None
    size_spec: ObservationSpec | None
    size_actions: list[int] | None
    fallback: Controller
    label = "learned"  # what describe() reports for a part decided by an actor

    @property
    def has_depth(self) -> bool:
        raise NotImplementedError

    @property
    def has_size(self) -> bool:
        raise NotImplementedError

    def _depth_action(self, obs: np.ndarray) -> int:
        raise NotImplementedError

    def _size_action(self, obs: np.ndarray) -> int:
        raise NotImplementedError

    def reset(self) -> None:
        self.fallback.reset()

    def should_stop(self, state: DraftState) -> bool:
        if not self.has_depth:
            return self.fallback.should_stop(state)
        return self._depth_action(depth_observation(state, self.depth_spec)) == STOP

    def choose_size(self, state: DraftState) -> int:
        if not self.has_size:
            return self.fallback.choose_size(state)
        return self.size_actions[self._size_action(size_observation(state, self.size_spec))]

    def observe(self, record: CycleRecord) -> None:
        self.fallback.observe(record)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "depth": self.label if self.has_depth else self.fallback.describe(),
            "size": self.label if self.has_size else self.fallback.describe(),
            "depth_spec": self.depth_spec.to_dict() if self.depth_spec else None,
            "size_spec": self.size_spec.to_dict() if self.size_spec else None,
            "size_actions": self.size_actions,
        }
