"""Gymnasium environments over the live decoder and over recorded traces (counterfactual replay).

Importing this package registers (the environment module itself loads only when an env is made):

    specpilot/Depth-v0        live: skip/continue/stop decisions of every cycle     live_depth_env
    specpilot/Size-v0         live: verification size per cycle                     live_size_env
    specpilot/ReplayDepth-v0  replay of a trace (`specpilot record`), same spaces    replay_depth_env
    specpilot/ReplaySize-v0   replay of a trace, same spaces                        replay_size_env

    import gymnasium as gym, specpilot.envs
    env = gym.make("specpilot/ReplaySize-v0", trace="runs/demo/traces/train", depth_controller=(1, 8))

All four are `DepthEnv` / `SizeEnv` (specpilot.envs.environments) over a live or a replay session source. The live
environments are registered `nondeterministic=True`: their rewards are wall-clock measurements.
"""
from gymnasium.envs.registration import register, registry

ENV_IDS = {
    "specpilot/Depth-v0": ("specpilot.envs.environments:live_depth_env", True),
    "specpilot/Size-v0": ("specpilot.envs.environments:live_size_env", True),
    "specpilot/ReplayDepth-v0": ("specpilot.envs.environments:replay_depth_env", False),
    "specpilot/ReplaySize-v0": ("specpilot.envs.environments:replay_size_env", False),
}

for _id, (_entry, _nondeterministic) in ENV_IDS.items():
    if _id not in registry:
        register(id=_id, entry_point=_entry, nondeterministic=_nondeterministic, disable_env_checker=False)
