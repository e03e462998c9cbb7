"""The training chain, base vs SFT vs RL: `python -m benchmarks.studies.rl.bench` (see bench.py); the shipped
default policy against its base model: `python -m benchmarks.studies.rl.default_policy`."""
