"""specpilot.envs"""
