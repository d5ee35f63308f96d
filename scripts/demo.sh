#!/usr/bin/env bash
# The quick-start demo: install, then a small RAG loop on the embedded model with cache readouts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m pagedrag demo "$@"
