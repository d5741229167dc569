"""Dev tool (GPU): a gather probe. A plain Triton kernel that only reads what a decode call reads
(each selected token's 576 data bytes and 8 scale bytes, main and extra caches, the SPEC's inputs
from :class:`mla.bench.Case`) and folds them into one integer per program, timed like the record
(CUDA graph, median) at SHAPES over a few launch choices (tokens per tile, warps, splits per
query: the comma lists BTS, WARPS, SPLITS), and under ORDER's index orders ("random", the
record's lists; "runs", each query's tokens made one run of consecutive tokens, the same bytes
read as a stream). Writes gather_ceiling.json to $OUT. KIND=noop times calls of one or two empty
kernels instead (launch_floor.json), KIND=decode the decode itself (decode_order.json).

It is not a ceiling: each tile's index load and gather run in series, with no pipelining, and
Nsight Compute finds it bound by issuing its own instructions. Its best choice at V4-TP8 b128
takes as long with runs of consecutive tokens as with the random lists, so DRAM is not what
holds it back (the runs are in results/h200/).

    KIND=gather SHAPES=V4-TP8:128 BTS=4,8 WARPS=4 SPLITS=10,20 ORDER=random,runs OUT=out \
        python experiments/gather_ceiling.py
"""
import argparse
import functools
import itertools
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mla import bench  # noqa: E402
from mla.bench import Case  # noqa: E402
from mla.kernels.common import cache_args  # noqa: E402


@triton.jit
def _rows(pos, lo_ok, idx_row, n_idx, P, stride):
    i = tl.load(idx_row + pos, mask=lo_ok, other=-1)
    ok = lo_ok & (i >= 0)
    i64 = tl.where(ok, i, 0).to(tl.int64)
    blk = i64 // P
    off = i64 - blk * P
    return ok, blk * stride + off * 576, blk * stride + P * 576 + off * 8


@triton.jit
def token_range(sp, splits, total, BT: tl.constexpr):
    """The tokens ``[lo, hi)`` of a query's list (main cache, then extra) that program ``sp`` of
    ``splits`` copies, in whole tiles of ``BT``. Scalar code, shared with experiments/tma_gather.py's
    Gluon kernel."""
    per = ((total + BT - 1) // BT + splits - 1) // splits * BT
    lo = sp * per
    return lo, tl.minimum(lo + per, total)


@triton.jit
def gather_kernel(out_ptr, kc, kst, kP, idx, topk, ec, est, eP, eidx, etopk, splits, BT: tl.constexpr):
    b = tl.program_id(0)
    sp = tl.program_id(1)
    lo, hi = token_range(sp, splits, topk + etopk, BT)
    acc = tl.zeros([BT], tl.int32)
    c = tl.arange(0, 128)
    c2 = tl.arange(0, 16)
    for t0 in range(lo, hi, BT):
        pos = t0 + tl.arange(0, BT)
        main = pos < topk
        ok_m, row_m, srow_m = _rows(pos, main & (pos < hi), idx + b.to(tl.int64) * topk, topk, kP, kst)
        ok_e, row_e, srow_e = _rows(pos - topk, (~main) & (pos < hi), eidx + b.to(tl.int64) * etopk, etopk, eP,
                                    est)
        ok = ok_m | ok_e
        base = tl.where(main, kc, ec)
        row = tl.where(main, row_m, row_e)
        srow = tl.where(main, srow_m, srow_e)
        p = (base + row).to(tl.pointer_type(tl.int32))
        x = tl.load(p[:, None] + c[None, :], mask=ok[:, None], other=0)
        y = tl.load(p[:, None] + 128 + c2[None, :], mask=ok[:, None], other=0)
        s = tl.load((base + srow).to(tl.pointer_type(tl.int64)), mask=ok, other=0)
        acc += tl.sum(x, 1) + tl.sum(y, 1) + (s ^ (s >> 32)).to(tl.int32)
    tl.store(out_ptr + b * splits + sp, tl.sum(acc, 0))


def gather(q, k_cache, indices, extra_k_cache=None, extra_indices=None, bt=64, warps=8, splits=1, **_):
    b = indices.shape[0] * indices.shape[1]
    kc, kst, kp, _n = cache_args(k_cache)
    ec, est, ep, _n2 = cache_args(extra_k_cache)
    out = torch.empty(b * splits, dtype=torch.int32, device=q.device)
    gather_kernel[(b, splits)](out, kc, kst, kp, indices, indices.shape[-1], ec, est, ep, extra_indices,
                               extra_indices.shape[-1], splits, BT=bt, num_warps=warps)
    return out


def stream_runs(case):
    """The case's index sets (main, extra) with every query's token list made one run of
    consecutive tokens from a random start: as many bytes as the random lists, read as a
    stream, to set the gather's cost beside a streaming read of the same amount (ORDER "runs"
    in :func:`sweep`)."""
    def runs(idx, n):
        start = torch.randint(0, n - idx.shape[-1], idx.shape[:-1] + (1,), device=idx.device, dtype=torch.int32)
        return start + torch.arange(idx.shape[-1], device=idx.device, dtype=torch.int32)
    n = case.cache.shape[0] * case.cache.shape[1]
    main = [runs(i, n) for i in case.index_sets]
    if case.extra is None:
        return main, case.extra_sets
    n = case.extra.shape[0] * case.extra.shape[1]
    return main, [runs(i, n) for i in case.extra_sets]


def sweep(fn, axes, out_name, default_shapes="V4-TP8:128,V4-TP8:32"):
    """Time ``fn`` (a gather taking the decode's arguments plus launch options) like the record
    (CUDA graph, median) at SHAPES, over the product of ``axes``, a list of (option, environment
    variable holding a comma list, its default); print a line per choice and write the rows to
    $OUT/``out_name``."""
    out_dir = pathlib.Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    shapes = {f"{s.name}:{s.b}": s for s in bench.spec_shapes() if s.s_q == 1}
    grid = [tuple(int(v) for v in os.environ.get(env, default).split(",")) for _, env, default in axes]
    rows = []
    for spec in os.environ.get("SHAPES", default_shapes).split(","):
        s = shapes[spec]
        case = Case(s, dev, pool_bytes=2e9, n_sets=16)
        tokens = s.b * (s.topk + s.extra_topk)
        random_sets = case.index_sets, case.extra_sets
        for order, vals in itertools.product(os.environ.get("ORDER", "random").split(","), itertools.product(*grid)):
            case.index_sets, case.extra_sets = stream_runs(case) if order == "runs" else random_sets
            opts = dict(zip([a[0] for a in axes], vals))
            tag = {} if order == "random" else {"order": order}
            name = f"{s.name} b{s.b} " + " ".join(f"{k} {v}" for k, v in {**opts, **tag}.items())
            try:
                us = bench.time_graph(case, lambda i, _c=case, _f=functools.partial(fn, **opts): _c.call(_f, i))
            except Exception as e:  # noqa: BLE001
                print(f"{name}: ERROR {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            rows.append({"shape": s.name, "b": s.b, **opts, **tag, "us_graph": us,
                         "gbps": tokens * 584 / us / 1e3})
            print(f"{name}: {us:.1f} us, {tokens * 584 / us / 1e3:.0f} GB/s", flush=True)
        del case
        torch.cuda.empty_cache()
    res = {"rows": rows, "provenance": bench.provenance(bench.ceilings(dev))}
    (out_dir / out_name).write_text(json.dumps(res, indent=1))


@triton.jit
def _noop_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), 1)


def noop(q, k_cache, indices, kernels=1, splits=1, **_):
    """``kernels`` launches, one after the other, of a kernel whose programs (one per query token
    and split, as a decode's) each store one integer: what a call of that many kernels costs
    in a CUDA graph before it reads anything (KIND=noop)."""
    out = torch.empty(indices.shape[0] * indices.shape[1] * splits, dtype=torch.int32, device=q.device)
    for _ in range(kernels):
        _noop_kernel[(indices.shape[0] * indices.shape[1], splits)](out, num_warps=4)
    return out


def decode(*args, impl="mma", **kw):
    """The decode itself (KIND=decode), to time under ORDER's index orders beside the gathers."""
    return mla.sparse_decode(*args, **kw, impl=impl)


#: KIND: what :func:`sweep` times, over which launch options, into which file
KINDS = {"gather": (gather, [("bt", "BTS", "32,64"), ("warps", "WARPS", "4,8"), ("splits", "SPLITS", "1,2,4")],
                    "gather_ceiling.json"),
         "noop": (noop, [("kernels", "KERNELS", "1,2"), ("splits", "SPLITS", "1,10")], "launch_floor.json"),
         "decode": (decode, [], "decode_order.json")}


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    sweep(*KINDS[os.environ.get("KIND", "gather")])


if __name__ == "__main__":
    main()
