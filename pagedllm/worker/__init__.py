"""Execution: turns scheduler outputs into tensors, runs the model, samples. Decides nothing."""
