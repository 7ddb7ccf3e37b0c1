"""Measurement, with no Lightning import: sensors -> the sampler thread -> cumulative series (the attribution
rule) -> the meter's marks and windows; clocks, and the merge of figures across ranks."""
