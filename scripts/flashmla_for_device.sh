#!/usr/bin/env bash
# Pack DeepSeek's FlashMLA source, with the CUTLASS headers its build needs, small enough to travel
# with one device call beside Triton 3.9's pack (scripts/triton_for_device.sh):
#
#   bash scripts/flashmla_for_device.sh [FLASHMLA_CHECKOUT]     # here, once: writes .flashmla/
#   FLASHMLA_SRC=.flashmla bash scripts/device_final.sh flashmla ...   # there, carrying .flashmla
#
# A device call carries 64 MiB with the working tree (about 17 MiB) and Triton's pack (about
# 40 MiB). FlashMLA 9241ae3's tree is 1.7 MB, of which its tests (which scripts/flashmla_tests.py
# runs) stay and its docs and benchmarks go; the nvidia-cutlass 4.2.0.0 wheel is 6.4 MB, of which
# scripts/build_flashmla.sh reads only the headers (cutlass_library/source/include and
# tools/util/include), 3.3 MB compressed. Without FLASHMLA_CHECKOUT, FlashMLA is cloned from
# GitHub. Needs git and pip.
set -euo pipefail
cd "$(dirname "$0")/.."
COMMIT=${FLASHMLA_COMMIT:-9241ae3}
grep -qxF '/.flashmla/' .git/info/exclude 2>/dev/null || echo '/.flashmla/' >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src=${1:-}
if [ -z "$src" ]; then
  git clone -q https://github.com/deepseek-ai/FlashMLA "$work/FlashMLA"
  src="$work/FlashMLA"
fi
rm -rf .flashmla && mkdir -p .flashmla
git -C "$src" archive "$COMMIT" | tar -x -C .flashmla
rm -rf .flashmla/docs .flashmla/benchmark
python3 -m pip download -q --no-deps nvidia-cutlass==4.2.0.0 -d "$work" 2>&1 | grep -v '^WARNING' || true
python3 - "$work"/nvidia_cutlass-4.2.0.0-py3-none-any.whl .flashmla/nvidia_cutlass-4.2.0.0-py3-none-any.whl <<'PY'
import sys, zipfile
keep = ("cutlass_library/source/include/", "cutlass_library/source/tools/util/include/")
with zipfile.ZipFile(sys.argv[1]) as full, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
    for info in full.infolist():
        if info.filename.startswith(keep):
            out.writestr(info, full.read(info.filename))
PY
du -sh .flashmla
