"""Dev tool (GPU): the decode's time at several share sizes of the work list, per shape, to fit
the cost model of :mod:`mla.schedule` (its constants per piece and per split piece) to the
H200. Shapes without lengths only (with lengths the kernels cut the list on the device).
Each point is the call's CUDA-graph time with the programs forced (``mla.plan(programs=...)``),
beside the share the launch rule picks.

    python experiments/share_probe.py OUT.json [--budget-s S]
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
from mla import bench, dispatch, schedule  # noqa: E402
from mla.kernels import combine  # noqa: E402


def shapes():
    out = [s for s in bench.spec_shapes() if s.h_q >= 64]
    for h_q in (64, 128):
        for s_q in (1, 2):
            for name in ("DSA", "CSA"):
                cfg = bench.SWEEP_CONFIGS[name]
                out += [bench.Shape(f"sweep {name}", b, s_q, h_q, **cfg) for b in (2, 8, 32, 74, 148, 256)]
    return out


def candidate_shares(n_q, units, slots):
    """Share sizes like those the model weighs (:func:`mla.schedule.choose_cut`), each query cut
    into 1 to 8 pieces, and the equal cut over every slot; forced as program counts, each is
    run as balanced shares of about that size."""
    least = schedule.cdiv(n_q * units, slots)
    out = {schedule.cdiv(n_q, slots) * units, least}
    out.update(schedule.cdiv(units, m) for m in range(1, min(units, 8) + 1) if schedule.cdiv(units, m) >= least)
    return sorted(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--combine", help="the combine's launch as NUM_WARPS,NUM_STAGES (experiments/combine_probe.py)")
    a = ap.parse_args(argv)
    if a.combine:
        combine.NUM_WARPS, combine.NUM_STAGES = map(int, a.combine.split(","))
    if mla.INTERPRET:
        sys.exit("share_probe: needs a CUDA GPU")
    t0 = time.time()
    dev = torch.device("cuda")
    sms = dispatch.sm_count(dev)
    pools, rows = {}, []
    for s in shapes():
        if time.time() - t0 > a.budget_s:
            break
        case = bench.Case(s, dev, pool_bytes=1e9, n_sets=8, pools=pools)
        chosen = case.caller("mma").plan
        cfg = chosen.launch.config
        heads = dispatch._cdiv(s.h_q, cfg.block_h) * getattr(cfg, "dv_halves", 1)
        n_q = s.b * s.s_q
        units = dispatch._units(cfg, s.topk, s.extra_topk)
        if getattr(cfg, "two_consumers", False):
            continue
        for share in candidate_shares(n_q, units, max(1, sms // heads)):
            call = case.caller("mma", programs=schedule.cdiv(n_q * units, share))
            plan = call.plan
            us = bench.time_graph(case, call)
            rows.append({"shape": s.name, "b": s.b, "s_q": s.s_q, "h_q": s.h_q, "units": units, "n_q": n_q,
                         "heads_blocks": heads, "form": cfg.label, "programs": plan.launch.programs,
                         "share": plan.launch.share, "chosen": plan.launch.programs == chosen.launch.programs,
                         "us_graph": round(us, 2)})
            print(rows[-1], flush=True)
        del case
    write_rows(a.out, rows, dev, combine=[combine.NUM_WARPS, combine.NUM_STAGES], seconds=round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
