"""specpilot: learn how much to speculate.

Exact tree speculative decoding (`specpilot.drafting`) steered by controllers (`specpilot.policies`): fixed configs,
published heuristics and PPO policies trained in Gymnasium environments (`specpilot.envs`, `specpilot.train`),
compared on held-out tasks (`specpilot.eval`) and exported to decoder configs.
"""
__version__ = "0.1.0"
