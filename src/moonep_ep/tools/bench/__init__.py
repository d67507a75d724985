"""Benchmarks (``moonep-ep bench``, ``scripts/gpu_check.sh``): layout, prefetch, decode, GPU ratios."""
