"""Training: optimiser and schedule, the model-agnostic loop, run folders."""
