"""Dev tool (GPU): the portable tl.dot kernel forced into a few configs at some record shapes,
CUDA-graph time per call: the shipped table's config and small-grid rule, the small-grid form
at 4 warps (its form before v34, which spills in its token-tile loop ahead of time for sm_90),
and large-grid configs with more stages or smaller token tiles (fewer spills ahead of time).
With --grid, the rule against 32-token tiles at 1 to 3 stages over sweep points (h_q 64 and
128, DSA, CSA and HCA, b 8, 32 and 148): whether the token tile should follow the grid.

    python experiments/tl_dot_forms.py OUT.json [--budget-s S] [--grid]
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

from experiments import write_rows  # noqa: E402
from mla import bench  # noqa: E402
from mla.configs import TlDotConfig  # noqa: E402

CONFIGS = {"rule": None,          # the shipped config and small-grid rule (impl "tl_dot")
           "split P.V, 4 warps, 1 stage": TlDotConfig(64, 64, 4, 1, 2),
           "8 warps, 1 stage": TlDotConfig(64, 64, 8, 1, 1),
           "8 warps, 3 stages": TlDotConfig(64, 64, 8, 3, 1),
           "32-token tiles, 8 warps, 3 stages": TlDotConfig(64, 32, 8, 3, 1)}
SHAPES = [("DSA", 1), ("DSA", 8), ("DSA", 128), ("V4-CSA", 32), ("V4-CSA", 128)]
GRID_CONFIGS = {"rule": None, **{f"32-token tiles, 8 warps, {n} stage(s)": TlDotConfig(64, 32, 8, n, 1)
                                 for n in (1, 2, 3)}}


def grid_shapes():
    return [bench.Shape(f"sweep {name}", b, 1, h_q, **bench.SWEEP_CONFIGS[name])
            for h_q in (64, 128) for name in ("DSA", "CSA", "HCA") for b in (8, 32, 148)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--budget-s", type=float, default=90)
    ap.add_argument("--grid", action="store_true", help="the token tile over sweep points")
    a = ap.parse_args(argv)
    if mla.INTERPRET:
        sys.exit("tl_dot_forms: needs a CUDA GPU")
    t0 = time.time()
    dev = torch.device("cuda")
    by_key = {(s.name, s.b): s for s in bench.spec_shapes()}
    shapes, configs = (grid_shapes(), GRID_CONFIGS) if a.grid else ([by_key[k] for k in SHAPES], CONFIGS)
    pools, rows = {}, []
    for s in shapes:
        case = bench.Case(s, dev, pool_bytes=1e9, n_sets=8, pools=pools)
        for name, cfg in configs.items():
            if time.time() - t0 > a.budget_s:
                break
            call = case.caller("tl_dot") if cfg is None else case.caller("mma", config=cfg)
            rows.append({"shape": s.name, "b": s.b, "h_q": s.h_q, "config": name,
                         "launch": str(call.plan.launch)[:200], "us_graph": round(bench.time_graph(case, call), 2)})
            print(rows[-1], flush=True)
        del case
    write_rows(a.out, rows, dev)


if __name__ == "__main__":
    main()
