"""Training only. The recipe in plain sight: options and presets, the architecture's options, the learning-rate
schedule, the data order, the training state and step, and the loop (the life of a run); the run machinery
(run directory, locks, checkpoints, outputs, dashboard, trackers, grids, dry run, preflight) is training.run."""
