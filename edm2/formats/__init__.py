"""File formats of networks: our safetensors snapshots and the release's pickles, read without running
their code."""
