"""Memory formulas, the per-rank estimator and the layout search; hardware profiles and
published measured runs, as cited data files under data/."""
