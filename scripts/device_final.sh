#!/usr/bin/env bash
# One device call: GPU tests, the GPU validation sweep, every notebook through papermill on the
# GPU, and a reproduction of the MMA record. Writes under $OUT. Needs .whl carried (see
# ../shared/device/notebook-wheels.sh). Usage: MLA_COMMIT=<sha> bash scripts/device_final.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-out}; mkdir -p "$OUT/nb"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$HOME/nbsite" .whl/*.whl \
  && export PYTHONPATH="$HOME/nbsite:$PWD" && python3 -m ipykernel install --user --name python3 >/dev/null
step() { local t=$1; shift; echo "=== $* (limit ${t}s)"; local s=$(date +%s); timeout "$t" "$@"; echo "=== rc=$? in $(( $(date +%s) - s ))s"; }
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  step 150 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_kernels.py -p no:cacheprovider
  step 200 python3 scripts/gpu_validation.py
  for nb in notebooks/0*.ipynb; do
    step 200 python3 -m papermill "$nb" "$OUT/nb/$(basename "$nb")" -k python3 --cwd notebooks -p SMALL False
  done
  step 120 python3 -m mla.bench --impl mma --name bench_repro --out "$OUT/repro" --no-eager
} 2>&1 | tee "$OUT/log.txt"
tar -C "$OUT" -czf "$OUT/notebooks_gpu.tgz" nb && rm -rf "$OUT/nb"
