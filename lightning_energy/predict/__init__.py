"""Prediction: the in-run forecast, the pre-run estimate, FLOPs and device peaks."""
