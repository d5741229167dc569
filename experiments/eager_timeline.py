"""Dev tool (GPU): whether an eager loop runs at the host's pace or the GPU's, per shape.

For ``impl="mma"`` (planned) and FlashMLA at the record's short shapes: the loop's wall time per
call (:func:`mla.bench.time_eager_loop`, no profiler), then the same loop under the torch
profiler (CUPTI): the kernels a call launches, their summed duration per call (the GPU's busy
time), the span from the loop's first kernel to its last per call, and the host's time in the
launch API per call. A loop whose wall time is near the kernels' busy time is GPU-bound (what
would help is fewer or shorter kernels); one far above it is host-bound.

    python experiments/eager_timeline.py OUT.json
"""
import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from experiments import write_rows  # noqa: E402
from mla import bench  # noqa: E402

SHAPES = (("DSA", 1), ("DSA", 8), ("DSA", 128), ("V4-CSA", 1), ("V4-CSA", 32), ("V4-TP8", 1), ("V4-TP8", 32))
LAUNCH_API = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def timeline(case, call, calls: int = 100) -> dict:
    n = len(case.index_sets)
    for i in range(n):
        call(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            call(i % n)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.name not in ("Memset (Device)",) and "Memcpy" not in e.name]
    api = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and e.name in LAUNCH_API]
    starts = [e.time_range.start for e in kernels]
    ends = [e.time_range.end for e in kernels]
    names = sorted({e.name for e in kernels})
    return {"kernels_per_call": round(len(kernels) / calls, 2),
            "kernel_names": [k[:60] for k in names],
            "gpu_busy_us": round(sum(e.time_range.elapsed_us() for e in kernels) / calls, 2),
            "gpu_span_us": round((max(ends) - min(starts)) / calls, 2) if kernels else None,
            "launch_api_us": round(sum(e.time_range.elapsed_us() for e in api) / calls, 2)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--shapes", nargs="*", default=None, help="NAME:B pairs (default: SHAPES)")
    ap.add_argument("--pool-gb", type=float, nargs="*", default=[1.0],
                    help="cache pool sizes, GB (the benchmark's is 2): each shape is timed at each")
    a = ap.parse_args(argv)
    shapes = SHAPES if a.shapes is None else [(n, int(b)) for n, b in (x.split(":") for x in a.shapes)]
    if mla.INTERPRET:
        sys.exit("eager_timeline: needs a CUDA GPU")
    t0 = time.time()
    dev = torch.device("cuda")
    by_name = {(s.name, s.b): s for s in bench.spec_shapes()}
    pools, rows = {}, []
    for key, gb in ((k, g) for k in shapes for g in a.pool_gb):
        s = by_name[key]
        case = bench.Case(s, dev, pool_bytes=gb * 1e9, n_sets=8, pools=pools.setdefault(gb, {}))
        for impl in ("mma", "flashmla"):
            if impl == "flashmla" and (bench.flash_mla is None or s.h_q not in bench.FLASHMLA_HEADS):
                continue
            call = case.caller(impl)
            row = {"shape": s.name, "b": s.b, "impl": impl, "pool_gb": gb,
                   "us_graph": round(bench.time_graph(case, call), 2),
                   "us_eager_loop": round(bench.time_eager_loop(case, call), 2), **timeline(case, call)}
            rows.append(row)
            print(row, flush=True)
        del case
    write_rows(a.out, rows, dev, seconds=round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
