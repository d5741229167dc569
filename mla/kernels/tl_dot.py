"""The portable tensor-core kernel: one persistent program per (block of BLOCK_H heads, share of
the work list).

Each program gathers and dequantizes a tile of BLOCK_N tokens ONCE for all BLOCK_H heads of its
block, computes S = Q.K^T and O += P.V with ``tl.dot`` and an online softmax in the exp2
domain. The 512 columns are held as two halves of 256 (tiles 0-3 and 4-7 of a token), which
halves the live accumulator per ``tl.dot``. A query's token list is the main cache's selected
tokens followed by the extra cache's, in one loop. The work list (:mod:`mla.schedule`) lays every
query's tiles end to end and gives each program an equal share: it runs the pieces of the
queries in its share one after another, writing a whole query's final output (sink applied) and
a split one's partial (o, lse in log2 units), which :mod:`mla.kernels.combine` merges.

``DV_HALVES = 2`` is the form for grids too small to fill the GPU: two programs per head block,
each computing all of S but owning 256 of the output columns, so twice as many SMs share a query.

``V32`` is DeepSeek-V3.2's cache (:data:`mla.layout.V32`): the two halves are then the 512 nope
columns, K and V as before, and S gets a third ``tl.dot`` of q's 64 rope columns with the
tokens' rope tile (:func:`mla.kernels.common.load_rope`), which P.V does not read.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import _runtime
from .common import (DIM, LN2, ROPE_W, finish_softmax, load_rope, load_token_tile, piece, query_rows, share_bounds,
                     sink_factor, tile_source, to_bf16, token_rows, write_share_record)

HALF = tl.constexpr(DIM // 2)      #: 256: the columns of one accumulator half
#: The dots' operand type: fp16 (P rounded to 2**-11; bf16's 2**-8 breaks the tolerance with few
#: valid tokens). Under the interpreter float32, whose tl.dot multiplies bf16 and fp16 bit
#: patterns as integers (triton-lang/triton#11584).
OPERAND_DTYPE = tl.float32 if _runtime.INTERPRET else tl.float16
#: the arguments the kernel is not specialized on: one variant for every schedule
DO_NOT_SPECIALIZE = ("share", "num_programs")


@triton.jit
def _tile_rows(ti, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
               ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N: tl.constexpr, HAS_EXTRA: tl.constexpr,
               V32: tl.constexpr):
    """Token tile ``ti`` of a query's list (the main cache's ``tiles1`` tiles, then the extra
    cache's): the cache it comes from and, per position, (valid, data row, scale row). The cache
    is picked per tile with scalar selects, so that both caches run through one copy of the loop
    body (a second loop for the extra cache spilled ten times more under Triton 3.6)."""
    cache, idx_row, t, n, n_tokens, P, stride = tile_source(ti, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                                            ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, HAS_EXTRA)
    valid, row, srow = token_rows(idx_row, t * BLOCK_N + tl.arange(0, BLOCK_N), n, n_tokens, P, stride, V32)
    return cache, valid, row, srow


@triton.jit
def _online_step(m_i, l_i, acc0, acc1, q0, q1, k0, k1, qr, kr, valid, sm_scale_log2, DOT: tl.constexpr,
                 DV_HALVES: tl.constexpr, half, V32: tl.constexpr):
    """One tile, heads as M: S = Q.K^T over both halves (and, for V3.2, the rope columns ``qr``
    and ``kr``), the softmax step, O = O*alpha + P.V. With DV_HALVES == 2 P.V runs on this
    program's half only, into ``acc0``. (The step is :func:`mla.kernels.common.softmax_step`
    written out: called from here, the same operations come out in another instruction order on
    some shipped configs.)"""
    s = tl.dot(q0, tl.trans(k0))
    s = tl.dot(q1, tl.trans(k1), s)
    if V32:
        s = tl.dot(qr, tl.trans(kr), s)
    s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))        # [BLOCK_H, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pd = p.to(DOT)
    if DV_HALVES == 2:
        if half == 0:
            acc0 = tl.dot(pd, k0, acc0 * alpha[:, None])
        else:
            acc0 = tl.dot(pd, k1, acc0 * alpha[:, None])
    else:
        acc0 = tl.dot(pd, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(pd, k1, acc1 * alpha[:, None])
    return m_new, l_i, acc0, acc1


@triton.jit
def _cache_pass(m_i, l_i, acc0, acc1, q0, q1, qr, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, sm_scale_log2, BLOCK_N: tl.constexpr,
                HAS_EXTRA: tl.constexpr, FP8_NATIVE: tl.constexpr, DOT: tl.constexpr, DV_HALVES: tl.constexpr, half,
                V32: tl.constexpr):
    """Fold token tiles ``[lo, hi)`` of the query's list (main cache, then extra cache) into the
    running state of BLOCK_H heads. (A function of its own: inlined into the kernel body instead,
    the same loop comes out in another instruction order.)"""
    for ti in range(lo, hi):
        cache, valid, row, srow = _tile_rows(ti, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                             ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, V32)
        k0 = tl.reshape(load_token_tile(cache, row, srow, valid, FP8_NATIVE, DOT, 0, 4, V32), [BLOCK_N, HALF])
        k1 = tl.reshape(load_token_tile(cache, row, srow, valid, FP8_NATIVE, DOT, 4, 4, V32), [BLOCK_N, HALF])
        if V32:
            kr = load_rope(cache, row, valid, DOT, V32)
        else:
            kr = None
        m_i, l_i, acc0, acc1 = _online_step(m_i, l_i, acc0, acc1, q0, q1, k0, k1, qr, kr, valid, sm_scale_log2,
                                            DOT, DV_HALVES, half, V32)
    return m_i, l_i, acc0, acc1


@triton.jit
def _store_piece(o0, o1, m_i, l_i, heads, hmask, q, split, slot, half, out_ptr, lse_ptr, sink_ptr, sink_stride,
                 po_ptr, plse_ptr, s_q, h_q, c, HAS_SINK: tl.constexpr, DV_HALVES: tl.constexpr):
    """Store one piece's output: the final one (sink applied) for a whole query, else the partial
    (normalized by its own sum, lse in log2 units) in ``slot`` for the combine."""
    empty, l_safe, lse2 = finish_softmax(l_i, m_i)
    o0 = o0 / l_safe[:, None]
    lmask = hmask
    if DV_HALVES == 2:
        lmask = hmask & ((heads * 0 + half) == 0)   # both halves hold the same lse; one writes it
    if split:
        prow = slot.to(tl.int64) * h_q + heads
        tl.store(plse_ptr + prow, tl.where(empty, float("-inf"), lse2), mask=lmask)
        tl.store(po_ptr + prow[:, None] * DIM + half * HALF + c[None, :], o0.to(po_ptr.dtype.element_ty),
                 mask=hmask[:, None])
        if DV_HALVES == 1:
            o1 = o1 / l_safe[:, None]
            tl.store(po_ptr + prow[:, None] * DIM + HALF + c[None, :], o1.to(po_ptr.dtype.element_ty),
                     mask=hmask[:, None])
    else:
        lse = lse2 * LN2
        if HAS_SINK:
            sink = tl.load(sink_ptr + heads * sink_stride, mask=hmask, other=0.0)
            f = sink_factor(sink, lse, empty)
            o0 = o0 * f[:, None]
        o0 = tl.where(empty[:, None], 0.0, o0)
        orow = out_ptr + (tl.cast(q, tl.int64) * h_q + heads) * DIM
        tl.store(orow[:, None] + half * HALF + c[None, :], to_bf16(o0), mask=hmask[:, None])
        if DV_HALVES == 1:
            o1 = o1 / l_safe[:, None]
            if HAS_SINK:
                o1 = o1 * f[:, None]
            o1 = tl.where(empty[:, None], 0.0, o1)
            tl.store(orow[:, None] + HALF + c[None, :], to_bf16(o1), mask=hmask[:, None])
        b = q // s_q
        tl.store(lse_ptr + (b * h_q + heads) * s_q + (q - b * s_q), tl.where(empty, float("inf"), lse), mask=lmask)


@triton.jit(do_not_specialize=list(DO_NOT_SPECIALIZE))
def tl_dot_decode_kernel(
    q_ptr, q_sb, q_ss, q_sh, out_ptr, lse_ptr, sink_ptr, sink_stride, po_ptr, plse_ptr, rec_ptr,
    kc_ptr, kc_stride, kc_P, kc_n, idx_ptr, idx_sb, idx_ss, topk, len_ptr, len_stride,
    ec_ptr, ec_stride, ec_P, ec_n, eidx_ptr, eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride,
    n_q, s_q, h_q, sm_scale_log2, share, num_programs,
    HAS_SINK: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_ELEN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_NATIVE: tl.constexpr, DOT: tl.constexpr, DV_HALVES: tl.constexpr = 1, V32: tl.constexpr = False,
):
    """One persistent program per (block of BLOCK_H heads, share of the work list): the pieces of
    the queries in its share (:func:`mla.kernels.common.share_bounds`), one after another. With
    ``V32`` the cache is V3.2's and q is 576 wide (its strides are q's own)."""
    hb = tl.program_id(0)
    half = 0
    if DV_HALVES == 2:                # program (head block, output half): columns 256*half + [0, 256)
        half = hb % 2
        hb = hb // 2
    p = tl.program_id(1)
    p_last, x0, x1, q0, c_q, q_end, c_last, u_last = share_bounds(
        p, n_q, s_q, share, num_programs, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride,
        None, BLOCK_N, 1, HAS_LEN, HAS_EXTRA, HAS_ELEN)
    if tl.program_id(0) == 0:
        write_share_record(rec_ptr, p, p_last, x0, x1, q0, c_q, q_end, c_last, u_last, n_q, num_programs)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < h_q
    c = tl.arange(0, HALF)
    for q in tl.range(q0, q_end, num_stages=1):     # the token-tile loop inside is the pipelined one
        lo, hi, split, tiles1, n1, n2, units = piece(q, c_q, x0, x1, s_q, topk, len_ptr, len_stride, etopk, elen_ptr,
                                                     elen_stride, BLOCK_N, 1, HAS_LEN, HAS_EXTRA, HAS_ELEN)
        q_off, i_off, e_off = query_rows(q, s_q, q_sb, q_ss, idx_sb, idx_ss, eidx_sb, eidx_ss)
        qrow = q_ptr + q_off + heads.to(tl.int64) * q_sh
        qa = tl.load(qrow[:, None] + c[None, :], mask=hmask[:, None], other=0.0).to(DOT)
        qb = tl.load(qrow[:, None] + HALF + c[None, :], mask=hmask[:, None], other=0.0).to(DOT)
        if V32:                                    # q's 64 rope columns, after the 512 nope ones
            qr = tl.load(qrow[:, None] + DIM + tl.arange(0, ROPE_W)[None, :], mask=hmask[:, None], other=0.0).to(DOT)
        else:
            qr = None
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc0 = tl.zeros([BLOCK_H, HALF], tl.float32)
        if DV_HALVES == 2:
            acc1 = tl.zeros([1, 1], tl.float32)        # unused: this program's half is acc0
        else:
            acc1 = tl.zeros([BLOCK_H, HALF], tl.float32)
        m_i, l_i, acc0, acc1 = _cache_pass(m_i, l_i, acc0, acc1, qa, qb, qr, lo, hi, tiles1,
                                           kc_ptr, kc_stride, kc_P, kc_n, idx_ptr + i_off, n1, ec_ptr, ec_stride,
                                           ec_P, ec_n, eidx_ptr + e_off, n2, sm_scale_log2, BLOCK_N, HAS_EXTRA,
                                           FP8_NATIVE, DOT, DV_HALVES, half, V32)
        _store_piece(acc0, acc1, m_i, l_i, heads, hmask, q, split, 2 * p + (q != q0).to(tl.int32), half, out_ptr,
                     lse_ptr, sink_ptr, sink_stride, po_ptr, plse_ptr, s_q, h_q, c, HAS_SINK, DV_HALVES)
        c_q += units


def launch_params(h_q: int, programs: int, *, block_h: int, block_n: int, num_warps: int, num_stages: int,
                  dv_halves: int, fp8_native: bool, dot, v32: bool = False) -> tuple:
    """(grid, constexpr and launch keywords) of the kernel on ``programs`` shares, besides the
    HAS_* flags."""
    grid = ((h_q + block_h - 1) // block_h * dv_halves, programs)
    return grid, dict(BLOCK_H=block_h, BLOCK_N=block_n, FP8_NATIVE=fp8_native, DOT=dot, DV_HALVES=dv_halves,
                      V32=v32, num_warps=num_warps, num_stages=num_stages)
