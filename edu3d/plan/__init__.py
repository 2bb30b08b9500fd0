"""Memory formulas, the per-rank estimator and the layout search."""
