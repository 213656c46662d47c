"""specpilot.eval"""
