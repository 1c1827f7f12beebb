"""The run machinery around the recipe: the run directory and its lock, training states and snapshots on disk,
status lines and logs, signals, the dashboard, trackers and sample grids, the dry run and the preflight."""
