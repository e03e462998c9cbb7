"""Plate reading by country: `python -m benchmarks.studies.plates.bench` (bench.py) plays the scripted expert or
a policy on plate_reading photos; one episode becomes a record and the records a table per country and split
(records.py)."""
