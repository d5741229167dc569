"""The consumer side of the Gluon kernel: decode each ring tile, S, the online softmax, P.V, and
each piece's output.

Three forms, one function each:

- :func:`consumer_heads` (heads as M, 64 heads): two warpgroups decode a tile into one fp16 tile
  buffer ``K[64, 512]`` (K for S = Q.K^T and V for O += P.V), compute S split by columns
  (warpgroup ``w`` takes tokens ``32w ..``, nothing twice), then P.V with O ``[64, 512]`` split
  by columns (256 per warpgroup); for DeepSeek-V3.2's cache (``V32``) S adds Q's and the ring
  stage's 64 bf16 rope columns, and V is the 512 FP8 columns;
- :func:`consumer_tokens` (tokens as M, 16 or 8 heads): the token tile is the M of both dots,
  ``S^T = K.Q^T`` and ``O^T += V^T.P^T``, so that few heads are padded to 16 or 8, not 64; with
  8 heads a tile is two ring stages (128 tokens);
- :func:`consumer_pair` (tokens as M, 8 heads, two consumers): two warpgroups on alternate ring
  tiles, each with its own tile buffer; each 64-dim group is decoded once, into registers that
  are S^T's A operand directly and the source of the tile buffer.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)

from ..common import DIM, LN2, NOPE_TILES, ROPE_W, finish_softmax, piece, query_rows, sink_factor, softmax_step, tile_source, \
    to_bf16, token_rows, ue8m0_to_f32
from .compat import cta_barrier, reinterpret
from .ring import RING_N, tile_rows

#: Q's loads and O's stores, and the tokens-as-M forms' O^T once turned around: rows of 16-byte
#: accesses, a warp's 32 threads on a row's 512 contiguous bytes (8 warps, 8 rows at a time)
ROWS_L = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))
#: the same rows for a kernel of 4 warps (the two-consumer form)
ROWS_L4 = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))
#: the tokens-as-M forms' O [HEADS, 512] fp32 in shared memory, on its way from O^T's wgmma
#: layout to ROWS_L: groups of 8 columns swizzled by head pair, so that neither the wgmma layout's
#: stores (8 columns x 4 head pairs a warp) nor ROWS_L's row reads fall in the same banks (an
#: unswizzled O^T [512, HEADS] read by rows is a 32-way bank conflict per load)
O_STAGE = gl.constexpr(gl.SwizzledSharedLayout(8, 2, 8, [1, 0]))
#: a ring stage read back for the decode: a warp reads 64 bytes of each of 8 tokens
DECODE_L = gl.constexpr(gl.BlockedLayout([1, 8, 16], [8, 1, 4], [8, 1, 1], [2, 1, 0]))

#: The two-consumer form's reads of one 64-dim group of a ring stage (:func:`_decode_group`),
#: ``[64 tokens, 1, 64]``, FP8 or bf16 (the rope): each thread gets 16 contiguous dims of two
#: token rows, in the registers of a wgmma A operand (``DotOperandLayout(0, ACC, 2)`` of a
#: 4-warp accumulator ``ACC``: thread (warp w, lane 4g+t) holds rows 16w+g+8i and reduction
#: indices 2t+e+8h+16c) once the reduction index ``c*16+h*8+2t+e`` is taken to be dim
#: ``t*16+c*4+h*2+e`` of the group; Q is stored in that order (:func:`load_q_pair`).
GL = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [8, 0, 0]],
    lane_bases=[[0, 0, 16], [0, 0, 32], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 1, 64]))


@gluon.jit
def load_q(q_row, q_sh, h_q, hb, q_smem, HEADS: gl.constexpr, RL: gl.constexpr = ROWS_L):
    """Q's heads ``hb*HEADS ..`` of one query row (``q_row``: its first head; heads ``q_sh``
    apart) into shared memory as fp16 (zeros past h_q), loaded as rows of 16-byte loads (a warp's
    32 threads on 512 contiguous bytes) in layout ``RL``."""
    qh = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, RL))
    qc = gl.arange(0, DIM, layout=gl.SliceLayout(0, RL))
    qv = gl.load(q_row + (qh.to(gl.int64) * q_sh)[:, None] + qc[None, :], mask=(qh < h_q)[:, None], other=0.0)
    q_smem.store(qv.to(gl.float16))


@gluon.jit
def _load_q_rope(q_row, q_sh, h_q, hb, qr_smem, HEADS: gl.constexpr):
    """V3.2's Q rope: columns 512 .. 575 of heads ``hb*HEADS ..`` into shared memory as bf16, as
    they are (zeros past h_q)."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    qh = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, L))
    qc = DIM + gl.arange(0, ROPE_W, layout=gl.SliceLayout(0, L))
    qr_smem.store(gl.load(q_row + (qh.to(gl.int64) * q_sh)[:, None] + qc[None, :], mask=(qh < h_q)[:, None],
                          other=0.0))


@gluon.jit
def _store_tile_v32(kb, nb, sc, OUT: gl.constexpr):
    """V3.2's tile decode: all 8 groups of ``[BLOCK_N, 8, 64]`` are FP8, group ``g`` times the
    token's float32 scale ``g // 2`` (``sc [BLOCK_N, 4]``, each scale duplicated onto its two
    groups in registers), stored as one ``[BLOCK_N, 512]`` block into the tile buffer ``kb``."""
    L2: gl.constexpr = gl.SliceLayout(2, nb.type.layout)
    scale = gl.convert_layout(gl.reshape(gl.join(sc, sc), [sc.shape[0], 8]), L2, assert_trivial=True)
    v = nb.to(gl.float8e4nv, bitcast=True).to(OUT) * scale[:, :, None].to(OUT)
    kb.store(gl.reshape(v, [v.shape[0], DIM]))


@gluon.jit
def _store_tile(kb, nb, sb, rope, OUT: gl.constexpr):
    """Decode one tile's raw bytes, read back from the ring in layout ``[BLOCK_N, 8, 64]`` (FP8
    times its UE8M0 scale; the rope, which broadcasts onto group 7, as it is) and store it, as
    one ``[BLOCK_N, 512]`` block, into the tile buffer ``kb``. One store: Triton 3.6 puts a
    barrier between any two stores into one allocation, slices or not."""
    scale = ue8m0_to_f32(sb)
    v = nb.to(gl.float8e4nv, bitcast=True).to(OUT) * scale[:, :, None].to(OUT)
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, nb.type.layout)))
    v = gl.where((g < NOPE_TILES)[None, :, None], v, rope.to(OUT))
    kb.store(gl.reshape(v, [v.shape[0], DIM]))


@gluon.jit
def _store_o(ptr, rows, hmask, o, RL: gl.constexpr, stage):
    """Store ``o [HEADS, 512]`` (16-bit) at ``ptr + rows*512`` as rows of 16-byte stores, a warp's
    32 threads on 512 contiguous bytes, in layout ``RL`` (:data:`ROWS_L`, or :data:`ROWS_L4` in
    a 4-warp partition): moved into it through ``stage`` (the tile buffer, as ``o``'s dtype,
    once every warp is past the last wgmma that reads it), or, where ``stage`` is None, by a
    layout conversion (through scratch shared memory of its own)."""
    if stage is None:
        o = gl.convert_layout(o, RL)
    else:
        cta_barrier()
        stage.store(o)
        cta_barrier()
        o = stage.load(RL)
    rows = gl.convert_layout(rows, gl.SliceLayout(1, RL))
    hm = gl.convert_layout(hmask, gl.SliceLayout(1, RL))
    c = gl.arange(0, DIM, layout=gl.SliceLayout(0, RL))
    gl.store(ptr + rows[:, None] * DIM + c[None, :], o, mask=hm[:, None])


@gluon.jit
def store_piece(o, m_i, l_i, hb, q, s_q, h_q, split, slot, out_ptr, lse_ptr, sink_ptr, sink_stride, po_ptr, plse_ptr,
                HAS_SINK: gl.constexpr, HEADS: gl.constexpr, O_L: gl.constexpr, RL: gl.constexpr = ROWS_L,
                stage_fp16=None, stage_bf16=None):
    """Normalize one piece's O (in layout ``O_L``) and store it with its LSE: a whole query's
    final output (sink applied), or a split one's partial in ``slot`` for the combine. O leaves as
    rows of 16-byte stores in layout ``RL`` (in the heads-as-M wgmma's layout each thread would
    store 4 bytes at a time), staged through the tile buffer's views ``stage_fp16`` and
    ``stage_bf16`` where given (:func:`_store_o`)."""
    heads = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, O_L))
    hmask = heads < h_q
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, O_L))
    empty, l_safe, lse2 = finish_softmax(l_o, m_o)
    o = o / l_safe[:, None]
    if split:
        prow = slot.to(gl.int64) * h_q + heads
        gl.store(plse_ptr + prow, gl.where(empty, float("-inf"), lse2), mask=hmask)
        _store_o(po_ptr, prow, hmask, o.to(gl.float16), RL, stage_fp16)
    else:
        lse = lse2 * LN2
        if HAS_SINK:
            sink = gl.load(sink_ptr + heads * sink_stride, mask=hmask, other=0.0)
            o = o * sink_factor(sink, lse, empty)[:, None]
        o = gl.where(empty[:, None], 0.0, o)
        _store_o(out_ptr, q.to(gl.int64) * h_q + heads, hmask, to_bf16(o), RL, stage_bf16)
        b = q // s_q
        gl.store(lse_ptr + (b * h_q + heads) * s_q + (q - b * s_q), gl.where(empty, float("inf"), lse), mask=hmask)


@gluon.jit
def consumer_heads(hb, p, x0, x1, q0, c0, q_end, s_q, h_q, q_ptr, q_sb, q_ss, q_sh, out_ptr, lse_ptr, sink_ptr,
                   sink_stride, po_ptr, plse_ptr, idx_ptr, idx_sb, idx_ss, topk, len_ptr, len_stride, eidx_ptr,
                   eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride, q_smem, k_smem, kbf_smem, p_smem, nope_r, rope_r, sc_r, ready,
                   empty, kc_ptr, kc_stride, kc_P, kc_n, ec_ptr, ec_stride, ec_P, ec_n, sm_scale_log2, qr_smem,
                   HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_ELEN: gl.constexpr,
                   ALIGN: gl.constexpr, STAGES: gl.constexpr, HEADS: gl.constexpr, V32: gl.constexpr = False):
    """The default partition of the heads-as-M form (8 warps), over the pieces of its program's
    share of the work list, query after query: Q in, then per tile decode from the ring into the
    tile buffer, release the stage, S, the softmax step and P.V; the piece's output out, through
    the tile buffer (``kbf_smem``: its bf16 view). ``V32``: Q's rope in ``qr_smem``, and the stage
    released at the barrier after S, which reads its rope in place."""
    OUT: gl.constexpr = gl.float16
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, RING_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    SCOL_L: gl.constexpr = gl.SliceLayout(0, S_L)
    s_zero = gl.zeros([HEADS, RING_N], gl.float32, layout=S_L)
    j = c0 * 0
    c = c0
    for q in range(q0, q_end):
        lo, hi, split, tiles1, n1, n2, units = piece(q, c, x0, x1, s_q, topk, len_ptr, len_stride, etopk, elen_ptr,
                                                     elen_stride, RING_N, 1, HAS_LEN, HAS_EXTRA, HAS_ELEN)
        q_off, i_off, e_off = query_rows(q, s_q, q_sb, q_ss, idx_sb, idx_ss, eidx_sb, eidx_ss)
        idx_main = idx_ptr + i_off
        idx_extra = eidx_ptr + e_off
        # Q -> shared memory (fp16, heads past h_q as zeros) while the producer's copies fly; every
        # S of the last piece is done (both warpgroups passed its last barrier before P.V), and the
        # barrier at the top of this piece's first tile orders the store before its first wgmma.
        load_q(q_ptr + q_off, q_sh, h_q, hb, q_smem, HEADS)
        if V32:
            _load_q_rope(q_ptr + q_off, q_sh, h_q, hb, qr_smem, HEADS)
        m_i = gl.full([HEADS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([HEADS], gl.float32, layout=gl.SliceLayout(1, S_L))
        o = gl.zeros([HEADS, DIM], gl.float32, layout=O_L)
        for ti in range(lo, hi):
            st = j % STAGES
            # This tile's score mask in S's column layout, loaded now so that its latency is spent
            # in the wait and the decode (an index reload that hits in cache costs less than moving
            # the mask between layouts).
            _c, vs, _r, _s = tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                       ec_stride, ec_P, ec_n, idx_extra, n2, RING_N, HAS_EXTRA, SCOL_L, ALIGN, V32)
            mbarrier.wait(ready.index(st), (j // STAGES) & 1)
            cta_barrier()          # both warpgroups are past their P.V of the last tile: the tile buffer is free
            nb = nope_r.index(st).load(DECODE_L)
            if V32:
                sc = sc_r.index(st).load(gl.SliceLayout(2, DECODE_L))
                _store_tile_v32(k_smem, nb, sc, OUT)
            else:
                rope = rope_r.index(st).load(DECODE_L)
                sb = sc_r.index(st).load(gl.SliceLayout(2, DECODE_L))
                _store_tile(k_smem, nb, sb, rope, OUT)
            fence_async_shared()
            cta_barrier()
            if not V32:
                mbarrier.arrive(empty.index(st))   # every consumer thread has read the stage
            s_tok = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if V32:                                # S's rope part, read from the stage in place
                s_tok = warpgroup_mma(qr_smem, rope_r.index(st).permute((1, 0)), s_tok, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
            pr, alpha, m_i, l_i = softmax_step(s, vs, m_i, l_i, sm_scale_log2, 1)
            p_smem.store(pr.to(OUT))
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            fence_async_shared()
            cta_barrier()
            if V32:
                mbarrier.arrive(empty.index(st))   # both warpgroups' S, the stage's last readers, are done
            o_tok = warpgroup_mma(p_smem, k_smem, o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
            j += 1
        split = (c < x0) | (c + units > x1)
        store_piece(o, m_i, l_i, hb, q, s_q, h_q, split, 2 * p + (q != q0).to(gl.int32), out_ptr, lse_ptr, sink_ptr,
                    sink_stride, po_ptr, plse_ptr, HAS_SINK, HEADS, O_L, ROWS_L, k_smem, kbf_smem)
        c += units


@gluon.jit
def _units_mask(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n,
                idx_extra, n2, RING_TILES: gl.constexpr, HAS_EXTRA: gl.constexpr, ROW_L: gl.constexpr):
    """The valid mask of ring tiles ``ti .. ti+RING_TILES-1`` as one vector (row ``r`` is token
    ``r % RING_N`` of tile ``ti + r // RING_N``); a tile at or past ``hi`` is all invalid."""
    r = gl.arange(0, RING_TILES * RING_N, layout=ROW_L)
    t_i = ti + r // RING_N
    _c, idx_row, t, n, n_tokens, P, stride = tile_source(t_i, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                                         ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, HAS_EXTRA)
    n = gl.where(t_i < hi, n, 0)
    valid, _r, _s = token_rows(idx_row, t * RING_N + r % RING_N, n, n_tokens, P, stride)
    return valid


@gluon.jit
def consumer_tokens(hb, p, x0, x1, q0, c0, q_end, s_q, h_q, q_ptr, q_sb, q_ss, q_sh, out_ptr, lse_ptr, sink_ptr,
                    sink_stride, po_ptr, plse_ptr, idx_ptr, idx_sb, idx_ss, topk, len_ptr, len_stride, eidx_ptr,
                    eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride, q_smem, k_smem, p_smem, nope_r, rope_r, sc_r,
                    ready, empty, kc_ptr, kc_stride, kc_P, kc_n, ec_ptr, ec_stride, ec_P, ec_n, sm_scale_log2,
                    HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_ELEN: gl.constexpr,
                    ALIGN: gl.constexpr, STAGES: gl.constexpr, HEADS: gl.constexpr, RING_TILES: gl.constexpr):
    """The default partition of the tokens-as-M forms, over the pieces of its program's share:
    ``S^T[TN, HEADS] = K.Q^T`` and ``O^T[512, HEADS] += V^T.P^T`` (V^T read from the same tile
    buffer, transposed; the 512 rows split over the warpgroups); the softmax runs down S^T's
    columns. A tile is ``RING_TILES`` ring tiles (``TN`` tokens):

    - 1 tile, 16 heads: each warpgroup computes S^T for 8 of the heads, so both read the whole
      tile for it;
    - 2 tiles, 8 heads: a 128-token tile decoded from two ring stages; each warpgroup computes
      S^T for its 64 tokens, so the tile is read once for S and once for P.V, and the loop's
      fixed costs (barriers, waits, reductions) are paid once per 128 tokens."""
    OUT: gl.constexpr = gl.float16
    TN: gl.constexpr = RING_TILES * RING_N
    if RING_TILES == 1:
        ST_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, HEADS // 2, 16])
    else:
        ST_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                       instr_shape=[16, HEADS, 16])
    OT_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, HEADS, 16])
    s_zero = gl.zeros([TN, HEADS], gl.float32, layout=ST_L)
    j = c0 * 0
    c = c0
    for q in range(q0, q_end):
        lo, hi, split, tiles1, n1, n2, units = piece(q, c, x0, x1, s_q, topk, len_ptr, len_stride, etopk, elen_ptr,
                                                     elen_stride, RING_N, RING_TILES, HAS_LEN, HAS_EXTRA, HAS_ELEN)
        q_off, i_off, e_off = query_rows(q, s_q, q_sb, q_ss, idx_sb, idx_ss, eidx_sb, eidx_ss)
        idx_main = idx_ptr + i_off
        idx_extra = eidx_ptr + e_off
        load_q(q_ptr + q_off, q_sh, h_q, hb, q_smem, HEADS)
        m_i = gl.full([HEADS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ST_L))
        l_i = gl.zeros([HEADS], gl.float32, layout=gl.SliceLayout(0, ST_L))
        ot = gl.zeros([DIM, HEADS], gl.float32, layout=OT_L)
        for ti in range(lo, hi, RING_TILES):
            vs = _units_mask(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P,
                             ec_n, idx_extra, n2, RING_TILES, HAS_EXTRA, gl.SliceLayout(1, ST_L))
            for u in gl.static_range(RING_TILES):
                k = j + u
                mbarrier.wait(ready.index(k % STAGES), (k // STAGES) & 1)
            cta_barrier()          # both warpgroups are past their P.V of the last tile: the tile buffer is free
            for u in gl.static_range(RING_TILES):
                st = (j + u) % STAGES
                nb = nope_r.index(st).load(DECODE_L)
                rope = rope_r.index(st).load(DECODE_L)
                sb = sc_r.index(st).load(gl.SliceLayout(2, DECODE_L))
                _store_tile(k_smem.slice(u * RING_N, RING_N), nb, sb, rope, OUT)
                if u + 1 < RING_TILES:     # release this stage now, so that its refill starts during the next decode
                    cta_barrier()
                    mbarrier.arrive(empty.index(st))
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(empty.index((j + RING_TILES - 1) % STAGES))
            s_tok = warpgroup_mma(k_smem, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
            pr, alpha, m_i, l_i = softmax_step(s, vs, m_i, l_i, sm_scale_log2, 0)
            p_smem.store(gl.permute(pr.to(OUT), (1, 0)))
            ot = ot * gl.convert_layout(alpha, gl.SliceLayout(0, OT_L))[None, :]
            fence_async_shared()
            cta_barrier()
            o_tok = warpgroup_mma(k_smem.permute((1, 0)), p_smem.permute((1, 0)), ot, is_async=True)
            ot = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
            j += RING_TILES
        # O^T back to [HEADS, 512], in the layout of the epilogue's row-wise stores, through the tile
        # buffer (free once both warpgroups are past their last P.V; the next piece's first tile
        # waits at its own barrier before it writes the buffer again), held head-major there
        # (:data:`O_STAGE`)
        cta_barrier()
        o_s = reinterpret(k_smem, gl.float32, [HEADS, DIM], O_STAGE)
        o_s.store(gl.permute(ot, (1, 0)))
        cta_barrier()
        o = o_s.load(ROWS_L)
        store_piece(o, m_i, l_i, hb, q, s_q, h_q, split, 2 * p + (q != q0).to(gl.int32), out_ptr, lse_ptr, sink_ptr,
                    sink_stride, po_ptr, plse_ptr, HAS_SINK, HEADS, ROWS_L)
        c += units


@gluon.jit
def _decode_group(nope_st, rope_st, sc_st, g: gl.constexpr):
    """Group ``g`` (dims ``64g ..``) of a ring stage as fp16 ``[64 tokens, 1, 64]`` in :data:`GL`:
    FP8 times its UE8M0 scale (groups 0-6), or the bf16 rope (group 7)."""
    if g < NOPE_TILES:
        raw = nope_st.slice(g, 1, dim=1).load(GL)
        sb = sc_st.slice(g, 1, dim=1).load(gl.SliceLayout(2, GL))
        scale = ue8m0_to_f32(sb)
        v = raw.to(gl.float8e4nv, bitcast=True).to(gl.float16) * scale[:, :, None].to(gl.float16)
    else:
        v = rope_st.load(GL).to(gl.float16)
    return v


@gluon.jit
def _as_a(v, A_L: gl.constexpr):
    """A decoded group (:func:`_decode_group`) as a wgmma A operand ``[64, 64]`` in ``A_L``, its
    reduction index reordered as :data:`GL` says: a renaming of registers, no data movement."""
    v = gl.permute(gl.reshape(v, [64, 4, 4, 2, 2]), (0, 2, 3, 1, 4))
    return gl.convert_layout(gl.reshape(v, [64, 64]), A_L, assert_trivial=True)


@gluon.jit
def load_q_pair(q_row, q_sh, h_q, hb, q_smem, HEADS: gl.constexpr):
    """Q's heads ``hb*HEADS ..`` of one query row into shared memory as fp16 for the two-consumer
    form, each 64-dim group's columns in the order of :data:`GL`: column ``64g + k`` holds dim
    ``64g + 16*((k>>1)&3) + 4*(k>>4) + 2*((k>>3)&1) + (k&1)``."""
    L: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0])
    qh = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, L))
    k = gl.arange(0, DIM, layout=gl.SliceLayout(0, L))
    kg = k & 63
    d = (k >> 6) * 64 + ((kg >> 1) & 3) * 16 + (kg >> 4) * 4 + ((kg >> 3) & 1) * 2 + (kg & 1)
    q = gl.load(q_row + (qh.to(gl.int64) * q_sh)[:, None] + d[None, :], mask=(qh < h_q)[:, None], other=0.0)
    q_smem.store(q.to(gl.float16))


@gluon.jit
def _consumer_pair_loop(WHICH: gl.constexpr, q_smem, k_smem, p_smem, nope_r, rope_r, sc_r, ready, empty, lo, hi,
                        tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra,
                        n2, sm_scale_log2, HAS_EXTRA: gl.constexpr, ALIGN: gl.constexpr, STAGES: gl.constexpr,
                        HEADS: gl.constexpr):
    """One consumer warpgroup of the two-consumer form: ring tiles ``WHICH, WHICH+2, ..`` of the
    program's range, tokens as M. Each 64-dim group of a tile is decoded once, into registers
    that are both S^T's A operand (``S^T = K.Q^T``, Q in :data:`GL`'s order) and the source of
    this consumer's tile buffer (natural order), which is O^T's A (``O^T += V^T.P^T``). The ring
    stage is released as soon as it is decoded. Returns this consumer's (m, l, O^T)."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HEADS, 16])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    m_i = gl.full([HEADS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ACC))
    l_i = gl.zeros([HEADS], gl.float32, layout=gl.SliceLayout(0, ACC))
    ot = gl.zeros([DIM, HEADS], gl.float32, layout=ACC)
    s_zero = gl.zeros([RING_N, HEADS], gl.float32, layout=ACC)
    for ti in range(lo + WHICH, hi, 2):
        j = ti - lo
        st = j % STAGES
        _c, vs, _r, _s = tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride,
                                   ec_P, ec_n, idx_extra, n2, RING_N, HAS_EXTRA, gl.SliceLayout(1, ACC), ALIGN)
        nope_st = nope_r.index(st)
        rope_st = rope_r.index(st)
        sc_st = sc_r.index(st)
        mbarrier.wait(ready.index(st), (j // STAGES) & 1)
        cta_barrier()              # this warpgroup is past its P.V of its last tile: its tile buffer is free
        v = _decode_group(nope_st, rope_st, sc_st, 0)
        k_smem.slice(0, 64, dim=1).store(gl.reshape(v, [64, 64]))
        a = _as_a(v, A_L)
        s = warpgroup_mma(a, q_smem.slice(0, 64, dim=1).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        for g in gl.static_range(1, 8):
            v = _decode_group(nope_st, rope_st, sc_st, g)
            k_smem.slice(64 * g, 64, dim=1).store(gl.reshape(v, [64, 64]))
            a_n = _as_a(v, A_L)
            s = warpgroup_mma(a_n, q_smem.slice(64 * g, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a = warpgroup_mma_wait(num_outstanding=1, deps=(s, a))
            a = a_n
        s, a = warpgroup_mma_wait(num_outstanding=0, deps=(s, a))
        cta_barrier()              # every thread of this warpgroup has read the stage
        mbarrier.arrive(empty.index(st))
        p, alpha, m_i, l_i = softmax_step(s, vs, m_i, l_i, sm_scale_log2, 0)
        p_smem.store(gl.permute(p.to(gl.float16), (1, 0)))
        ot = ot * alpha[None, :]
        fence_async_shared()
        cta_barrier()              # the tile buffer and P are written
        o_tok = warpgroup_mma(k_smem.permute((1, 0)), p_smem.permute((1, 0)), ot, is_async=True)
        ot = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
    return m_i, l_i, ot


@gluon.jit
def consumer_pair(WHICH: gl.constexpr, x_smem, xml_smem, q_smem, k_smem, p_smem, nope_r, rope_r, sc_r, ready,
                  empty, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n,
                  idx_extra, n2, sm_scale_log2, HAS_EXTRA: gl.constexpr, ALIGN: gl.constexpr, STAGES: gl.constexpr,
                  HEADS: gl.constexpr):
    """A worker partition of the two-consumer form: consumer ``WHICH``, which leaves its O^T in
    ``x_smem`` (its own tile buffer, reinterpreted) and its m and l in rows ``2*WHICH`` and
    ``2*WHICH+1`` of ``xml_smem``, for the epilogue to merge."""
    m_i, l_i, ot = _consumer_pair_loop(WHICH, q_smem, k_smem, p_smem, nope_r, rope_r, sc_r, ready, empty, lo, hi,
                                       tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P,
                                       ec_n, idx_extra, n2, sm_scale_log2, HAS_EXTRA, ALIGN, STAGES, HEADS)
    cta_barrier()                  # its last P.V has read the tile buffer that x_smem aliases
    x_smem.store(ot)
    xml_smem.index(2 * WHICH).store(m_i)
    xml_smem.index(2 * WHICH + 1).store(l_i)
