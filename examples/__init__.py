"""Examples of alltoall_ops, run from the repo root (``python -m examples.demo``); not installed."""
