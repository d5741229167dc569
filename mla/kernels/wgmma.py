"""The Hopper (sm_90) kernel, written in Gluon: the same algorithm as :mod:`mla.kernels.mma`, with
the schedule spelled out instead of left to the compiler.

Why a second kernel: the ``tl.dot`` kernel leaves the tensor cores idle while it gathers and
decodes (every wgmma wait drains the pipe), and Triton lays Q.K^T out so that both warpgroups
compute the same S. Here one program (8 warps, two warpgroups) keeps

- Q (64 heads x 512, fp16) in shared memory for the whole program;
- two token-tile buffers ``K[2][BLOCK_N, 512]`` (fp16) in shared memory, the same tile serving
  as K for S = Q.K^T and as V for O += P.V;
- S = Q.K^T split by columns: warpgroup ``w`` computes tokens ``w*BLOCK_N/2 ..``; nothing is
  computed twice. P goes through shared memory so that both warpgroups see all of it;
- O [64, 512] split by columns, warpgroup ``w`` owning 256 of them (128 fp32 registers a thread).

and per tile it issues S asynchronously, puts the next tile's loads in flight, runs the softmax,
issues P.V asynchronously and decodes the next tile into the other buffer while P.V runs. The
outputs (final, or split partials for :func:`mla.kernels.mma.combine_kernel`) are those of the
``tl.dot`` kernel, so the launch wrapper, the split heuristic and the combine are shared.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .common import split_range, tile_source, token_rows

# Gluon is experimental and its names move: the CTA-wide barrier is gl.thread_barrier in Triton
# 3.6 (the GPU image) and gl.barrier in 3.9 (CPU CI, which compiles this kernel ahead of time).
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

BLOCK_H = 64        #: heads per program: the M of one warpgroup's wgmma
NUM_WARPS = 8       #: two warpgroups


@gluon.jit
def _tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
               ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2,
               BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr, ROW_L: gl.constexpr, ABLATE: gl.constexpr = 0):
    """Token tile ``ti`` of the query's list (main cache's tiles, then the extra cache's), as in
    :func:`mla.kernels.mma._tile_rows` with CLIP: a tile at or past ``hi`` is all invalid."""
    cache, idx_row, t, n, n_tokens, P, stride = tile_source(ti, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                                            ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, HAS_EXTRA)
    n = gl.where(ti < hi, n, 0)
    valid, row, srow = token_rows(idx_row, t * BLOCK_N + gl.arange(0, BLOCK_N, layout=ROW_L), n, n_tokens, P,
                                  stride)
    if ABLATE & 1:      # timing ablation: every tile reads the first tokens of page 0 (cache hits)
        ar = gl.arange(0, BLOCK_N, layout=ROW_L) % kc_P
        cache = kc_ptr
        row = ar.to(gl.int64) * 576
        srow = kc_P * 576 + ar.to(gl.int64) * 8
    return cache, valid, row, srow


@gluon.jit
def _load_tile(cache, valid, row, srow, L3: gl.constexpr):
    """Issue the loads of one token tile as ``[BLOCK_N, 8, 64]`` in layout ``L3`` (a thread holds
    16 columns of all 8 column groups of one token): FP8 bytes of the 7 nope groups (group 7
    masked off), the token's 8-byte scale row, and the bf16 rope ``[BLOCK_N, 1, 64]``, which
    broadcasts onto group 7 at no cost in that layout. Invalid tokens load zeros."""
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    j = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    v2 = valid[:, None]
    v3 = v2[:, :, None]
    nb = gl.load(cache + row[:, None, None] + (g * 64)[None, :, None] + j[None, None, :],
                 mask=v3 & (g < 7)[None, :, None], other=0)
    sb = gl.load(cache + srow[:, None] + g[None, :], mask=v2, other=0)
    rope = gl.load((cache + row + 448).to(gl.pointer_type(gl.bfloat16))[:, None, None] + j[None, None, :],
                   mask=v3, other=0.0)
    return nb, sb, rope


@gluon.jit
def _store_tile(kb, nb, sb, rope, OUT: gl.constexpr):
    """Decode one gathered tile (FP8 times its UE8M0 scale, built as a float's exponent field:
    the arithmetic of :func:`mla.kernels.common.dequant`; rope as it is) and store it, as one
    ``[BLOCK_N, 512]`` block, into the shared-memory buffer ``kb``. One store: Triton 3.6 puts a
    barrier between any two stores into one allocation, slices or not."""
    scale = (sb.to(gl.int32) << 23).to(gl.float32, bitcast=True)
    v = nb.to(gl.float8e4nv, bitcast=True).to(OUT) * scale[:, :, None].to(OUT)
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, nb.type.layout)))
    v = gl.where((g < 7)[None, :, None], v, rope.to(OUT))
    kb.store(gl.reshape(v, [v.shape[0], 512]))


@gluon.jit
def wgmma_decode_kernel(
    q_ptr, out_ptr, lse_ptr, sink_ptr, po_ptr, plse_ptr,
    kc_ptr, kc_stride, kc_P, kc_n, idx_ptr, topk, len_ptr,
    ec_ptr, ec_stride, ec_P, ec_n, eidx_ptr, etopk, elen_ptr,
    s_q, h_q, sm_scale_log2, num_splits,
    HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_ELEN: gl.constexpr,
    PARTIAL: gl.constexpr, BLOCK_N: gl.constexpr, ABLATE: gl.constexpr = 0,
):
    BH: gl.constexpr = 64
    OUT: gl.constexpr = gl.float16
    # Register layouts: S [64, BLOCK_N] and O [64, 512] as wgmma accumulators with the two
    # warpgroups side by side along N (no row is computed twice); loads of 64-column groups.
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    L3: gl.constexpr = gl.BlockedLayout([1, 8, 16], [8, 1, 4], [8, 1, 1], [2, 1, 0])
    ROW_L: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
    SCOL_L: gl.constexpr = gl.SliceLayout(0, S_L)
    Q_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, 512], OUT)
    K_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 512], OUT)
    P_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BLOCK_N], OUT)

    hb = gl.program_id(0)
    split = gl.program_id(1)
    tok = gl.program_id(2)            # b * s_q + s
    b = tok // s_q
    s_idx = tok - b * s_q

    # Q -> shared memory, fp16, heads past h_q as zeros.
    q_smem = gl.allocate_shared_memory(OUT, [BH, 512], Q_S)
    qh = hb * BH + gl.arange(0, BH, layout=ROW_L)
    qc = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None] * 64 + \
        gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    qv = gl.load(q_ptr + ((tok.to(gl.int64) * h_q + qh) * 512)[:, None, None] + qc, mask=(qh < h_q)[:, None, None],
                 other=0.0)
    q_smem.store(gl.reshape(qv.to(OUT), [BH, 512]))

    n1, tiles1, n2, lo, hi = split_range(b, split, topk, len_ptr, etopk, elen_ptr, num_splits, BLOCK_N, HAS_LEN,
                                         HAS_EXTRA, HAS_ELEN)
    idx_main = idx_ptr + tok.to(gl.int64) * topk
    idx_extra = eidx_ptr + tok.to(gl.int64) * etopk

    gl.static_assert(BLOCK_N <= 64, "two [BLOCK_N, 512] fp16 tile buffers must fit beside Q")
    k_smem = gl.allocate_shared_memory(OUT, [2, BLOCK_N, 512], K_S)
    p_smem = gl.allocate_shared_memory(OUT, [BH, BLOCK_N], P_S)

    # Prologue: tile lo into buffer 0; the indices of tile lo+1 in flight.
    cache, valid, row, srow = _tile_rows(lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                         ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, ROW_L, ABLATE)
    nb, sb, rope = _load_tile(cache, valid, row, srow, L3)
    cache, valid, row, srow = _tile_rows(lo + 1, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                         ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, ROW_L, ABLATE)
    _store_tile(k_smem.index(0), nb, sb, rope, OUT)
    fence_async_shared()
    _cta_barrier()

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, S_L))
    o = gl.zeros([BH, 512], gl.float32, layout=O_L)
    s_zero = gl.zeros([BH, BLOCK_N], gl.float32, layout=S_L)
    for ti in range(lo, hi):
        buf = (ti - lo) % 2
        kb = k_smem.index(buf)
        # In flight first: the bytes of tile ti+1 (its indices arrived during the last tile) and
        # the indices of tile ti+2, so neither load's latency sits on this tile's path.
        nb, sb, rope = _load_tile(cache, valid, row, srow, L3)
        cache, valid, row, srow = _tile_rows(ti + 2, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                             ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA,
                                             ROW_L, ABLATE)
        if ABLATE & 2:
            s_tok = s_zero
        else:
            s_tok = warpgroup_mma(q_smem, kb.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # This tile's score mask in S's column layout: an index reload that hits in cache costs
        # less than moving the mask between layouts.
        _c, vs, _r, _s = _tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride,
                                    ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, SCOL_L, ABLATE)
        if ABLATE & 2:
            s = s_tok
        else:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        s = gl.where(vs[None, :], s * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        # P goes through shared memory: each warpgroup computed half of its columns, and each
        # needs all of them as the A operand of its half of P.V.
        p_smem.store(p.to(OUT))
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        fence_async_shared()
        _cta_barrier()
        if ABLATE & 4:
            o_tok = o
        else:
            o_tok = warpgroup_mma(p_smem, kb, o, is_async=True)
        # While P.V runs: decode tile ti+1 into the other buffer (its last readers, the wgmmas of
        # tile ti-1, completed before the barrier above).
        _store_tile(k_smem.index(1 - buf), nb, sb, rope, OUT)
        if ABLATE & 4:
            o = o_tok
        else:
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
        fence_async_shared()
        _cta_barrier()

    heads = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, O_L))
    hmask = heads < h_q
    c = gl.arange(0, 512, layout=gl.SliceLayout(0, O_L))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, O_L))
    empty = l_o == 0.0
    l_safe = gl.where(empty, 1.0, l_o)
    lse2 = m_o + gl.log2(l_safe)                                             # log2 units
    o = o / l_safe[:, None]
    if PARTIAL:
        prow = (tok.to(gl.int64) * num_splits + split) * h_q + heads
        gl.store(plse_ptr + prow, gl.where(empty, float("-inf"), lse2), mask=hmask)
        gl.store(po_ptr + prow[:, None] * 512 + c[None, :], o.to(po_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        lse = lse2 * 0.6931471805599453
        if HAS_SINK:
            sink = gl.load(sink_ptr + heads, mask=hmask, other=0.0)
            o = o * (1.0 / (1.0 + gl.exp(sink - gl.where(empty, 0.0, lse))))[:, None]
        o = gl.where(empty[:, None], 0.0, o)
        orow = out_ptr + (tok.to(gl.int64) * h_q + heads) * 512
        gl.store(orow[:, None] + c[None, :], o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
        gl.store(lse_ptr + (b * h_q + heads) * s_q + s_idx, gl.where(empty, float("inf"), lse), mask=hmask)
