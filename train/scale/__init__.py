"""Ray: workers that each hold a pair, the `WorkerPool` executor, a VecEnv over them, and the `--ray` CLI wiring."""
