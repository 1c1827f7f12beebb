"""EDM2: magnitude-preserving diffusion models (Karras et al., CVPR 2024) in plain PyTorch.

The paper sits at the top: errors; the model (layers, networks, network_args, loss, sampler, phema, encoders,
families: the registry of network families, architectures (every registered family));
and procedures (the procedures over its files: posthoc, anyema, generation, presets_generate, image_batches,
image_grid).
The infrastructure is grouped by job: runtime (atomic files, downloads, locks, processes, speed settings),
data (datasets), formats (network files, ours and the release's), toy (the autoguidance paper's 2-D example),
eval (detectors, metrics, validation loss, sweeps, magnitudes, flops) and plots (every figure).

Layers, low to high; a module imports only its own layer or lower (tests/test_structure.py): errors, the model,
runtime, data, formats, toy, the procedures, eval, plots.
"""
