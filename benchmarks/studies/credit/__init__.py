"""Credit quality against the truth: `python -m benchmarks.studies.credit.bench` (see bench.py)."""
