"""Controllers: everything that decides draft depth and verification size (one interface for all)."""
from specpilot.policies.base import Controller, FixedController, default_static_config
from specpilot.policies.heuristics import (
    HEURISTICS,
    ConfidenceController,
    DDDController,
    GammaTuneController,
    HFHeuristicController,
    SVIPController,
    make_heuristic,
)

__all__ = [
    "Controller", "FixedController", "default_static_config",
    "HEURISTICS", "make_heuristic", "DDDController", "SVIPController", "ConfidenceController",
    "HFHeuristicController", "GammaTuneController",
    "PPOController", "load_run_controllers",
]


def __getattr__(name: str):
    # PPO pieces load lazily: they pull in gymnasium/SB3 and specpilot.envs, which the decoder alone never needs
    # (and importing envs from here eagerly would risk an import cycle with envs that import policies).
    if name in ("PPOController", "load_run_controllers"):
        from specpilot.policies import ppo

        return getattr(ppo, name)
    raise AttributeError(f"module 'specpilot.policies' has no attribute {name!r}")
