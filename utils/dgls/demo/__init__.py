"""The embedded default: a tiny diffusion transformer, synthetic data, and a DeepSpeed run."""
