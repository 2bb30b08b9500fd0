"""Benchmarks: edu3d's mechanics timed side by side with PyTorch's own implementations."""
