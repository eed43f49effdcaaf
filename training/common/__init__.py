"""What the benchmarks share: run_scripts (the two training scripts), experiments (runs of them), ega and chiar (the
two families' runs and tables), data, plots, model cards, the command line."""
