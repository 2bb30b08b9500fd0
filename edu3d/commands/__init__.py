"""One module per ``edu3d`` subcommand."""
