"""moecore: train Mixture-of-Experts language models in plain PyTorch, from one CPU to many GPUs."""

__version__ = "0.1.0"
