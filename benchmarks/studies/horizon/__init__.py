"""The long-horizon study: `python -m benchmarks.studies.horizon.bench` (see bench.py), and its power (power.py)."""
