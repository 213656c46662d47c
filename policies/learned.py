"""LearnedController: the decision logic shared by every controller backed by a pair of learned actors.

PPOController (SB3 policies) and ExportedController (safetensors actors) differ only in how an actor turns an
observation into an action index; the observation features, the action meanings (depth: 0 CONTINUE / 1 STOP; size:
an index into `size_actions`) and the static fallback for a missing actor (depth_only / size_only) live here once.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from specpilot.drafting.types import CycleRecord, DraftState
from specpilot.envs.observation import ObservationSpec, depth_observation, size_observation
from specpilot.policies.base import Controller

CONTINUE, STOP = 0, 1  # depth actions

# numpy versions of the activations small actors use (name -> f(x, params)); others keep the torch path
_NUMPY_ACTIVATIONS = {
    "tanh": lambda x, p: np.tanh(x, out=x),
    "relu": lambda x, p: np.maximum(x, 0.0, out=x),
    "leakyrelu": lambda x, p: np.where(x >= 0, x, x * np.float32(p.get("negative_slope", 0.01))),
    "sigmoid": lambda x, p: 1.0 / (1.0 + np.exp(-x)),
    "silu": lambda x, p: x / (1.0 + np.exp(-x)),
    "identity": lambda x, p: x,
}


def numpy_actor(layers: list[tuple]) -> Callable[[np.ndarray], int] | None:
    """argmax-of-logits function for a Linear/activation stack, run with numpy on views of the weights.

    layers: ("linear", weight [out, in] tensor, bias tensor | None) and ("activation", name, params) in order.
    A decision is a few 64-wide matrix-vector products: numpy does one in ~1-2 us where a torch op costs ~5-10 us
    of dispatch, and the depth policy decides after every draft level, so this is most of a decision's latency.
    A decision runs right after a model forward has evicted the caches, where each distinct library call costs
    tens of microseconds (measured cold: one vector-matrix `@` ~60 us, np.einsum ~90 us, a torch linear ~180 us).
    The weights are zero-copy views of the CPU tensors (training updates them in place; the views follow). None
    when a tensor is not on the CPU or an activation has no numpy version (callers keep their torch path)."""
    steps = []
    for layer in layers:
        if layer[0] == "linear":
            weight, bias = layer[1], layer[2]
            if weight.device.type != "cpu" or weight.dtype != torch.float32:
                return None
            w_t = weight.detach().numpy().T  # a view: x @ W.T
            b = None if bias is None else bias.detach().numpy()
            steps.append((w_t, b, None, None))
        else:
            fn = _NUMPY_ACTIVATIONS.get(str(layer[1]).lower())
            if fn is None or not steps:
                return None
            w_t, b, _, _ = steps[-1]
            steps[-1] = (w_t, b, fn, layer[2] if len(layer) > 2 else {})

    def act(obs: np.ndarray) -> int:
        x = obs
        for w_t, b, fn, params in steps:
            x = x @ w_t
            if b is not None:
                x += b
            if fn is not None:
                x = fn(x, params)
        return int(x.argmax())

    return act


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
