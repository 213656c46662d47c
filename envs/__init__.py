"""Gymnasium environments over the live decoder and over recorded traces (counterfactual replay).

Importing this package registers (the environment modules themselves load only when an env is made):

    specpilot/Depth-v0        live: CONTINUE/STOP after every draft forward          specpilot.envs.live:DepthEnv
    specpilot/Size-v0         live: verification size per cycle                      specpilot.envs.live:SizeEnv
    specpilot/ReplayDepth-v0  replay of a trace (`specpilot record`), same spaces    specpilot.envs.replay:ReplayDepthEnv
    specpilot/ReplaySize-v0   replay of a trace, same spaces                         specpilot.envs.replay:ReplaySizeEnv

    import gymnasium as gym, specpilot.envs
    env = gym.make("specpilot/ReplaySize-v0", trace="runs/record/train", depth_controller=(1, 12))

The live environments are registered `nondeterministic=True`: their rewards are wall-clock measurements.
"""
from gymnasium.envs.registration import register, registry

ENV_IDS = {
    "specpilot/Depth-v0": ("specpilot.envs.live:DepthEnv", True),
    "specpilot/Size-v0": ("specpilot.envs.live:SizeEnv", True),
    "specpilot/ReplayDepth-v0": ("specpilot.envs.replay:ReplayDepthEnv", False),
    "specpilot/ReplaySize-v0": ("specpilot.envs.replay:ReplaySizeEnv", False),
}

for _id, (_entry, _nondeterministic) in ENV_IDS.items():
    if _id not in registry:
        register(id=_id, entry_point=_entry, nondeterministic=_nondeterministic, disable_env_checker=False)
