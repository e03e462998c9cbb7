"""A learning curve that rises: `python -m benchmarks.studies.learning.bench` (see bench.py)."""
