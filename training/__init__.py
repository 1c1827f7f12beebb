"""Training-only code: presets, the training loop and training-state checkpoints."""
