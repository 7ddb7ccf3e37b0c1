"""Offline analysis of finished runs: trace loading, resampling, averaging, fits, plots."""

DEFAULT_RATE_HZ = 4.0  # the GPU power study's resampling rate (Hz); here so the CLI reads it without numpy
