"""page_qa's reader: `python -m benchmarks.studies.reader.bench` (see bench.py), its rule chosen by rules.py."""
