"""`specpilot export`: a trained run -> decoder.json, safetensors actors and engine configs, with its own checks."""
