"""The per-head SIMT baseline: one program per (query token, head), no ``tl.dot``.

Each program gathers and dequantizes every selected token itself, scores it with elementwise
products and ``tl.sum``, and keeps an online softmax in float32. The main and the extra cache
go through the same running softmax. Simple and correct; its weakness is by design: the
``h_q`` programs of one query token each re-read, dequantize and score the same tokens, so the
work grows with h_q. (How many of the re-reads L2 serves was never measured; on the H200 the
time follows the (head, token) pairs, not the bytes: chapter 2 of the book.)
With ``V32`` (DeepSeek-V3.2's cache) q is 576 wide: the 512 nope columns score against and
accumulate the token tile, the 64 rope columns only score (V is the nope part).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout import D_V, V32
from .common import DIM, LN2, LOG2E, ROPE_W, V32_QK, cache_args, finish_softmax, fp8_native, load_rope, \
    load_token_tile, sink_factor, to_bf16, token_rows


@triton.jit
def _simt_cache_pass(m_i, l_i, acc, q3, qr, cache_ptr, page_stride, P, n_tokens, idx_row_ptr, n,
                     sm_scale_log2, BLOCK_N: tl.constexpr, FP8_NATIVE: tl.constexpr, V32: tl.constexpr):
    """Fold the first ``n`` selected tokens of one cache into the running softmax state."""
    for start in range(0, n, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        valid, row, srow = token_rows(idx_row_ptr, offs, n, n_tokens, P, page_stride, V32)
        k = load_token_tile(cache_ptr, row, srow, valid, FP8_NATIVE, tl.float32, 0, 8, V32)   # [N, 8, 64]
        s = tl.sum(tl.sum(k * q3[None, :, :], 2), 1)
        if V32:                                                                  # the rope scores too
            s += tl.sum(load_rope(cache_ptr, row, valid, tl.float32, V32) * qr[None, :], 1)
        s = s * sm_scale_log2                                                    # [N], log2 units
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[:, None] + tl.sum(p[:, None, None] * k, 0)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def simt_decode_kernel(
    q_ptr, out_ptr, lse_ptr, sink_ptr,
    kc_ptr, kc_stride, kc_P, kc_n, idx_ptr, topk, len_ptr,
    ec_ptr, ec_stride, ec_P, ec_n, eidx_ptr, etopk, elen_ptr,
    s_q, h_q, sm_scale_log2,
    HAS_SINK: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_ELEN: tl.constexpr,
    BLOCK_N: tl.constexpr, FP8_NATIVE: tl.constexpr, V32: tl.constexpr = False,
):
    tok = tl.program_id(0)            # b * s_q + s
    h = tl.program_id(1)
    b = tok // s_q
    s = tok - b * s_q
    t = tl.arange(0, 8)
    j = tl.arange(0, 64)
    col = (t * 64)[:, None] + j[None, :]                                         # [8, 64] = 512 cols
    QW: tl.constexpr = V32_QK if V32 else DIM                                    # q's width
    q3 = tl.load(q_ptr + (tok.to(tl.int64) * h_q + h) * QW + col).to(tl.float32)
    if V32:
        qr = tl.load(q_ptr + (tok.to(tl.int64) * h_q + h) * QW + DIM + tl.arange(0, ROPE_W)).to(tl.float32)
    else:
        qr = None

    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([8, 64], tl.float32)

    n = topk
    if HAS_LEN:
        n = tl.minimum(n, tl.maximum(tl.load(len_ptr + b), 0))
    m_i, l_i, acc = _simt_cache_pass(m_i, l_i, acc, q3, qr, kc_ptr, kc_stride, kc_P, kc_n,
                                     idx_ptr + tok.to(tl.int64) * topk, n, sm_scale_log2,
                                     BLOCK_N, FP8_NATIVE, V32)
    if HAS_EXTRA:
        ne = etopk
        if HAS_ELEN:
            ne = tl.minimum(ne, tl.maximum(tl.load(elen_ptr + b), 0))
        m_i, l_i, acc = _simt_cache_pass(m_i, l_i, acc, q3, qr, ec_ptr, ec_stride, ec_P, ec_n,
                                         eidx_ptr + tok.to(tl.int64) * etopk, ne, sm_scale_log2,
                                         BLOCK_N, FP8_NATIVE, V32)

    empty, l_safe, lse2 = finish_softmax(l_i, m_i)
    lse = lse2 * LN2                                                            # natural log
    out = acc / l_safe[:, None]
    if HAS_SINK:
        sink = tl.load(sink_ptr + h + tl.zeros([1], tl.int32))
        out = out * sink_factor(sink, lse, empty)[:, None]
    out = tl.where(empty[:, None], 0.0, out)
    lse = tl.where(empty, float("inf"), lse)
    tl.store(out_ptr + (tok.to(tl.int64) * h_q + h) * DIM + col, to_bf16(out))
    tl.store(lse_ptr + (b * h_q + h) * s_q + s + tl.arange(0, 1), lse)


#: tokens per tile and warps of the SIMT kernel's launch
BLOCK_N = 16
NUM_WARPS = 4


def simt_sparse_decode(q, k_cache, indices, softmax_scale=None, attn_sink=None, topk_length=None,
                       extra_k_cache=None, extra_indices=None, extra_topk_length=None, *, out=None, lse=None):
    """Launch the SIMT kernel. Arguments as :func:`mla.sparse_decode` (checked there); ``out``
    and ``lse``, if given, are written in place."""
    b, s_q, h_q, d_qk = q.shape
    scale = d_qk ** -0.5 if softmax_scale is None else float(softmax_scale)
    q = q.contiguous()
    indices = indices.contiguous()
    if out is None:
        out = torch.empty(b, s_q, h_q, D_V, dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    kc, kst, kp, kn = cache_args(k_cache)
    has_extra = extra_k_cache is not None
    if has_extra:
        ec, est, ep, en = cache_args(extra_k_cache)
        eidx, etopk = extra_indices.contiguous(), extra_indices.shape[-1]
    else:
        ec, est, ep, en, eidx, etopk = kc, kst, kp, kn, indices, 1
    grid = (b * s_q, h_q)
    simt_decode_kernel[grid](
        q, out, lse, attn_sink if attn_sink is not None else lse,
        kc, kst, kp, kn, indices, indices.shape[-1], topk_length if topk_length is not None else indices,
        ec, est, ep, en, eidx, etopk, extra_topk_length if extra_topk_length is not None else indices,
        s_q, h_q, scale * LOG2E,
        HAS_SINK=attn_sink is not None, HAS_LEN=topk_length is not None, HAS_EXTRA=has_extra,
        HAS_ELEN=extra_topk_length is not None, BLOCK_N=BLOCK_N, FP8_NATIVE=fp8_native(q.device),
        V32=d_qk == V32.d_qk, num_warps=NUM_WARPS,
    )
    return out, lse
