"""Building the embedded default pair: the code target, its draft LM and its EAGLE-3 head (`specpilot models build`)."""
