"""EDM2: magnitude-preserving diffusion models (Karras et al., CVPR 2024) in plain PyTorch."""
