#!/usr/bin/env bash
# Pack a Triton newer than the GPU image's (3.6) small enough to travel with one device call.
#
#   bash scripts/triton_for_device.sh [VERSION]        # here, once: writes .triton/triton-VERSION.tar.xz
#   TRITON_PACK=.triton/triton-VERSION.tar.xz bash scripts/device_final.sh PART...   # there, carrying .triton
#
# The wheel for the device's Python (3.12, abi3) is about 285 MB and its libtriton.so about 500 MB,
# more than a call carries (64 MiB with the working tree). Stripped of its symbols libtriton.so is
# 192 MB, and xz takes it to about 40 MB. Left out: the AMD backend, the profiler's library and
# CUPTI, and the bundled ptxas, cuobjdump and nvdisasm: the device's CUDA toolkit has its own,
# which device_final.sh names in TRITON_PTXAS_PATH and friends (and Triton then emits the
# PTX version that ptxas reads). FlashMLA travels beside it from scripts/flashmla_for_device.sh
# (5 MB). Needs pip, binutils' strip and xz.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-3.9.0}
grep -qxF '/.triton/' .git/info/exclude 2>/dev/null || echo '/.triton/' >> .git/info/exclude
mkdir -p .triton
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$work" "triton==$VERSION" 2>&1 | grep -v '^WARNING' || true
python3 -m zipfile -e "$work"/triton-"$VERSION"-*.whl "$work/site"
t="$work/site/triton"
rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/lib/cupti-blackwell" \
  "$t/backends/nvidia/bin" "$t/_C/libproton.so" "$t/FileCheck"
strip --strip-unneeded "$t/_C/libtriton.so"
tar -C "$work/site" -cf - triton "triton-$VERSION.dist-info" | xz -9 -T0 > ".triton/triton-$VERSION.tar.xz"
ls -l ".triton/triton-$VERSION.tar.xz"
