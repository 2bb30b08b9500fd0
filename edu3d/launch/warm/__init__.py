"""Warm ranks: a pool kept alive in a notebook's kernel, its fork server and its ranks."""
