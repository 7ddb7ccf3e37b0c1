"""Decisions, in plain Python/numpy and tested without a Trainer: power-limit search, precision, batch size."""
