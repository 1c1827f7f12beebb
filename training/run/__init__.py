"""The run machinery around the recipe, and the loop that drives it (loop: the life of a run): the run directory
and its lock, training states and snapshots on disk, status lines and logs, signals, the dashboard, trackers
and sample grids, the dry run and the preflight."""
