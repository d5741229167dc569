"""Dev tool (GPU): the combine's GPU time (torch profiler) at a few shapes whose queries are
split into few or many pieces, for the shipped kernel and two rejected forms of its loop over
the pieces (below), over its launch's warps and pipeline stages (``combine.NUM_WARPS``,
``combine.NUM_STAGES``), with the decode's time beside it:

- "two passes" (run r36a): the maximum of the pieces' lse first, then the weighted sum;
- "one pass, masked": the shipped loop, but each partial's load masked by its weight, so that
  it waits on the lse's load;
- "16 pieces a step": the lse of 16 pieces and their partials as one [16, 512] tile a step.

    python experiments/combine_probe.py OUT.json
"""
import argparse
import itertools
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from experiments import write_rows  # noqa: E402
from experiments.kernel_times import kernel_us  # noqa: E402
from mla import bench  # noqa: E402
from mla.kernels import combine  # noqa: E402
from mla.kernels.combine import DIM, _slot, pieces_of, store_query  # noqa: E402


@triton.jit(do_not_specialize=["s_q", "h_q", "num_splits"])
def two_passes(po_ptr, plse_ptr, rec_ptr, out_ptr, lse_ptr, sink_ptr, sink_stride, s_q, h_q, num_splits,
               HAS_SINK: tl.constexpr, FLAT: tl.constexpr, BY_QUERY: tl.constexpr = 0):
    p = tl.program_id(0)
    head = tl.program_id(1)
    tok, n_pieces, first_slot, base_slot = pieces_of(rec_ptr, p, num_splits, FLAT, BY_QUERY)
    if tok >= 0:
        c = tl.arange(0, DIM)
        m = float("-inf")
        for i in range(0, n_pieces):
            m = tl.maximum(m, tl.load(plse_ptr + _slot(i, first_slot, base_slot, FLAT).to(tl.int64) * h_q + head))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        wsum = 0.0
        acc = tl.zeros([DIM], tl.float32)
        for i in range(0, n_pieces):
            row = _slot(i, first_slot, base_slot, FLAT).to(tl.int64) * h_q + head
            w = tl.exp2(tl.load(plse_ptr + row) - m_safe)
            o = tl.load(po_ptr + row * DIM + c, mask=(c * 0 + w) > 0, other=0.0).to(tl.float32)
            wsum += w
            acc += w * o
        store_query(acc, wsum, m_safe, tok, tok // s_q, tok % s_q, head, s_q, h_q, out_ptr, lse_ptr, sink_ptr,
                    sink_stride, HAS_SINK)


@triton.jit(do_not_specialize=["s_q", "h_q", "num_splits"])
def one_pass_masked(po_ptr, plse_ptr, rec_ptr, out_ptr, lse_ptr, sink_ptr, sink_stride, s_q, h_q, num_splits,
                    HAS_SINK: tl.constexpr, FLAT: tl.constexpr, BY_QUERY: tl.constexpr = 0):
    p = tl.program_id(0)
    head = tl.program_id(1)
    tok, n_pieces, first_slot, base_slot = pieces_of(rec_ptr, p, num_splits, FLAT, BY_QUERY)
    if tok >= 0:
        c = tl.arange(0, DIM)
        m = float("-inf")
        wsum = 0.0
        acc = tl.zeros([DIM], tl.float32)
        for i in range(0, n_pieces):
            row = _slot(i, first_slot, base_slot, FLAT).to(tl.int64) * h_q + head
            lse = tl.load(plse_ptr + row)
            m_new = tl.maximum(m, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            scale = tl.exp2(m - m_safe)
            w = tl.exp2(lse - m_safe)
            o = tl.load(po_ptr + row * DIM + c, mask=(c * 0 + w) > 0, other=0.0).to(tl.float32)
            wsum = wsum * scale + w
            acc = acc * scale + w * o
            m = m_new
        store_query(acc, wsum, m, tok, tok // s_q, tok % s_q, head, s_q, h_q, out_ptr, lse_ptr, sink_ptr,
                    sink_stride, HAS_SINK)


@triton.jit(do_not_specialize=["s_q", "h_q", "num_splits"])
def pieces_a_step(po_ptr, plse_ptr, rec_ptr, out_ptr, lse_ptr, sink_ptr, sink_stride, s_q, h_q, num_splits,
                  HAS_SINK: tl.constexpr, FLAT: tl.constexpr, BY_QUERY: tl.constexpr = 0,
                  BLOCK_P: tl.constexpr = 16):
    p = tl.program_id(0)
    head = tl.program_id(1)
    tok, n_pieces, first_slot, base_slot = pieces_of(rec_ptr, p, num_splits, FLAT, BY_QUERY)
    if tok >= 0:
        c = tl.arange(0, DIM)
        m = float("-inf")
        wsum = 0.0
        acc = tl.zeros([DIM], tl.float32)
        for i0 in range(0, n_pieces, BLOCK_P):
            i = i0 + tl.arange(0, BLOCK_P)
            row = _slot(i, first_slot, base_slot, FLAT).to(tl.int64) * h_q + head
            lse = tl.load(plse_ptr + row, mask=i < n_pieces, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(lse, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            w = tl.exp2(lse - m_safe)
            o = tl.load(po_ptr + row[:, None] * DIM + c[None, :], mask=(w > 0)[:, None], other=0.0).to(tl.float32)
            scale = tl.exp2(m - m_safe)
            wsum = wsum * scale + tl.sum(w, 0)
            acc = acc * scale + tl.sum(w[:, None] * o, 0)
            m = m_new
        store_query(acc, wsum, m, tok, tok // s_q, tok % s_q, head, s_q, h_q, out_ptr, lse_ptr, sink_ptr,
                    sink_stride, HAS_SINK)


KERNELS = {"shipped": combine.combine_kernel, "two passes": two_passes, "one pass, masked": one_pass_masked,
           "16 pieces a step": pieces_a_step}

#: (shape, programs to force or None for the rule's): 32, 16, 4 and 2 pieces a query, small and
#: large combine grids
CASES = [(bench.Shape("DSA", 1, 1, 64, 2048, 64), None),
         (bench.Shape("DSA", 8, 1, 64, 2048, 64), None),
         (bench.Shape("V4-CSA", 32, 1, 64, 128, 256, 512, 64), None),
         (bench.Shape("sweep CSA", 74, 1, 64, 128, 256, 512, 64), 124),
         (bench.Shape("sweep CSA", 32, 2, 64, 128, 256, 512, 64), None),
         (bench.Shape("sweep DSA", 2, 2, 128, 2048, 64), None),
         (bench.Shape("sweep HCA", 64, 2, 128, 128, 256, 1024, 2, lengths=True), None)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    a = ap.parse_args(argv)
    if mla.INTERPRET:
        sys.exit("combine_probe: needs a CUDA GPU")
    dev = torch.device("cuda")
    pools, rows = {}, []
    for s, programs in CASES:
        case = bench.Case(s, dev, pool_bytes=1e9, n_sets=8, pools=pools)
        for (name, kernel), warps, stages in itertools.product(KERNELS.items(), (2, 4), (3, 6)):
            combine.combine_kernel, combine.NUM_WARPS, combine.NUM_STAGES = kernel, warps, stages
            call = case.caller("mma", programs=programs)
            rows.append({"shape": s.name, "b": s.b, "s_q": s.s_q, "h_q": s.h_q, "programs": call.plan.launch.programs,
                         "share": call.plan.launch.share, "kernel": name, "num_warps": warps, "num_stages": stages,
                         "kernels": kernel_us(case, call), "us_graph": round(bench.time_graph(case, call), 2)})
            print(rows[-1], flush=True)
        del case
    write_rows(a.out, rows, dev)


if __name__ == "__main__":
    main()
