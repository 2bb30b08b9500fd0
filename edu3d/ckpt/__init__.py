"""Sharded checkpoints: the format, saving and resuming, resharding, export."""
