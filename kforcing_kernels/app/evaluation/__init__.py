"""Evaluation: per-position NLL, speed, judge perplexity (``kforcing-evaluate``), their report, and the Stage-1 noise
diagnosis."""
