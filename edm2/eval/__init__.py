"""Measuring models: detectors, statistics files, FID and FD_DINOv2, the validation loss, EMA-length
sweeps, magnitudes, flops and benchmarks."""
