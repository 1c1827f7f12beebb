"""The autoguidance paper's 2-D example: the fractal Gaussian mixture, its small denoiser and its snapshot
files."""
