"""Data parallelism: four versions of DDP and gradient compression."""
