"""Training precision: the modes, the loss probe, the report."""
