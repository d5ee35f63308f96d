#!/usr/bin/env bash
# The test suite, as CI runs it: install with test extras, then pytest over every test folder.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest "$@"
