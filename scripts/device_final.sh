#!/usr/bin/env bash
# The GPU runs that a change must pass, in parts, each under its own time limit, writing under
# $OUT (or ./out): the test suite on the GPU, the GPU validation sweep, the benchmark record, the
# serving figures, and the chapters through papermill with SMALL=False. Needs .whl carried for the
# notebooks (../shared/device/notebook-wheels.sh). FlashMLA is timed beside mla when its package
# (flash_mla) imports: put it on PYTHONPATH, and name what was built in FLASHMLA_COMMIT and
# FLASHMLA_FLAGS.
#   MLA_COMMIT=<sha> bash scripts/device_final.sh [PART...]
# PART: flashmla (build FLASHMLA_SRC, default .flashmla, a FlashMLA checkout with the nvidia-cutlass
# wheel in it, into /tmp/fm, with FLASHMLA_BUILD, default scripts/build_flashmla.sh, and time it
# beside mla in the later parts; once built it is reused while the machine stays warm), tests, gpu (the GPU tests
# alone; GPU_TESTS_K a -k filter, GPU_TESTS_PATHS the test files, default all: tests/test_gpu.py needs no .whl), validation (VALIDATION_IMPLS: --impls), bench, sweep (SWEEP_ARGS:
# more of its arguments, e.g. --impl and --h-q), sweep_v32 (DeepSeek-V3.2's cache), timeline (the
# Gluon kernel's stamped chain), prefill (the sparse prefill beside FlashMLA's), suites (FlashMLA's
# own prefill and decode test files against mla, SUITES to choose, SUITE_ARGS_<suite> more of the
# runner's arguments), serving, host, profile (Nsight Compute on PROFILE_IMPLS at
# PROFILE_SHAPES, default the portable kernel's sm_90 and sm_80 code at DSA b 128 and b 8), or a
# notebook path (notebooks/0*.ipynb globs work).
# With no PART it runs all of them (more than one 600 s device call can hold; split it).
# DEADLINE_S (seconds from the start, default 570) skips a part whose limit would pass it.
# TRITON_PACK: a Triton packed by scripts/triton_for_device.sh, unpacked and used instead of the image's.
set -u
START=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-out}; mkdir -p "$OUT/nb"
[ $# -gt 0 ] || set -- tests validation bench serving notebooks/*.ipynb
step() {
  local t=$1; shift; local s=$(date +%s)
  if [ $(( s - START + t )) -gt "${DEADLINE_S:-570}" ]; then echo "=== skipped (limit ${t}s would pass the deadline): $*"; return; fi
  echo "=== $* (limit ${t}s)"; timeout "$t" "$@"; echo "=== rc=$? in $(( $(date +%s) - s ))s"
}
nbsetup() {
  [ -n "${NB_READY:-}" ] && return
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$HOME/nbsite" .whl/*.whl \
    && export PYTHONPATH="$HOME/nbsite:$PYTHONPATH" && python3 -m ipykernel install --user --name python3 >/dev/null
  NB_READY=1
}
if [ -n "${TRITON_PACK:-}" ]; then
  site=/tmp/triton-site-$(basename "$TRITON_PACK" .tar.xz)
  [ -d "$site/triton" ] || python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$TRITON_PACK" "$site"
  # only the backends in its tree (the image's Triton's metadata names an AMD backend the pack leaves out)
  export TRITON_BACKENDS_IN_TREE=1 PYTHONPATH="$site:$PYTHONPATH" TRITON_PTXAS_PATH=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)
  export TRITON_CUOBJDUMP_PATH=$(dirname "$TRITON_PTXAS_PATH")/cuobjdump TRITON_NVDISASM_PATH=$(dirname "$TRITON_PTXAS_PATH")/nvdisasm
  export TRITON_PTXAS_BLACKWELL_PATH=$TRITON_PTXAS_PATH     # Triton 3.9 looks its ptxas up per architecture family
fi
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import triton; print(\"triton\", triton.__version__, triton.__file__)"
  for part in "$@"; do
    case "$part" in
      flashmla) if ls /tmp/fm/flash_mla/cuda*.so >/dev/null 2>&1; then echo "=== flashmla: built earlier on this machine"; \
          export PYTHONPATH="/tmp/fm:$PYTHONPATH"; continue; fi
        rm -rf /tmp/fm && cp -r "${FLASHMLA_SRC:-.flashmla}" /tmp/fm \
        && FLASHMLA_COMMIT=${FLASHMLA_COMMIT:-9241ae3} step "${FLASHMLA_S:-150}" bash "${FLASHMLA_BUILD:-scripts/build_flashmla.sh}" /tmp/fm $(ls /tmp/fm/nvidia_cutlass-*.whl 2>/dev/null) \
        && export PYTHONPATH="/tmp/fm:$PYTHONPATH" ;;
      tests) nbsetup      # the chapter tests import nbformat
        step "${TESTS_S:-300}" python3 -m pytest -q -m "not slow" -p no:cacheprovider -rfE ;;
      gpu) nbsetup
        step "${GPU_TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} ${GPU_TESTS_PATHS:-} ;;
      validation) step "${VALIDATION_S:-240}" python3 scripts/gpu_validation.py --out "$OUT/val" \
        --budget-s "${VALIDATION_BUDGET_S:-150}" ${VALIDATION_IMPLS:+--impls "$VALIDATION_IMPLS"} ;;
      bench) step "${BENCH_S:-330}" python3 -m mla.bench --repeat 3 --out "$OUT/res" --no-progress ;;
      sweep) step "${SWEEP_S:-200}" python3 -m mla.bench --sweep --budget-s "${SWEEP_BUDGET_S:-150}" --out "$OUT/res" \
        --no-progress ${SWEEP_ARGS:-} ;;
      sweep_v32) step "${SWEEP_V32_S:-120}" python3 -m mla.bench --sweep --v32 --budget-s "${SWEEP_V32_BUDGET_S:-90}" \
        --out "$OUT/res" --no-progress ;;
      timeline) step "${TIMELINE_S:-150}" python3 experiments/gluon_timeline.py --out "$OUT/gluon_timeline.json" ;;
      prefill) step "${PREFILL_S:-180}" python3 -m mla.bench --prefill --budget-s "${PREFILL_BUDGET_S:-120}" \
        --out "$OUT/res" --no-progress ;;
      suites) for suite in ${SUITES:-prefill decode}; do extra="SUITE_ARGS_$suite"
          step "${SUITES_S:-150}" python3 scripts/flashmla_tests.py "${FLASHMLA_SRC:-.flashmla}" --suite "$suite" \
            --flashmla-commit "${FLASHMLA_COMMIT:-9241ae3}" --out "$OUT/flashmla_$suite.json" ${!extra:-}
        done ;;
      host) step 60 python3 -m mla.bench --host ;;
      serving) step "${SERVING_S:-120}" python3 -m mla.bench --serving --out "$OUT/res" ;;
      profile) mkdir -p "$OUT/ncu"
        for impl in ${PROFILE_IMPLS:-tl_dot tl_dot_sm80}; do for shape in ${PROFILE_SHAPES:-DSA:128 DSA:8}; do
          step "${PROFILE_S:-90}" env IMPL="$impl" SHAPE="$shape" CALLS=6 ncu --clock-control none -k regex:"tl_dot|gluon_portable" \
            --launch-skip 3 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
            --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
            --section ComputeWorkloadAnalysis --section InstructionStats python3 experiments/profile_call.py \
            > "$OUT/ncu/${impl}_${shape/:/_b}.txt" 2>&1
          tail -n 4 "$OUT/ncu/${impl}_${shape/:/_b}.txt"
        done; done ;;
      *.ipynb) nbsetup
        step "${NOTEBOOK_S:-200}" python3 -m papermill "$part" "$OUT/nb/$(basename "$part")" -k python3 --cwd notebooks \
          -p SMALL False ;;
      *) echo "unknown part: $part"; exit 2 ;;
    esac
  done
} 2>&1 | tee -a "$OUT/log.txt"
if [ -n "$(ls "$OUT/nb" 2>/dev/null)" ]; then tar -C "$OUT" -czf "$OUT/notebooks_gpu.tgz" nb; fi
rm -rf "$OUT/nb"
