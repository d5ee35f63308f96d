#!/usr/bin/env bash
# The test suite, as CI runs it: install with test extras, then pytest over every test folder,
# in two pytest-xdist workers of one core each (conftest.py says how they share the work).
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -m "not slow"   # the fast lane: unit, property and kernel tests
# Extra arguments go to pytest; -p no:xdist runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder --durations=15 "$@"
