#!/usr/bin/env bash
# Build DeepSeek's FlashMLA sparse decode and sparse prefill for sm_90a from a FlashMLA source checkout, offline, so
# that `python -m mla.bench` can time it beside mla in the same run (book/running.md).
#
#   bash scripts/build_flashmla.sh SRC_DIR [CUTLASS]
#
# SRC_DIR  a FlashMLA checkout (tested at 9241ae3); the extension is built in place, as
#          SRC_DIR/flash_mla/cuda*.so, beside BUILD_INFO.json, which mla.bench puts in its provenance.
# CUTLASS  CUTLASS's sources where SRC_DIR/csrc/cutlass is empty (a checkout without submodules):
#          a CUTLASS source tree, or the nvidia-cutlass 4.2.0.0 wheel, whose cutlass_library/source
#          is that tree. Without it, the installed nvidia-cutlass package's is used.
#
# Only sparse_decode_fwd and sparse_prefill_fwd are registered, so only their sources compile (the
# decode, the scheduler, the combine, the sm_90 prefill and the sm100 stubs their dispatch names):
# about 60 s on 16 cores.
# Then: PYTHONPATH=SRC_DIR:$PYTHONPATH python -m mla.bench --sweep ...
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,14p "$0"; exit 2; }
SRC=$(cd "$1" && pwd)
CUTLASS=${2:-}
[ -f "$SRC/csrc/api/sparse_decode.h" ] || { echo "build_flashmla: $SRC is not a FlashMLA checkout (no csrc/api/sparse_decode.h)" >&2; exit 2; }

SOURCES=(
  csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu
  csrc/smxx/decode/combine/combine.cu
  csrc/sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu
  csrc/sm90/decode/sparse_fp8/instantiations/model1_persistent_h128.cu
  csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu
  csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu
  csrc/sm100/decode/head64/instantiations/v32.cu
  csrc/sm100/decode/head64/instantiations/model1.cu
  csrc/sm100/prefill/sparse/fwd_for_small_topk/head128/instantiations/phase1_decode_k512.cu
  csrc/sm90/prefill/sparse/fwd.cu
  csrc/sm90/prefill/sparse/instantiations/phase1_k512.cu
  csrc/sm90/prefill/sparse/instantiations/phase1_k512_topklen.cu
  csrc/sm90/prefill/sparse/instantiations/phase1_k576.cu
  csrc/sm90/prefill/sparse/instantiations/phase1_k576_topklen.cu
  csrc/sm100/prefill/sparse/fwd/head64/instantiations/phase1_k512.cu
  csrc/sm100/prefill/sparse/fwd/head64/instantiations/phase1_k576.cu
  csrc/sm100/prefill/sparse/fwd/head128/instantiations/phase1_k512.cu
  csrc/sm100/prefill/sparse/fwd/head128/instantiations/phase1_k576.cu
  csrc/sm100/prefill/sparse/fwd_for_small_topk/head128/instantiations/phase1_prefill_k512.cu
)
for f in "${SOURCES[@]}"; do
  [ -f "$SRC/$f" ] || { echo "build_flashmla: $SRC has no $f (this script knows FlashMLA 9241ae3's tree)" >&2; exit 2; }
done

# CUTLASS's headers into csrc/cutlass, where FlashMLA's submodule would be
if [ ! -d "$SRC/csrc/cutlass/include/cutlass" ]; then
  python3 - "$SRC/csrc/cutlass" "$CUTLASS" <<'PY'
import importlib.util, os, pathlib, shutil, sys, tempfile, zipfile
dest, given = pathlib.Path(sys.argv[1]), sys.argv[2]
if given.endswith(".whl"):
    tmp = pathlib.Path(tempfile.mkdtemp())
    with zipfile.ZipFile(given) as z:
        z.extractall(tmp, [n for n in z.namelist() if n.startswith("cutlass_library/source/")])
    src = tmp / "cutlass_library" / "source"
elif given:
    src = pathlib.Path(given)
else:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None:
        sys.exit("build_flashmla: csrc/cutlass is empty; pass CUTLASS (a source tree or the nvidia-cutlass "
                 "wheel) or pip install nvidia-cutlass==4.2.0.0")
    src = pathlib.Path(spec.origin).parent / "source"
if not (src / "include" / "cutlass").is_dir():
    sys.exit(f"build_flashmla: {src} has no include/cutlass")
shutil.rmtree(dest, ignore_errors=True)
shutil.copytree(src, dest, symlinks=True)
print(f"build_flashmla: CUTLASS from {given or src}")
PY
fi

# the API with only the sparse decode registered (FlashMLA's own api.cpp registers every kernel)
cat > "$SRC/csrc/api/api_sparse_decode.cpp" <<'CPP'
// Written by mla's scripts/build_flashmla.sh: FlashMLA's API with only the sparse decode.
#include <pybind11/pybind11.h>

#include "sparse_decode.h"
#include "sparse_fwd.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA (sparse decode only)";
    m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
    m.def("sparse_prefill_fwd", &sparse_attn_prefill_interface);
}
CPP

cd "$SRC"
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-$(nproc)} python3 - "${SOURCES[@]}" <<'PY'
import pathlib, sys
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

here = pathlib.Path.cwd()
nvcc = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
        "--use_fast_math", "-lineinfo", "-gencode", "arch=compute_90a,code=sm_90a", "--threads", "4"]
# under CUDA 13, g++ finds cuda/std/utility (api.cpp's headers) only in CCCL's folder
cxx = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations", "-I/usr/local/cuda/include/cccl"]
inc = [here / "csrc", here / "csrc" / "kerutils" / "include", here / "csrc" / "sm90",
       here / "csrc" / "cutlass" / "include", here / "csrc" / "cutlass" / "tools" / "util" / "include"]
setup(name="flash_mla", packages=["flash_mla"], script_args=["build_ext", "--inplace"],
      ext_modules=[CUDAExtension("flash_mla.cuda", ["csrc/api/api_sparse_decode.cpp", *sys.argv[1:]],
                                 extra_compile_args={"cxx": cxx, "nvcc": nvcc}, include_dirs=[str(p) for p in inc])],
      cmdclass={"build_ext": BuildExtension})
PY

commit=${FLASHMLA_COMMIT:-$(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || echo unknown)}
python3 - "$SRC/flash_mla/BUILD_INFO.json" "$commit" "$(( $(date +%s) - start ))" "${SOURCES[@]}" <<'PY'
import json, subprocess, sys
out, commit, seconds, sources = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
info = {"commit": commit, "built_by": "mla scripts/build_flashmla.sh", "arch": "sm_90a",
        "registered": ["sparse_decode_fwd", "sparse_prefill_fwd"], "sources": ["csrc/api/api_sparse_decode.cpp", *sources],
        "nvcc": nvcc[-1] if nvcc else "unknown", "build_s": seconds}
json.dump(info, open(out, "w"), indent=1)
print(f"build_flashmla: built {out.rsplit('/', 2)[0]}/flash_mla in {seconds} s; {out}")
PY
