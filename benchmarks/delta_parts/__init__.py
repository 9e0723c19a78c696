"""Pushing one part of a delta version: a new transfer per part against one prepared transfer
started with the part's runs (``python -m benchmarks.delta_parts``)."""
