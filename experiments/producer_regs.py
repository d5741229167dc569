"""Dev tool (GPU): the Gluon kernel's one-consumer forms at several producer register counts.

The work list's per-query loop keeps more values live in both partitions than the one-query
kernel did; compiled ahead of time, the producer partition at 40 registers spills (24-96 bytes,
two local loads in its tile loop). Each variant sets
:data:`mla.kernels.gluon_sm90.kernel.PRODUCER_REGS` (the consumers get what is left), is checked
bitwise against the shipped count's output (registers do not change the arithmetic), and timed
as CUDA graphs, the variants interleaved, median of rounds.

    python experiments/producer_regs.py OUT.json [--regs 40,48,56] [--rounds 3]
"""
import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402

from experiments import write_rows  # noqa: E402
from mla import bench  # noqa: E402
from mla.kernels.gluon_sm90 import kernel as gluon_kernel  # noqa: E402


def shapes():
    out = list(bench.spec_shapes())
    for name, b, h_q in (("DSA", 64, 128), ("HCA", 74, 64), ("CSA", 148, 128)):
        out.append(bench.Shape(f"sweep {name}", b, 1, h_q, **bench.SWEEP_CONFIGS[name]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--regs", default="40,48,56")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    if mla.INTERPRET:
        sys.exit("producer_regs: needs a CUDA GPU")
    regs = [int(x) for x in a.regs.split(",")]
    t0 = time.time()
    dev = torch.device("cuda")
    pools, rows = {}, []
    for s in shapes():
        case = bench.Case(s, dev, pool_bytes=1e9, n_sets=8, pools=pools)
        calls, ref = {}, None
        for r in regs:
            gluon_kernel.PRODUCER_REGS = r
            calls[r] = case.caller("mma")
            out, lse = calls[r](0)
            if ref is None:
                ref = (out.clone(), lse.clone())
            same = torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
            if not same:
                print(f"MISMATCH {s.name} b{s.b} regs {r}", flush=True)
            calls[r].same = same
        times = {r: [] for r in regs}
        for _ in range(a.rounds):
            for r in regs:
                times[r].append(bench.time_graph(case, calls[r]))
        row = {"shape": s.name, "b": s.b, "s_q": s.s_q, "h_q": s.h_q, "form": calls[regs[0]].plan.launch.label,
               **{f"us_{r}": round(statistics.median(times[r]), 2) for r in regs},
               "bitwise_same": all(calls[r].same for r in regs)}
        rows.append(row)
        print(row, flush=True)
        del case, calls
    gluon_kernel.PRODUCER_REGS = regs[0]
    write_rows(a.out, rows, dev, regs=regs, seconds=round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
