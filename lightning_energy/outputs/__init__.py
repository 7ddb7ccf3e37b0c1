"""What a run leaves behind: the report, the trace, TensorBoard extras, per-operator energy; the output worker."""
