"""The portable tensor-core kernel: one program per (query token, block of BLOCK_H heads, split).

Each program gathers and dequantizes a tile of BLOCK_N tokens ONCE for all BLOCK_H heads of its
block, computes S = Q.K^T and O += P.V with ``tl.dot`` and an online softmax in the exp2
domain. The 512 columns are held as two halves of 256 (tiles 0-3 and 4-7 of a token), which
halves the live accumulator per ``tl.dot``. A query's token list is the main cache's selected
tokens followed by the extra cache's, in one loop; split ``i`` takes a contiguous range of its
token tiles. With one split the kernel writes the final output (sink applied); with several it
writes partials (o, lse in log2 units) that :mod:`mla.kernels.combine` merges.

``DV_HALVES = 2`` is the form for grids too small to fill the GPU: two programs per head block,
each computing all of S but owning 256 of the output columns, so twice as many SMs share a query.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import _runtime
from .common import DIM, LN2, finish_softmax, load_token_tile, sink_factor, split_range, tile_source, to_bf16, token_rows

HALF = tl.constexpr(DIM // 2)      #: 256: the columns of one accumulator half
#: The dots' operand type: fp16 (P rounded to 2**-11; bf16's 2**-8 breaks the tolerance with few
#: valid tokens). Under the interpreter float32, whose tl.dot multiplies bf16 and fp16 bit
#: patterns as integers (triton-lang/triton#11584).
OPERAND_DTYPE = tl.float32 if _runtime.INTERPRET else tl.float16


@triton.jit
def _tile_rows(ti, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
               ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N: tl.constexpr, HAS_EXTRA: tl.constexpr):
    """Token tile ``ti`` of a query's list (the main cache's ``tiles1`` tiles, then the extra
    cache's): the cache it comes from and, per position, (valid, data row, scale row). The cache
    is picked per tile with scalar selects, so that both caches run through one copy of the loop
    body (a second loop for the extra cache spilled ten times more under Triton 3.6)."""
    cache, idx_row, t, n, n_tokens, P, stride = tile_source(ti, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                                            ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, HAS_EXTRA)
    valid, row, srow = token_rows(idx_row, t * BLOCK_N + tl.arange(0, BLOCK_N), n, n_tokens, P, stride)
    return cache, valid, row, srow


@triton.jit
def _online_step(m_i, l_i, acc0, acc1, q0, q1, k0, k1, valid, sm_scale_log2, DOT: tl.constexpr,
                 DV_HALVES: tl.constexpr, half):
    """One tile, heads as M: S = Q.K^T over both halves, the softmax step, O = O*alpha + P.V.
    With DV_HALVES == 2 P.V runs on this program's half only, into ``acc0``. (The step is
    :func:`mla.kernels.common.softmax_step` written out: called from here, the same operations
    come out in another instruction order on some shipped configs.)"""
    s = tl.dot(q0, tl.trans(k0))
    s = tl.dot(q1, tl.trans(k1), s)
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
def _cache_pass(m_i, l_i, acc0, acc1, q0, q1, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                ec_stride, ec_P, ec_n, idx_extra, n2, sm_scale_log2, BLOCK_N: tl.constexpr, HAS_EXTRA: tl.constexpr,
                FP8_NATIVE: tl.constexpr, DOT: tl.constexpr, DV_HALVES: tl.constexpr, half):
    """Fold token tiles ``[lo, hi)`` of the query's list (main cache, then extra cache) into the
    running state of BLOCK_H heads. (A function of its own: inlined into the kernel body instead,
    the same loop comes out in another instruction order.)"""
    for ti in range(lo, hi):
        cache, valid, row, srow = _tile_rows(ti, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                             ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA)
        k0 = tl.reshape(load_token_tile(cache, row, srow, valid, FP8_NATIVE, DOT, 0, 4), [BLOCK_N, HALF])
        k1 = tl.reshape(load_token_tile(cache, row, srow, valid, FP8_NATIVE, DOT, 4, 4), [BLOCK_N, HALF])
        m_i, l_i, acc0, acc1 = _online_step(m_i, l_i, acc0, acc1, q0, q1, k0, k1, valid, sm_scale_log2, DOT,
                                            DV_HALVES, half)
    return m_i, l_i, acc0, acc1


@triton.jit(do_not_specialize=["num_splits"])  # one variant for every split count
def tl_dot_decode_kernel(
    q_ptr, out_ptr, lse_ptr, sink_ptr, po_ptr, plse_ptr,
    kc_ptr, kc_stride, kc_P, kc_n, idx_ptr, topk, len_ptr,
    ec_ptr, ec_stride, ec_P, ec_n, eidx_ptr, etopk, elen_ptr,
    s_q, h_q, sm_scale_log2, num_splits,
    HAS_SINK: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_ELEN: tl.constexpr,
    PARTIAL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_NATIVE: tl.constexpr, DOT: tl.constexpr, DV_HALVES: tl.constexpr = 1,
):
    hb = tl.program_id(0)
    half = 0
    if DV_HALVES == 2:                # program (head block, output half): columns 256*half + [0, 256)
        half = hb % 2
        hb = hb // 2
    split = tl.program_id(1)
    tok = tl.program_id(2)            # b * s_q + s
    b = tok // s_q
    s_idx = tok - b * s_q
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < h_q
    c = tl.arange(0, HALF)
    qrow = q_ptr + (tok.to(tl.int64) * h_q + heads) * DIM
    q0 = tl.load(qrow[:, None] + c[None, :], mask=hmask[:, None], other=0.0).to(DOT)
    q1 = tl.load(qrow[:, None] + HALF + c[None, :], mask=hmask[:, None], other=0.0).to(DOT)

    n1, tiles1, n2, lo, hi = split_range(b, split, topk, len_ptr, etopk, elen_ptr, num_splits, BLOCK_N, HAS_LEN,
                                         HAS_EXTRA, HAS_ELEN)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    idx_main = idx_ptr + tok.to(tl.int64) * topk
    idx_extra = eidx_ptr + tok.to(tl.int64) * etopk
    acc0 = tl.zeros([BLOCK_H, HALF], tl.float32)
    if DV_HALVES == 2:
        acc1 = tl.zeros([1, 1], tl.float32)        # unused: this program's half is acc0
    else:
        acc1 = tl.zeros([BLOCK_H, HALF], tl.float32)
    m_i, l_i, acc0, acc1 = _cache_pass(m_i, l_i, acc0, acc1, q0, q1, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n,
                                       idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, sm_scale_log2,
                                       BLOCK_N, HAS_EXTRA, FP8_NATIVE, DOT, DV_HALVES, half)

    empty, l_safe, lse2 = finish_softmax(l_i, m_i)
    o0 = acc0 / l_safe[:, None]
    lmask = hmask
    if DV_HALVES == 2:
        lmask = hmask & ((heads * 0 + half) == 0)   # both halves hold the same lse; one writes it
    if PARTIAL:
        prow = (tok.to(tl.int64) * num_splits + split) * h_q + heads
        tl.store(plse_ptr + prow, tl.where(empty, float("-inf"), lse2), mask=lmask)
        tl.store(po_ptr + prow[:, None] * DIM + half * HALF + c[None, :], o0.to(po_ptr.dtype.element_ty),
                 mask=hmask[:, None])
        if DV_HALVES == 1:
            o1 = acc1 / l_safe[:, None]
            tl.store(po_ptr + prow[:, None] * DIM + HALF + c[None, :], o1.to(po_ptr.dtype.element_ty),
                     mask=hmask[:, None])
    else:
        lse = lse2 * LN2
        if HAS_SINK:
            sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
            f = sink_factor(sink, lse, empty)
            o0 = o0 * f[:, None]
        o0 = tl.where(empty[:, None], 0.0, o0)
        orow = out_ptr + (tok.to(tl.int64) * h_q + heads) * DIM
        tl.store(orow[:, None] + half * HALF + c[None, :], to_bf16(o0), mask=hmask[:, None])
        if DV_HALVES == 1:
            o1 = acc1 / l_safe[:, None]
            if HAS_SINK:
                o1 = o1 * f[:, None]
            o1 = tl.where(empty[:, None], 0.0, o1)
            tl.store(orow[:, None] + HALF + c[None, :], to_bf16(o1), mask=hmask[:, None])
        tl.store(lse_ptr + (b * h_q + heads) * s_q + s_idx, tl.where(empty, float("inf"), lse), mask=lmask)


def launch_params(n_tokens: int, h_q: int, splits: int, *, block_h: int, block_n: int, num_warps: int,
                  num_stages: int, dv_halves: int, fp8_native: bool, dot) -> tuple:
    """(grid, constexpr and launch keywords) of the kernel for ``n_tokens`` query tokens, besides
    the HAS_* / PARTIAL flags of :func:`mla.kernels.common.decode_args`."""
    grid = ((h_q + block_h - 1) // block_h * dv_halves, splits, n_tokens)
    return grid, dict(BLOCK_H=block_h, BLOCK_N=block_n, FP8_NATIVE=fp8_native, DOT=dot, DV_HALVES=dv_halves,
                      num_warps=num_warps, num_stages=num_stages)
