#!/usr/bin/env bash
# Build the book: set up .venv, execute every notebook (on the GPU if there is one, else on the
# CPU interpreter with small shapes) and render HTML to _build/html.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
jupyter-book build . "$@"
echo "The book is at $(pwd)/_build/html/index.html"
