"""Exit statuses of the recipes (a module without imports: the recipes read it before torch is loaded)."""

EXIT_INTERRUPTED = 3  # a recipe that stopped with a checkpoint (signal or --stop_after_steps); rerun to resume
