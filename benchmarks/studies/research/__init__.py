"""The research assistant on corpus_qa dev, question by question: `python -m benchmarks.studies.research.bench`
(bench.py); one episode as a record with its failure category (records.py); tables, paired differences and the
questions a comparison needs (summary.py)."""
