"""Image and latent datasets: reading, writing, converting, transforming and VAE-encoding them, and the
coloured-shapes demo data."""
