"""Results and reports: the trials table, the Pareto front and its plots, MLflow runs and the links to them,
comparisons, timelines and nightly sweeps."""
