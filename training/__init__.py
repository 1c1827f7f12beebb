"""Training-only code: options and presets, the learning-rate schedule, data order, the training step,
the run directory (lock, resume, training states, snapshots) and the loop."""
