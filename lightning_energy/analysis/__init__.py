"""Offline analysis of finished runs: trace loading, resampling, averaging, fits, plots."""
