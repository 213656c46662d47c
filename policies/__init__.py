"""Controllers: everything that decides draft depth and verification size (one interface for all)."""
from specpilot.drafting.control import Controller, FixedController, default_static_config
from specpilot.policies.heuristics import (
    HEURISTICS,
    BatchGuardController,
    BatchTableController,
    ConfidenceController,
    DDDController,
    GammaTuneController,
    HFHeuristicController,
    RandomDepthController,
    SpeculateBelowBatch,
    SVIPController,
    make_heuristic,
)
from specpilot.policies.learned import LearnedController
from specpilot.policies.ppo import PPOController, load_run_controllers

__all__ = [
    "Controller", "FixedController", "default_static_config",
    "HEURISTICS", "make_heuristic", "DDDController", "SVIPController", "ConfidenceController",
    "HFHeuristicController", "GammaTuneController", "RandomDepthController", "BatchTableController",
    "SpeculateBelowBatch", "BatchGuardController",
    "LearnedController", "PPOController", "load_run_controllers",
]
