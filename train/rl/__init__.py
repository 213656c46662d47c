"""The LTD policies: replay traces, PPO stages, behaviour cloning from the oracle, co-adaptation, seeds, validation."""
