"""One-shot performance benches, each `python -m benchmarks.perf.<name>` on this machine (numbers from a machine
busy with other work are not comparable): subagents, context, train, sampler, throughput, ray, slow_body."""
