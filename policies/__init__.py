"""Controllers: everything that decides draft depth and verification size (one interface for all)."""
from specpilot.policies.base import Controller, FixedController, default_static_config

__all__ = ["Controller", "FixedController", "default_static_config"]
