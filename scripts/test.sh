#!/usr/bin/env bash
# Run every test: unit tests, every notebook through papermill, and the book build with warnings
# as errors. On a machine with no GPU the GPU-only tests are skipped (run them on a GPU box).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest "$@"
