"""Dev tool (GPU): run one call, of the decode or of a gather probe, a few times on the record's
inputs, for a profiler (Nsight Compute) to catch one launch of it. SHAPE (e.g. V4-TP8:128),
KIND (decode, or gather with gather_ceiling's options in OPTS, e.g. "bt=4,warps=4,splits=20"),
IMPL (with KIND=decode: one of mla.bench's impls, e.g. tl_dot or tl_dot_sm80, planned once as the
sweep times it; default the unplanned mma call), ORDER (random or runs, as in
gather_ceiling.sweep), CALLS. For example:

    ncu --clock-control none -k regex:gluon_decode --launch-skip 4 --launch-count 1 \\
        --section SpeedOfLight python3 experiments/profile_call.py
"""
import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402

from experiments import gather_ceiling as G  # noqa: E402
from mla import bench  # noqa: E402
from mla.bench import Case  # noqa: E402


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if mla.INTERPRET:
        sys.exit("profile_call: needs a CUDA GPU; here mla runs Triton's CPU interpreter")
    shapes = {f"{s.name}:{s.b}": s for s in bench.spec_shapes() if s.s_q == 1}
    case = Case(shapes[os.environ.get("SHAPE", "V4-TP8:128")], torch.device("cuda"), pool_bytes=2e9, n_sets=16)
    if os.environ.get("ORDER", "random") == "runs":
        case.index_sets, case.extra_sets = G.stream_runs(case)
    opts = {k: int(v) for k, v in (o.split("=") for o in os.environ.get("OPTS", "").split(",") if o)}
    kind, impl, calls = os.environ.get("KIND", "decode"), os.environ.get("IMPL"), int(os.environ.get("CALLS", "8"))
    if kind == "decode" and impl:
        call = case.caller(impl)
        for i in range(calls):
            call(i % len(case.index_sets))
    else:
        fn = G.decode if kind == "decode" else G.gather
        for i in range(calls):
            case.call(lambda *a, **k: fn(*a, **k, **opts), i % len(case.index_sets))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
