"""specpilot.train"""
