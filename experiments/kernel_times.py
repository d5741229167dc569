"""Dev tool (GPU): each kernel's GPU time per call, from the torch profiler, at a few record
shapes, for ``mma`` and ``tl_dot``: which kernel of a call (the decode or the combine) moved
between two versions. Run once per version (PYTHONPATH picks the package) and compare the JSON.

    python experiments/kernel_times.py OUT.json
"""
import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402

from mla import bench  # noqa: E402

SHAPES = [("DSA", 1), ("DSA", 8), ("DSA", 128), ("V4-CSA", 1), ("V4-CSA", 32)]


def kernel_us(case, call, calls=32):
    for i in range(8):
        call(i % len(case.index_sets))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            call(i % len(case.index_sets))
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            out[e.key[:60]] = round(t / calls, 2)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the JSON file to write")
    ap.add_argument("--producer-regs", type=int, help="the Gluon producer partition's registers (a probe; "
                    "the shipped value is mla.kernels.gluon_sm90.kernel.PRODUCER_REGS)")
    a = ap.parse_args(argv)
    if mla.INTERPRET:
        sys.exit("kernel_times: needs a CUDA GPU; here mla runs Triton's CPU interpreter")
    if a.producer_regs:
        from mla.kernels.gluon_sm90 import kernel as gluon_kernel
        gluon_kernel.PRODUCER_REGS = a.producer_regs
    shapes = {(s.name, s.b): s for s in bench.spec_shapes()}
    rows = []
    for key in SHAPES:
        case = bench.Case(shapes[key], torch.device("cuda"), pool_bytes=1e9, n_sets=8)
        for impl in ("mma", "tl_dot"):
            call = case.caller(impl)
            rows.append({"shape": key[0], "b": key[1], "impl": impl, "kernels": kernel_us(case, call),
                         "launch": str(getattr(getattr(call, "plan", None), "launch", ""))[:300]})
            print(rows[-1], flush=True)
        del case
    pathlib.Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
