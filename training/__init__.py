"""Training only. The recipe in plain sight: options and presets, the architecture's options, the learning-rate
schedule, the data order, the training state and step; the run machinery (run directory, locks, checkpoints,
outputs, dashboard, trackers, grids, dry run, preflight) and the loop driving it (the life of a run) are
training.run."""
