"""Inference benchmarks: AR vs k-token decoding, contiguous vs paged cache."""
