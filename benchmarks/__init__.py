"""The benchmarks, each run from the repository root as `python -m benchmarks.<package>.<module>`: it prints a
table and writes its summary JSON (stamped with the commit and the command: common/records.py) and records under
benchmarks/results/<study>/<run>/ (benchmarks/results/README.md).

    studies/   one package per question a study answers: credit, learning, horizon, reader, rl (the chain),
               research (corpus_qa dev question by question)
    perf/      one-shot performance benches: sub-agents, context, train, sampler, throughput, ray, slow_body,
               gpu_step (one training step on whatever device there is), decode (the in-process decoders),
               image_memory (the server's RSS through a burst of large images)
    common/    what several studies share: `conductor` stages and what episode files say

They sit on top of the tree (tests/test_layout.py): nothing in the runtime packages or app/ imports them; tests do.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The checkout the benchmarks read (examples/) and write under (benchmarks/results/, runs/)."""
