"""Benchmarks for celery-lease: plain scripts, run with ``python -m benchmarks.run_all``."""
