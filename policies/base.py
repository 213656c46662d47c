"""The Controller interface and the static configuration (defined in `specpilot.drafting.control`, beside the cycle
that drives them; re-exported here with the other controllers)."""
from specpilot.drafting.control import Controller, FixedController, default_static_config

__all__ = ["Controller", "FixedController", "default_static_config"]
