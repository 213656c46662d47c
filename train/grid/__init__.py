"""Grid search for the best static (depth, size) configuration: the baseline a learned policy must beat."""
