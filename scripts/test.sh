#!/usr/bin/env bash
# Run every test: unit tests, every notebook through papermill, the book build with warnings
# as errors, and every rendered page opened in headless Chromium. On a machine with no GPU the
# GPU-only tests are skipped (run them on a GPU box).
set -euo pipefail
cd "$(dirname "$0")/.."
# The browser test (tests/test_browser.py) opens the rendered book in Debian's headless Chromium.
# Install it when missing, as root on Linux (as CI runs); elsewhere that test skips.
if [ "$(uname -s)" = Linux ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
   && ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }; then
  echo "test.sh: installing chromium and chromium-driver for the browser test (apt-get)"
  { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
         chromium chromium-driver fonts-dejavu-core fonts-liberation; } >/dev/null \
    || echo "test.sh: could not install chromium; tests/test_browser.py will say so" >&2
fi
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest "$@"
