#!/usr/bin/env bash
# GPU checks in one device call, writing under $OUT: the GPU tests, the GPU validation sweep,
# notebooks through papermill on the GPU, and a reproduction of the MMA record. Needs .whl carried
# for the notebooks (see ../shared/device/notebook-wheels.sh).
#   MLA_COMMIT=<sha> bash scripts/device_final.sh [PART...]
# PART is one of: tests, validation, bench, or a notebook path (notebooks/0*.ipynb globs work).
# With no PART it runs all of them (more than one 600 s device call can hold; split it).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-out}; mkdir -p "$OUT/nb"
[ $# -gt 0 ] || set -- tests validation notebooks/0*.ipynb bench
step() { local t=$1; shift; echo "=== $* (limit ${t}s)"; local s=$(date +%s); timeout "$t" "$@"; echo "=== rc=$? in $(( $(date +%s) - s ))s"; }
nbsetup() {
  [ -n "${NB_READY:-}" ] && return
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$HOME/nbsite" .whl/*.whl \
    && export PYTHONPATH="$HOME/nbsite:$PWD" && python3 -m ipykernel install --user --name python3 >/dev/null
  NB_READY=1
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for part in "$@"; do
    case "$part" in
      tests) step 300 python3 -m pytest -q tests/test_gpu.py tests/test_kernels.py -p no:cacheprovider ;;
      validation) step 300 python3 scripts/gpu_validation.py ;;
      bench) step 150 python3 -m mla.bench --impl mma --name bench_repro --out "$OUT/repro" --no-eager ;;
      *.ipynb) nbsetup
        step 200 python3 -m papermill "$part" "$OUT/nb/$(basename "$part")" -k python3 --cwd notebooks -p SMALL False ;;
      *) echo "unknown part: $part"; exit 2 ;;
    esac
  done
} 2>&1 | tee -a "$OUT/log.txt"
tar -C "$OUT" -czf "$OUT/notebooks_gpu.tgz" nb && rm -rf "$OUT/nb"
