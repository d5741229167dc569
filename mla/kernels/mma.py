"""The tensor-core (``tl.dot``) rewrite: one program per (query token, block of BLOCK_H heads, split).

Each program gathers and dequantizes a tile of BLOCK_N tokens ONCE for all BLOCK_H heads of its
block, computes S = Q.K^T and O += P.V with ``tl.dot`` and an online softmax in the exp2
domain. The 512 columns are held as two halves of 256 (tiles 0-3 and 4-7 of a token), which
halves the live accumulator per ``tl.dot`` and keeps register pressure down. The token list of a
query is the main cache's selected tokens followed by the extra cache's; split ``i`` takes a
contiguous range of token tiles of that list. With one split the kernel writes the final output
(sink applied); with several it writes partial (o, lse in log2 units) that
:func:`combine_kernel` merges, applying the sink.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _runtime
from ..layout import D_QK
from .common import (cache_args, dequant, fp8_native, load_raw, load_token_tile, split_range, tile_source,
                     to_bf16, token_rows)

LOG2E = 1.4426950408889634


@triton.jit
def _tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
               ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2,
               BLOCK_N: tl.constexpr, HAS_EXTRA: tl.constexpr, CLIP: tl.constexpr = False):
    """Token tile ``ti`` of a query's list (the main cache's ``tiles1`` tiles, then the extra
    cache's): the cache it comes from and, per position, (valid, data row, scale row). The
    cache is picked per tile with scalar selects, so both caches run through one loop (one copy
    of the loop body: under Triton 3.6 a second loop for the extra cache spilled 10x more).
    With CLIP a tile at or past ``hi`` (the next split's) comes out all invalid, so the
    hand-prefetched loop's look-ahead past its range loads nothing."""
    cache, idx_row, t, n, n_tokens, P, stride = tile_source(ti, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                                            ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, HAS_EXTRA)
    if CLIP:
        n = tl.where(ti < hi, n, 0)
    valid, row, srow = token_rows(idx_row, t * BLOCK_N + tl.arange(0, BLOCK_N), n, n_tokens, P, stride)
    return cache, valid, row, srow


@triton.jit
def _mma_cache_pass(m_i, l_i, acc0, acc1, q0, q1, lo, hi, tiles1,
                    kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2,
                    sm_scale_log2, BLOCK_N: tl.constexpr, HAS_EXTRA: tl.constexpr, FP8_NATIVE: tl.constexpr,
                    DOT: tl.constexpr, PREFETCH: tl.constexpr = False, P_SPLIT: tl.constexpr = False,
                    ABLATE: tl.constexpr = 0, DV_HALVES: tl.constexpr = 1, half=0):
    """Fold token tiles ``[lo, hi)`` of the query's list (main cache, then extra cache) into
    the running state of BLOCK_H heads.

    With PREFETCH the loop is software-pipelined by hand: while tile i is decoded and multiplied,
    the bytes of tile i+1 and the indices of tile i+2 are already in flight, so neither the
    index load nor the dependent gather sits on the critical path."""
    if PREFETCH:
        cache, valid, row, srow = _tile_rows(lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                             ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, True)
        a0, s0, r0 = load_raw(cache, row, srow, valid, 0, 4)
        a1, s1, r1 = load_raw(cache, row, srow, valid, 4, 4)
        c_nx, v_nx, row_nx, srow_nx = _tile_rows(lo + 1, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                                 ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA,
                                                 True)
        for ti in range(lo, hi):
            # in flight during this tile's math: bytes of ti+1, indices of ti+2
            b0, t0, u0 = load_raw(c_nx, row_nx, srow_nx, v_nx, 0, 4)
            b1, t1, u1 = load_raw(c_nx, row_nx, srow_nx, v_nx, 4, 4)
            c2, v2, row2, srow2 = _tile_rows(ti + 2, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                             ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA,
                                             True)
            k0 = tl.reshape(dequant(a0, s0, r0, 0, 4, FP8_NATIVE, DOT), [BLOCK_N, 256])
            k1 = tl.reshape(dequant(a1, s1, r1, 4, 4, FP8_NATIVE, DOT), [BLOCK_N, 256])
            m_i, l_i, acc0, acc1 = _online_step(m_i, l_i, acc0, acc1, q0, q1, k0, k1, valid, sm_scale_log2, DOT, P_SPLIT,
                                                DV_HALVES, half)
            a0, s0, r0, a1, s1, r1, valid = b0, t0, u0, b1, t1, u1, v_nx
            c_nx, v_nx, row_nx, srow_nx = c2, v2, row2, srow2
    else:
        ar = tl.arange(0, BLOCK_N)
        for ti in range(lo, hi):
            cache, valid, row, srow = _tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                                 ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA)
            if ABLATE == 1:     # timing ablation: every tile reads the same first tokens (cache hits)
                cache = kc_ptr
                row = (ar % kc_P).to(tl.int64) * 576
                srow = kc_P * 576 + (ar % kc_P).to(tl.int64) * 8
            k0 = tl.reshape(load_token_tile(cache, row, srow, valid, FP8_NATIVE, DOT, 0, 4), [BLOCK_N, 256])
            k1 = tl.reshape(load_token_tile(cache, row, srow, valid, FP8_NATIVE, DOT, 4, 4), [BLOCK_N, 256])
            m_i, l_i, acc0, acc1 = _online_step(m_i, l_i, acc0, acc1, q0, q1, k0, k1, valid, sm_scale_log2, DOT, P_SPLIT,
                                                DV_HALVES, half)
    return m_i, l_i, acc0, acc1


@triton.jit
def _online_step(m_i, l_i, acc0, acc1, q0, q1, k0, k1, valid, sm_scale_log2, DOT: tl.constexpr,
                 P_SPLIT: tl.constexpr, DV_HALVES: tl.constexpr = 1, half=0):
    """One tile of the online softmax with heads as M: S = Q.K^T, O = O*alpha + P.V.

    With DV_HALVES == 2 this program owns output columns ``[256*half, 256*half + 256)`` only:
    it still needs all 512 columns for S, but P.V runs on one half into ``acc0`` (``acc1`` is
    unused), so a program is one warpgroup's worth of accumulator."""
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
        if P_SPLIT:
            # P = hi + lo in two bf16 terms: the P.V rounding drops from 2**-8 to about 2**-16 relative.
            plo = (p - pd.to(tl.float32)).to(DOT)
            acc0 = tl.dot(plo, k0, acc0)
            acc1 = tl.dot(plo, k1, acc1)
    return m_new, l_i, acc0, acc1


@triton.jit
def _mma_cache_pass_t(m_i, l_i, acc0, acc1, q0t, q1t, lo, hi, tiles1,
                      kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2,
                      sm_scale_log2, BLOCK_N: tl.constexpr, HAS_EXTRA: tl.constexpr, FP8_NATIVE: tl.constexpr,
                      DOT: tl.constexpr, P_SPLIT: tl.constexpr = False):
    """The same fold with tokens as the M dimension of the dots ("S^T = K.Q^T", "O^T += V^T.P^T"):
    the token tile, not the head block, is split across warpgroups, so no warpgroup repeats
    another's Q.K^T. State is transposed: acc ``[256, BLOCK_H]`` halves, m and l per head."""
    for ti in range(lo, hi):
        cache, valid, row, srow = _tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                             ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA)
        k0 = tl.reshape(load_token_tile(cache, row, srow, valid, FP8_NATIVE, DOT, 0, 4), [BLOCK_N, 256])
        k1 = tl.reshape(load_token_tile(cache, row, srow, valid, FP8_NATIVE, DOT, 4, 4), [BLOCK_N, 256])
        st = tl.dot(k0, q0t)
        st = tl.dot(k1, q1t, st)
        st = tl.where(valid[:, None], st * sm_scale_log2, float("-inf"))      # [BLOCK_N, BLOCK_H]
        m_new = tl.maximum(m_i, tl.max(st, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pt = tl.exp2(st - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(pt, 0)
        ptd = pt.to(DOT)
        acc0 = tl.dot(tl.trans(k0), ptd, acc0 * alpha[None, :])
        acc1 = tl.dot(tl.trans(k1), ptd, acc1 * alpha[None, :])
        if P_SPLIT:
            plo = (pt - ptd.to(tl.float32)).to(DOT)
            acc0 = tl.dot(tl.trans(k0), plo, acc0)
            acc1 = tl.dot(tl.trans(k1), plo, acc1)
        m_i = m_new
    return m_i, l_i, acc0, acc1


@triton.jit
def mma_decode_kernel(
    q_ptr, out_ptr, lse_ptr, sink_ptr, po_ptr, plse_ptr,
    kc_ptr, kc_stride, kc_P, kc_n, idx_ptr, topk, len_ptr,
    ec_ptr, ec_stride, ec_P, ec_n, eidx_ptr, etopk, elen_ptr,
    s_q, h_q, sm_scale_log2, num_splits,
    HAS_SINK: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_ELEN: tl.constexpr,
    PARTIAL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_NATIVE: tl.constexpr, DOT: tl.constexpr, TOKENS_AS_M: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, P_SPLIT: tl.constexpr = False, ABLATE: tl.constexpr = 0,
    DV_HALVES: tl.constexpr = 1,
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
    c = tl.arange(0, 256)
    qrow = q_ptr + (tok.to(tl.int64) * h_q + heads) * 512
    q0 = tl.load(qrow[:, None] + c[None, :], mask=hmask[:, None], other=0.0).to(DOT)
    q1 = tl.load(qrow[:, None] + 256 + c[None, :], mask=hmask[:, None], other=0.0).to(DOT)

    n1, tiles1, n2, lo, hi = split_range(b, split, topk, len_ptr, etopk, elen_ptr, num_splits, BLOCK_N, HAS_LEN,
                                         HAS_EXTRA, HAS_ELEN)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    idx_main = idx_ptr + tok.to(tl.int64) * topk
    idx_extra = eidx_ptr + tok.to(tl.int64) * etopk
    if TOKENS_AS_M:
        q0t = tl.trans(q0)
        q1t = tl.trans(q1)
        acc0t = tl.zeros([256, BLOCK_H], tl.float32)
        acc1t = tl.zeros([256, BLOCK_H], tl.float32)
        m_i, l_i, acc0t, acc1t = _mma_cache_pass_t(
            m_i, l_i, acc0t, acc1t, q0t, q1t, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
            ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, sm_scale_log2, BLOCK_N, HAS_EXTRA, FP8_NATIVE, DOT, P_SPLIT)
        acc0 = tl.trans(acc0t)
        acc1 = tl.trans(acc1t)
    else:
        acc0 = tl.zeros([BLOCK_H, 256], tl.float32)
        if DV_HALVES == 2:
            acc1 = tl.zeros([1, 1], tl.float32)        # unused: this program's half is acc0
        else:
            acc1 = tl.zeros([BLOCK_H, 256], tl.float32)
        m_i, l_i, acc0, acc1 = _mma_cache_pass(
            m_i, l_i, acc0, acc1, q0, q1, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
            ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, sm_scale_log2, BLOCK_N, HAS_EXTRA, FP8_NATIVE, DOT,
            PREFETCH, P_SPLIT, ABLATE, DV_HALVES, half)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse2 = m_i + tl.log2(l_safe)                                             # log2 units
    o0 = acc0 / l_safe[:, None]
    lmask = hmask
    if DV_HALVES == 2:
        lmask = hmask & ((heads * 0 + half) == 0)   # both halves hold the same lse; one writes it
    if PARTIAL:
        prow = (tok.to(tl.int64) * num_splits + split) * h_q + heads
        tl.store(plse_ptr + prow, tl.where(empty, float("-inf"), lse2), mask=lmask)
        tl.store(po_ptr + prow[:, None] * 512 + half * 256 + c[None, :], o0.to(po_ptr.dtype.element_ty),
                 mask=hmask[:, None])
        if DV_HALVES == 1:
            o1 = acc1 / l_safe[:, None]
            tl.store(po_ptr + prow[:, None] * 512 + 256 + c[None, :], o1.to(po_ptr.dtype.element_ty),
                     mask=hmask[:, None])
    else:
        lse = lse2 * 0.6931471805599453
        if HAS_SINK:
            sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
            f = 1.0 / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse)))
            o0 = o0 * f[:, None]
        o0 = tl.where(empty[:, None], 0.0, o0)
        orow = out_ptr + (tok.to(tl.int64) * h_q + heads) * 512
        tl.store(orow[:, None] + half * 256 + c[None, :], to_bf16(o0), mask=hmask[:, None])
        if DV_HALVES == 1:
            o1 = acc1 / l_safe[:, None]
            if HAS_SINK:
                o1 = o1 * f[:, None]
            o1 = tl.where(empty[:, None], 0.0, o1)
            tl.store(orow[:, None] + 256 + c[None, :], to_bf16(o1), mask=hmask[:, None])
        tl.store(lse_ptr + (b * h_q + heads) * s_q + s_idx, tl.where(empty, float("inf"), lse), mask=lmask)


@triton.jit
def combine_kernel(po_ptr, plse_ptr, out_ptr, lse_ptr, sink_ptr, s_q, h_q, num_splits,
                   HAS_SINK: tl.constexpr, BLOCK_HC: tl.constexpr):
    """Merge the split partials of BLOCK_HC heads of one query token; apply the sink."""
    tok = tl.program_id(0)
    hb = tl.program_id(1)
    b = tok // s_q
    s_idx = tok - b * s_q
    heads = hb * BLOCK_HC + tl.arange(0, BLOCK_HC)
    hmask = heads < h_q
    c = tl.arange(0, 512)
    base = tok.to(tl.int64) * num_splits * h_q
    m = tl.full([BLOCK_HC], float("-inf"), tl.float32)
    for sp in range(0, num_splits):
        m = tl.maximum(m, tl.load(plse_ptr + base + sp * h_q + heads, mask=hmask, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wsum = tl.zeros([BLOCK_HC], tl.float32)
    acc = tl.zeros([BLOCK_HC, 512], tl.float32)
    for sp in range(0, num_splits):
        row = base + sp * h_q + heads
        w = tl.exp2(tl.load(plse_ptr + row, mask=hmask, other=float("-inf")) - m_safe)
        o = tl.load(po_ptr + row[:, None] * 512 + c[None, :], mask=hmask[:, None] & (w[:, None] > 0),
                    other=0.0).to(tl.float32)
        wsum += w
        acc += w[:, None] * o
    empty = wsum == 0.0
    wsafe = tl.where(empty, 1.0, wsum)
    lse = (m_safe + tl.log2(wsafe)) * 0.6931471805599453
    out = acc / wsafe[:, None]
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
        out = out * (1.0 / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse))))[:, None]
    out = tl.where(empty[:, None], 0.0, out)
    tl.store(out_ptr + (tok.to(tl.int64) * h_q + heads)[:, None] * 512 + c[None, :],
             to_bf16(out), mask=hmask[:, None])
    tl.store(lse_ptr + (b * h_q + heads) * s_q + s_idx, tl.where(empty, float("inf"), lse), mask=hmask)


#: the combine kernel's launch: heads per program and warps
COMBINE = {"block_hc": 1, "num_warps": 4}

#: the Gluon sm_90 kernel's four forms, as MMAConfig fields, for forcing one (GPU tests, the
#: GPU validation): heads as M; tokens as M with 16 heads x 64 tokens, 8 heads x 128 tokens, or
#: 8 heads and two consumer warpgroups
GLUON_FORMS = {"heads as M": dict(kernel="wgmma"),
               "tokens as M, 16 x 64": dict(kernel="wgmma", tokens_as_m=True),
               "tokens as M, 8 x 128": dict(kernel="wgmma", tokens_as_m=True, block_n=128),
               "tokens as M, two consumers": dict(kernel="wgmma", tokens_as_m=True, duo=True)}


@dataclass(frozen=True)
class MMAConfig:
    """Launch parameters of :func:`mma_decode_kernel`."""

    block_h: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 1
    ctas_per_sm: int = 1      # split heuristic: how many programs one SM runs at once
    fp8: str = "auto"         # "auto" | "native" (fp8e4nv) | "int" (integer decode)
    tokens_as_m: bool = False  # dots with the token tile as M (transposed) instead of the heads
    prefetch: bool = False     # hand-pipelined loop: next tile's bytes in flight during the math
    dot: str = "fp16"          # tensor-core operand type: "fp16" (P to 2**-11) or "bf16" (P to 2**-8)
    p_split: bool = False      # bf16 only: P.V with P as two bf16 terms (hi + lo), 2x the P.V work
    ablate: int = 0            # timing ablations only, results wrong (1: no gather; 512: no combine;
                               # the Gluon kernel's own bits: mla.kernels.wgmma.wgmma_decode_kernel)
    dv_halves: int = 1         # 2: two programs per head block, each owning 256 output columns
    partial_fp16: bool = True  # split partial outputs stored as fp16 (half the traffic of fp32)
    maxnreg: int = 0           # registers per thread ptxas may use (0: its own choice, up to 255)
    kernel: str = "tl"         # "tl": the portable tl.dot kernel; "wgmma": the Gluon sm_90 kernel (mla.kernels.wgmma)
    duo: bool = False          # wgmma, tokens as M: two consumer warpgroups on alternate 64-token tiles (8 heads)

    @property
    def label(self) -> str:
        """Which kernel and variant this config runs, in words (for tables)."""
        if self.kernel == "wgmma":
            if not self.tokens_as_m:
                return "Gluon, heads as M"
            duo = ", two consumers" if self.duo else ""
            return f"Gluon, tokens as M ({self.block_h} heads x {self.block_n} tokens{duo})"
        return "tl.dot" + (", split P.V" if self.dv_halves == 2 else "")

    def for_heads(self, h_q: int) -> "MMAConfig":
        """BLOCK_H never exceeds h_q rounded up to a power of two, and never drops below 16
        (the smallest M of a tensor-core dot): heads are padded inside the kernel. The wgmma
        kernel's head block is 64 (one warpgroup's M), or with ``tokens_as_m`` (the N of its
        S^T = K.Q^T) 16, or 8 with 128-token tiles."""
        if self.kernel == "wgmma":
            if self.duo:
                return dataclasses.replace(self, block_h=8)
            return dataclasses.replace(self, block_h=(8 if self.block_n == 128 else 16) if self.tokens_as_m else 64)
        return dataclasses.replace(self, block_h=max(16, min(self.block_h, triton.next_power_of_2(h_q))))


INTERPRETER_CONFIG = MMAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
_DOT_TYPES = {"fp16": tl.float16, "bf16": tl.bfloat16}


def default_config(h_q: int, device: torch.device) -> MMAConfig:
    """The shipped config for this GPU and h_q (see :mod:`mla.configs`), else a generic one."""
    if _runtime.INTERPRET or device.type != "cuda":
        return INTERPRETER_CONFIG.for_heads(h_q)
    from .. import configs

    return configs.lookup(h_q, device).for_heads(h_q)


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def num_splits(b: int, s_q: int, h_q: int, topk_total: int, cfg: MMAConfig, sms: int) -> int:
    """Split-K count from the shapes alone (no host sync). Models the time as (waves of programs)
    x (token tiles per program) and takes the cheapest split, preferring fewer splits on a tie
    (each split adds partial-output traffic and, past one, the combine kernel)."""
    progs = b * s_q * triton.cdiv(h_q, cfg.block_h) * cfg.dv_halves
    tiles = max(1, triton.cdiv(topk_total, cfg.block_n))
    slots = max(1, sms * cfg.ctas_per_sm)
    best, best_cost = 1, None
    for s in range(1, tiles + 1):
        cost = triton.cdiv(progs * s, slots) * triton.cdiv(tiles, s) + (0.5 if s > 1 else 0.0) + 0.01 * s
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def small_grid(cfg: MMAConfig, b: int, s_q: int, h_q: int, topk_total: int, sms: int) -> bool:
    """Whether even one token tile per program gives fewer than half as many programs as SMs."""
    programs = b * s_q * triton.cdiv(h_q, cfg.block_h) * max(1, triton.cdiv(topk_total, cfg.block_n))
    return 2 * programs <= sms


def fill_small_grid(cfg: MMAConfig, b: int, s_q: int, h_q: int, topk_total: int, sms: int) -> MMAConfig:
    """The default config, adjusted for a grid too small to fill the GPU (:func:`small_grid`):
    when the head block is 64, use two programs per head block (``dv_halves=2``, one warpgroup
    each). Each repeats S = Q.K^T but owns half of P.V, so twice as many SMs work on the same
    query. At larger grids the repeated Q.K^T and the 4-warp programs cost more than they gain
    (results/h200/mma_versions.json)."""
    if cfg.dv_halves != 1 or cfg.block_h != 64 or cfg.tokens_as_m or cfg.p_split or cfg.kernel != "tl":
        return cfg
    if not small_grid(cfg, b, s_q, h_q, topk_total, sms):
        return cfg
    return dataclasses.replace(cfg, dv_halves=2, num_warps=4, num_stages=1)


def launch_config(b: int, s_q: int, h_q: int, topk_total: int, device: torch.device) -> MMAConfig:
    """The config that a call with no explicit ``config`` launches.

    On a Hopper GPU (sm_90) with a Gluon config (:func:`mla.configs.hopper`) the Gluon kernel
    (:mod:`mla.kernels.wgmma`) runs every call: heads as M where h_q > 16 and the grid fills the
    GPU; tokens as M (:func:`tokens_as_m`) where h_q <= 16 or the grid is small
    (:func:`small_grid`). Anything else runs the portable ``tl.dot`` kernel with the shipped
    config for h_q, two programs per head block when the grid is small (:func:`fill_small_grid`).
    Measured on the H200: heads as M (v19, results/h200/mma_probe_r19d.json) is 1.2 to 1.9x
    faster than the tl.dot kernel's record (r9) from b = 32 up and 10 to 31% slower at b = 1,
    where tokens as M is faster than both (see :func:`tokens_as_m`).
    A Gluon pick whose caches it cannot copy (:func:`mla.kernels.wgmma.row_align`) falls back
    to the ``tl.dot`` config in :func:`mma_sparse_decode`."""
    cfg = default_config(h_q, device)
    if _runtime.INTERPRET or device.type != "cuda":
        return cfg
    from .. import configs

    hop = configs.hopper(device) if gluon_hopper_available() else None
    return choose_config(cfg, hop, b, s_q, h_q, topk_total, sm_count(device))


def choose_config(cfg: MMAConfig, hop: MMAConfig | None, b: int, s_q: int, h_q: int, topk_total: int,
                  sms: int) -> MMAConfig:
    """The launch rule of :func:`launch_config` on given facts, no GPU needed: ``cfg`` the
    shipped ``tl.dot`` config for h_q, ``hop`` the Gluon config (None: no Hopper GPU, or no
    Gluon), ``sms`` the GPU's SM count."""
    small = small_grid(cfg, b, s_q, h_q, topk_total, sms)
    if hop is not None and (h_q <= 16 or small):
        return tokens_as_m(hop, b, s_q, h_q, sms)
    if small:
        return fill_small_grid(cfg, b, s_q, h_q, topk_total, sms)
    return hop.for_heads(h_q) if hop is not None else cfg


def tokens_as_m(hop: MMAConfig, b: int, s_q: int, h_q: int, sms: int) -> MMAConfig:
    """The Gluon kernel's tokens-as-M config, for few heads (V4-TP8 has 8) and for small grids:
    the token tile as the M of the dots and 16 heads as N, so 8 heads are padded to 16 instead
    of 64, and 64 heads make four programs per query token where heads as M make one (at b = 1
    that puts four times as many SMs on the query). With h_q <= 8 and at least half as many
    query tokens as SMs, 8 heads and 128-token tiles (each tile read once for S, the loop's
    fixed costs paid once per 128 tokens; its ring cannot run ahead of the consumers, which
    costs more than it saves at small grids); below that, 8 heads and two consumer warpgroups
    on alternate 64-token tiles (:func:`mla.kernels.wgmma._consumer_d`): V4-TP8 b = 32 in 16.3 us
    against 17.5 with 16 heads, b = 1 in 9.5 us with either (results/h200/mma_probe_r25g.json;
    15.6 us at b = 32 once its consumers got 216 registers, mma_probe_r26a.json). Earlier, on
    the H200: V4-TP8 b = 1, 32, 128 in
    9.8, 17.0, 35.7 us with 16 heads and 10.7, 17.6, 31.3 us with 8 x 128, against 10.0, 19.6,
    41.7 in the record r21 (results/h200/mma_probe_r22d.json); DSA b = 1 in 14.4 us and V4-CSA
    b = 1 in 10.6 us with 16 heads, against 18.4 and 12.7 for the tl.dot kernel's split P.V in
    the same call (mma_probe_r22e.json; 16.4 and 12.5 in r21)."""
    cfg = dataclasses.replace(hop, tokens_as_m=True, block_n=64)
    if h_q <= 8:
        cfg = dataclasses.replace(cfg, **(dict(block_n=128) if 2 * b * s_q >= sms else dict(duo=True)))
    return cfg.for_heads(h_q)


@functools.lru_cache(maxsize=None)
def gluon_hopper_available() -> bool:
    """Whether this Triton has Gluon's Hopper module (Triton 3.5 and newer), which the sm_90
    kernel is written in."""
    try:
        from . import wgmma  # noqa: F401
    except (ImportError, AttributeError):     # no Gluon, or a Gluon without the names it uses
        return False
    return True


def mma_sparse_decode(q, k_cache, indices, softmax_scale=None, attn_sink=None, topk_length=None,
                      extra_k_cache=None, extra_indices=None, extra_topk_length=None,
                      config: MMAConfig | None = None, splits: int | None = None):
    """Launch the MMA kernel (and the combine when split). Arguments as :func:`mla.sparse_decode`."""
    b, s_q, h_q, _ = q.shape
    dev = q.device
    topk_total = indices.shape[-1] + (extra_indices.shape[-1] if extra_k_cache is not None else 0)
    cfg = config.for_heads(h_q) if config is not None else launch_config(b, s_q, h_q, topk_total, dev)
    if cfg.dv_halves not in (1, 2) or (cfg.dv_halves == 2 and (cfg.tokens_as_m or cfg.p_split)):
        raise ValueError(f"config: dv_halves must be 1 or 2, and 2 does not combine with tokens_as_m or "
                         f"p_split; got {cfg}")
    if not (cfg.maxnreg == 0 or 16 <= cfg.maxnreg <= 255):
        raise ValueError(f"config: maxnreg must be 0 (no cap) or 16..255 registers per thread; got {cfg.maxnreg}")
    if cfg.kernel not in ("tl", "wgmma"):
        raise ValueError(f"config: kernel must be 'tl' or 'wgmma'; got {cfg.kernel!r}")
    if cfg.kernel == "wgmma":
        fixed = dict(num_warps=8, num_stages=1, dot="fp16", prefetch=False, p_split=False, dv_halves=1)
        off = {k: getattr(cfg, k) for k, v in fixed.items() if getattr(cfg, k) != v}
        if (cfg.block_n not in ((64, 128) if cfg.tokens_as_m and not cfg.duo else (64,)) or cfg.fp8 == "int" or off
                or (cfg.duo and not cfg.tokens_as_m)):
            raise ValueError(f"config: the wgmma kernel takes block_n 64, or 128 with tokens_as_m and not duo (its "
                             f"shared memory is sized for them), duo only with tokens_as_m, native fp8 and {fixed}; "
                             f"got block_n={cfg.block_n}, tokens_as_m={cfg.tokens_as_m}, duo={cfg.duo}, "
                             f"fp8={cfg.fp8!r}"
                             + (f", {off}" if off else ""))
    if cfg.kernel == "wgmma" and (_runtime.INTERPRET or dev.type != "cuda"
                                  or torch.cuda.get_device_capability(dev) != (9, 0)):
        raise ValueError("config: kernel='wgmma' is the Gluon sm_90 kernel: it needs a Hopper GPU (sm_90, not "
                         f"the interpreter); this device is {dev}")
    scale = D_QK ** -0.5 if softmax_scale is None else float(softmax_scale)
    q = q.contiguous()
    indices = indices.contiguous()
    out = torch.empty(b, s_q, h_q, D_QK, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=dev)
    kc, kst, kp, kn = cache_args(k_cache)
    topk = indices.shape[-1]
    has_extra = extra_k_cache is not None
    if has_extra:
        ec, est, ep, en = cache_args(extra_k_cache)
        eidx, etopk = extra_indices.contiguous(), extra_indices.shape[-1]
    else:
        ec, est, ep, en, eidx, etopk = kc, kst, kp, kn, indices, 0
    if cfg.kernel == "wgmma":
        from .wgmma import row_align

        align = row_align((kc, kst), (ec, est))
        if not align and config is not None:
            raise ValueError("config: kernel='wgmma' copies cache rows 8 or 16 bytes at a time: it needs caches whose "
                             "base addresses are multiples of 16 and page strides multiples of 8")
        if not align:       # the launch rule's pick: the tl.dot kernel reads any alignment
            cfg = default_config(h_q, dev)
    ns = splits if splits is not None else num_splits(b, s_q, h_q, topk_total, cfg, sm_count(dev))
    n_hb = triton.cdiv(h_q, cfg.block_h)
    if ns > 1:
        po = torch.empty(b * s_q, ns, h_q, D_QK, dtype=torch.float16 if cfg.partial_fp16 else torch.float32,
                         device=dev)
        plse = torch.empty(b * s_q, ns, h_q, dtype=torch.float32, device=dev)
    else:
        po = plse = lse
    sink = attn_sink if attn_sink is not None else lse
    args = (q, out, lse, sink, po, plse,
            kc, kst, kp, kn, indices, topk, topk_length if topk_length is not None else indices,
            ec, est, ep, en, eidx, etopk, extra_topk_length if extra_topk_length is not None else indices,
            s_q, h_q, scale * LOG2E, ns)
    flags = dict(HAS_SINK=attn_sink is not None, HAS_LEN=topk_length is not None, HAS_EXTRA=has_extra,
                 HAS_ELEN=extra_topk_length is not None, PARTIAL=ns > 1, BLOCK_N=cfg.block_n, ABLATE=cfg.ablate,
                 **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    if cfg.kernel == "wgmma":
        from . import wgmma

        flags["BLOCK_N"] = 64       # the ring's tiles; a 128-token tile is two of them (U = 2)
        wgmma.wgmma_decode_kernel[(n_hb, ns, b * s_q)](
            *args, **flags, ALIGN=align, BH=cfg.block_h, U=cfg.block_n // 64, **wgmma.launch_options(cfg.duo))
    else:
        mma_decode_kernel[(n_hb * cfg.dv_halves, ns, b * s_q)](
            *args, **flags, BLOCK_H=cfg.block_h,
            FP8_NATIVE=fp8_native(dev) if cfg.fp8 == "auto" else cfg.fp8 == "native",
            DOT=_runtime.dot_dtype() if _runtime.INTERPRET else _DOT_TYPES[cfg.dot],
            TOKENS_AS_M=cfg.tokens_as_m, PREFETCH=cfg.prefetch,
            P_SPLIT=cfg.p_split and not _runtime.INTERPRET, DV_HALVES=cfg.dv_halves,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if ns > 1 and not cfg.ablate & 512:
        bhc = COMBINE["block_hc"]
        combine_kernel[(b * s_q, triton.cdiv(h_q, bhc))](
            po, plse, out, lse, sink, s_q, h_q, ns, HAS_SINK=attn_sink is not None, BLOCK_HC=bhc,
            num_warps=COMBINE["num_warps"])
    return out, lse
