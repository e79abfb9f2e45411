"""Benchmarks: python -m bench.heads, python -m bench.serve."""
