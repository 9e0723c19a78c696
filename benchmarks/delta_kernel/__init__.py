"""The native diff kernel alone, against the same-run memory baselines (``__main__``)."""
