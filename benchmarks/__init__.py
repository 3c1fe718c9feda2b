"""Benchmarks of alltoall_ops, run from the repo root (``python -m benchmarks.bench``); not installed."""
