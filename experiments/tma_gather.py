"""Dev tool (GPU, sm_90): a copy-only gather through Hopper's TMA engine, to set beside
experiments/gather_ceiling.py's plain loads. Each token's 576 data bytes are TMA copies (boxes
of 8-byte elements over the cache viewed as 576-byte rows: the page stride is a
multiple of 576; two copies, of 512 and 64 bytes, as Triton takes only box sides that are powers
of 2) and its scale row one 16-byte copy (the aligned 16 bytes that hold it); a
program keeps NST groups of G tokens in flight on one mbarrier each and waits for nothing else.
Nothing is decoded and nothing computed: the time is the gather's alone. Timed like the record
(CUDA graph, median) at SHAPES over the comma lists GS, NSTS, WARPS, SPLITS; writes
tma_gather.json to $OUT. As written it is issue-bound, several times slower than plain loads
and no faster with more groups in flight (results/h200/ holds the runs): one thread issues
every copy, each index comes out of a cross-lane reduction, and the descriptors are not
prefetched.

    SHAPES=V4-TP8:128 GS=8,16 NSTS=2,4 WARPS=1 SPLITS=1,5 OUT=out python experiments/tma_gather.py
"""
import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from experiments.gather_ceiling import sweep, token_range  # noqa: E402
from mla.kernels.gluon_sm90.compat import cta_barrier as _cta_barrier  # noqa: E402


@gluon.jit
def _pick(v, ar, j: gl.constexpr):
    """Element ``j`` of ``v`` as a scalar."""
    return gl.max(gl.where(ar == j, v, -1), axis=0)


@gluon.jit
def _issue(desc, tdesc, sdesc, i, P, rows_pp, dst, tdst, sdst, bar, on):
    """Copy token ``i``'s data row (its first 512 bytes and its last 64: Triton takes box sides
    that are powers of 2) and the 16 bytes that hold its scale row, if ``on``."""
    ii = gl.maximum(i, 0).to(gl.int64)      # (an invalid index copies token 0: the byte count stays G x 592)
    blk = ii // P
    off = ii - blk * P
    row = (blk * rows_pp + off).to(gl.int32)
    tma.async_copy_global_to_shared(desc, [row, 0], bar, dst, pred=on)
    tma.async_copy_global_to_shared(tdesc, [row, 64], bar, tdst, pred=on)
    srow = (blk * rows_pp * 576 + P * 576 + off * 8) // 16
    tma.async_copy_global_to_shared(sdesc, [srow.to(gl.int32), 0], bar, sdst, pred=on)


@gluon.jit
def tma_gather_kernel(out_ptr, kdesc, ktdesc, ksdesc, edesc, etdesc, esdesc, idx_ptr, topk, eidx_ptr, etopk,
                      k_rpp, kP, e_rpp, eP, splits, G: gl.constexpr, NST: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([G], [32], [gl.num_warps()], [0])
    b = gl.program_id(0)
    sp = gl.program_id(1)
    lo, hi = token_range(sp, splits, topk + etopk, G)
    n = gl.cdiv(gl.maximum(hi - lo, 0), G)
    R2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=64, rank=2)
    buf = gl.allocate_shared_memory(gl.int64, [NST, G, 64], R2)
    # (a TMA copy lands at a 128-byte aligned address: the 64- and 16-byte pieces get 128 each)
    tbuf = gl.allocate_shared_memory(gl.int64, [NST, G, 16], R2)
    sbuf = gl.allocate_shared_memory(gl.int64, [NST, G, 16], R2)
    bars = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(NST):
        mbarrier.init(bars.index(st), count=1)
    fence_async_shared()
    _cta_barrier()
    ar = gl.arange(0, G, layout=L)
    for g in range(0, n + NST - 1):
        if g < n:
            s = g % NST
            pos = lo + g * G + ar
            im = gl.load(idx_ptr + b.to(gl.int64) * topk + pos, mask=pos < topk, other=0)
            ie = gl.load(eidx_ptr + b.to(gl.int64) * etopk + (pos - topk), mask=pos >= topk, other=0)
            bar = bars.index(s)
            mbarrier.expect(bar, G * (576 + 16))
            dst = buf.index(s)
            tdst = tbuf.index(s)
            sdst = sbuf.index(s)
            for j in gl.static_range(G):
                in_main = lo + g * G + j < topk
                d1 = dst.slice(j, 1)
                d2 = tdst.slice(j, 1).slice(0, 8, 1)
                d3 = sdst.slice(j, 1).slice(0, 2, 1)
                _issue(kdesc, ktdesc, ksdesc, _pick(im, ar, j), kP, k_rpp, d1, d2, d3, bar, in_main)
                _issue(edesc, etdesc, esdesc, _pick(ie, ar, j), eP, e_rpp, d1, d2, d3, bar, not in_main)
        if g >= NST - 1:
            gw = g - NST + 1
            mbarrier.wait(bars.index(gw % NST), (gw // NST) & 1)
            _cta_barrier()
    gl.store(out_ptr + b * splits + sp, n)


def _descs(cache):
    """The cache as 576-byte rows of 8-byte elements (boxes of its first 64 elements and of its
    last 8), and as 16-byte rows; the rows of a page, and the page's first row."""
    assert cache.stride(0) % 576 == 0
    flat = torch.as_strided(cache.view(torch.uint8), (cache.shape[0] * cache.stride(0),), (1,))
    w = flat.view(torch.int64)
    rows = w.view(-1, 72)
    lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=64, rank=2)
    d = TensorDescriptor(rows, list(rows.shape), [72, 1], [1, 64], lay)
    t = TensorDescriptor(rows, list(rows.shape), [72, 1], [1, 8], lay)
    s16 = w.view(-1, 2)
    sd = TensorDescriptor(s16, list(s16.shape), [2, 1], [1, 2], lay)
    return d, t, sd, cache.stride(0) // 576, cache.shape[1]


def gather(q, k_cache, indices, extra_k_cache=None, extra_indices=None, g=16, nst=4, warps=4, splits=1, **_):
    b = indices.shape[0] * indices.shape[1]
    assert (indices.shape[-1] + extra_indices.shape[-1]) % g == 0, "the probe copies whole groups of g tokens"
    kd, ktd, ksd, k_rpp, kp = _descs(k_cache)
    ed, etd, esd, e_rpp, ep = _descs(extra_k_cache)
    out = torch.empty(b * splits, dtype=torch.int32, device=q.device)
    tma_gather_kernel[(b, splits)](out, kd, ktd, ksd, ed, etd, esd, indices, indices.shape[-1], extra_indices,
                                   extra_indices.shape[-1], k_rpp, kp, e_rpp, ep, splits, G=g, NST=nst,
                                   num_warps=warps)
    return out


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if mla.INTERPRET:
        sys.exit("tma_gather: needs a Hopper GPU (sm_90); here mla runs Triton's CPU interpreter")
    sweep(gather, [("g", "GS", "8,16"), ("nst", "NSTS", "2,4"), ("warps", "WARPS", "1,4"),
                   ("splits", "SPLITS", "1,2,5")], "tma_gather.json", default_shapes="V4-TP8:128")


if __name__ == "__main__":
    main()
