"""The autoguidance paper's 2-D example: the fractal Gaussian mixture, its small denoiser, its consistency model
(sCM), their scoring by the exact density and their snapshot files."""
