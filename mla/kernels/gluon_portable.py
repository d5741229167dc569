"""The portable kernel in Gluon: the Hopper kernel's ring of raw cache bytes, without Hopper's
instructions, so that the next tiles' gathers fly while this tile is decoded and multiplied on
any architecture from sm_80 on.

One persistent program per (block of BLOCK_H heads, share of the work list), 8 warps, one
partition. Per token tile: the copies (cp.async, zero-filled where invalid) of the tile
``STAGES - 1`` ahead are issued first (their rows from indices loaded one tile earlier), then
the wait for this tile's group (``cp.async.wait_group STAGES - 1``: the later groups stay in
flight), the decode into an fp16 tile buffer ``K [BLOCK_N, 512]``, S = Q.K^T in 8 column chunks
of 64 and O += P.V in 4 column chunks of 128, with ``mma.sync`` (``mma_v2``): every warp owns a
block of S's and O's rows and columns, so S is computed once per tile, not once per warpgroup as
Triton lays out ``tl.dot``'s chained dots. Shared memory: Q ``BLOCK_H x 512`` fp16, the tile
buffer and ``STAGES`` ring stages of 648 bytes a token.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .common import (DIM, LN2, NOPE_TILES, finish_softmax, piece, query_rows, share_bounds, sink_factor,
                     softmax_step, to_bf16, ue8m0_to_f32, write_share_record)
from .gluon_sm90.compat import cta_barrier
from .gluon_sm90.ring import ring_start, ring_step, tile_rows

NUM_WARPS = gl.constexpr(8)
#: the arguments the kernel is not specialized on: one variant for every schedule
DO_NOT_SPECIALIZE = ("share", "num_programs")
#: Q's rows, read as 16-byte loads (a warp's 32 threads on a row's 512 contiguous bytes)
ROWS_L = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))
#: the query rows of one pass of the work list's prefix sums
ROWS_1D = gl.constexpr(gl.BlockedLayout([1], [32], [8], [0]))
#: the fp16 operands in shared memory (Q and the tile buffer), swizzled for ldmatrix
OPERAND_S = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
#: output columns per P.V chunk (4 chunks)
O_CHUNK = gl.constexpr(128)
#: reduction dims per S chunk (8 chunks)
S_CHUNK = gl.constexpr(64)


@gluon.jit
def _e4m3_to_f16(bits):
    """FP8 e4m3fn bytes (uint8) -> fp16, exact, NaN included, where the GPU has no FP8 conversion
    (sm_80, sm_86): four bytes a 32-bit word, each moved into the high byte of a 16-bit lane
    (``prmt``) and shifted right by one: its 7 magnitude bits then form an fp16 of the value times
    2**-8 (:func:`mla.kernels.common.e4m3_to_f32`'s trick), and adding the sign bit (now bit 14)
    to itself moves it to bit 15. Two lanes an instruction, in fp16 throughout."""
    h = gl.inline_asm_elementwise(
        """{
        .reg .b32 t<2>, m<2>;
        prmt.b32 t0, $2, 0, 0x1404;
        prmt.b32 t1, $2, 0, 0x3424;
        shr.b32 t0, t0, 1;
        shr.b32 t1, t1, 1;
        and.b32 m0, t0, 0x40004000;
        and.b32 m1, t1, 0x40004000;
        add.u32 $0, t0, m0;
        add.u32 $1, t1, m1;
        }""", "=r,=r,r", [bits], dtype=gl.float16, is_pure=True, pack=4)
    # 0x7F, e4m3fn's NaN, shifts to 1.875 (480 x 2**-8); the largest finite value is 448
    return gl.where(gl.abs(h) == 1.875, float("nan"), h * 256.0)


@gluon.jit
def _decode(k_smem, nope_st, rope_st, sc_st, FP8_NATIVE: gl.constexpr, RING_L: gl.constexpr):
    """Decode one ring stage (FP8 times its UE8M0 scale; the rope on group 7), read back in
    ``RING_L``, into the tile buffer as fp16 ``[BLOCK_N, 512]``, in one store."""
    nb = nope_st.load(RING_L)
    rope = rope_st.load(RING_L)
    sb = sc_st.load(gl.SliceLayout(2, RING_L))
    scale = ue8m0_to_f32(sb)
    if FP8_NATIVE:
        v = nb.to(gl.float8e4nv, bitcast=True).to(gl.float16) * scale[:, :, None].to(gl.float16)
    else:
        v = _e4m3_to_f16(nb) * scale[:, :, None].to(gl.float16)
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, RING_L)))
    v = gl.where((g < NOPE_TILES)[None, :, None], v, rope.to(gl.float16))
    k_smem.store(gl.reshape(v, [nb.shape[0], DIM]))


@gluon.jit
def _store_chunk(o, col, l_safe, f, empty, rows, hmask, split, out_ptr, po_ptr, O_L: gl.constexpr):
    """Columns ``col ..`` of one piece's O: the final output (sink factor ``f`` applied) or the
    split partial (at rows ``rows`` of the partials)."""
    c = col + gl.arange(0, O_CHUNK, layout=gl.SliceLayout(0, O_L))
    o = o / l_safe[:, None]
    if split:
        gl.store(po_ptr + rows[:, None] * DIM + c[None, :], o.to(gl.float16), mask=hmask[:, None])
    else:
        o = gl.where(empty[:, None], 0.0, o * f[:, None])
        gl.store(out_ptr + rows[:, None] * DIM + c[None, :], to_bf16(o), mask=hmask[:, None])


@gluon.jit(do_not_specialize=list(DO_NOT_SPECIALIZE))
def gluon_portable_kernel(
    q_ptr, q_sb, q_ss, q_sh, out_ptr, lse_ptr, sink_ptr, sink_stride, po_ptr, plse_ptr, rec_ptr,
    kc_ptr, kc_stride, kc_P, kc_n, idx_ptr, idx_sb, idx_ss, topk, len_ptr, len_stride,
    ec_ptr, ec_stride, ec_P, ec_n, eidx_ptr, eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride,
    n_q, s_q, h_q, sm_scale_log2, share, num_programs,
    HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_ELEN: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, FP8_NATIVE: gl.constexpr, ALIGN: gl.constexpr,
    STAGES: gl.constexpr, WARPS_M: gl.constexpr,
):
    """One persistent program per (BLOCK_H heads, share of the work list), over the pieces of
    its share (:func:`mla.kernels.common.share_bounds`); the outputs are the ``tl.dot``
    kernel's."""
    gl.static_assert(BLOCK_H == 16 or BLOCK_H == 32 or BLOCK_H == 64, "BLOCK_H: 16, 32 or 64 heads")
    gl.static_assert(BLOCK_N == 32 or BLOCK_N == 64, "BLOCK_N: tiles of 32 or 64 tokens")
    # a ring stage copied or read back: a warp instruction moves 64 bytes of each of 8 tokens
    # (16 bytes of 32 tokens' groups for 32-token tiles)
    if BLOCK_N == 64:
        RING_L: gl.constexpr = gl.BlockedLayout([1, 8, 16], [8, 1, 4], [NUM_WARPS, 1, 1], [2, 1, 0])
    else:
        RING_L: gl.constexpr = gl.BlockedLayout([1, 4, 16], [8, 2, 2], [NUM_WARPS // 2, 1, 2], [2, 1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS_M, NUM_WARPS // WARPS_M],
                                                  instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    RN: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 1, [2, 0, 1])
    R3: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 1, [2, 1, 0])
    R2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    hb = gl.program_id(0)
    p = gl.program_id(1)
    p_last, x0, x1, q0, c0, q_end, c_last, u_last = share_bounds(
        p, n_q, s_q, share, num_programs, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride,
        gl.arange(0, 256, layout=ROWS_1D), BLOCK_N, 1, HAS_LEN, HAS_EXTRA, HAS_ELEN)
    if hb == 0:
        write_share_record(rec_ptr, p, p_last, x0, x1, q0, c0, q_end, c_last, u_last, n_q, num_programs)

    q_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_H, DIM], OPERAND_S)
    k_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_N, DIM], OPERAND_S)
    nope_r = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 8, 64], RN)
    rope_r = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 1, 64], R3)
    sc_r = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 8], R2)

    heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW)
    hmask = heads < h_q
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=MMA)
    c = c0
    for q in range(q0, q_end):
        lo, hi, split, tiles1, n1, n2, units = piece(q, c, x0, x1, s_q, topk, len_ptr, len_stride, etopk, elen_ptr,
                                                     elen_stride, BLOCK_N, 1, HAS_LEN, HAS_EXTRA, HAS_ELEN)
        q_off, i_off, e_off = query_rows(q, s_q, q_sb, q_ss, idx_sb, idx_ss, eidx_sb, eidx_ss)
        idx_main = idx_ptr + i_off
        idx_extra = eidx_ptr + e_off
        # the first STAGES - 1 tiles' copies fly while Q comes in
        ring = (nope_r, rope_r, sc_r)
        src = (tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2)
        nxt = ring_start(ring, lo, hi, src, BLOCK_N, HAS_EXTRA, ALIGN, RING_L, STAGES)
        qh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ROWS_L))
        qc = gl.arange(0, DIM, layout=gl.SliceLayout(0, ROWS_L))
        qv = gl.load(q_ptr + q_off + (qh.to(gl.int64) * q_sh)[:, None] + qc[None, :], mask=(qh < h_q)[:, None],
                     other=0.0)
        q_smem.store(qv.to(gl.float16))     # the last piece's reads of Q ended before the barrier above
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=ROW)
        o0 = gl.zeros([BLOCK_H, O_CHUNK], gl.float32, layout=MMA)
        o1 = gl.zeros([BLOCK_H, O_CHUNK], gl.float32, layout=MMA)
        o2 = gl.zeros([BLOCK_H, O_CHUNK], gl.float32, layout=MMA)
        o3 = gl.zeros([BLOCK_H, O_CHUNK], gl.float32, layout=MMA)
        for ti in range(lo, hi):
            st = (ti - lo) % STAGES
            # the tile STAGES - 1 ahead in flight, and the rows of the one after it loading
            nxt = ring_step(ring, ti, lo, hi, nxt, src, BLOCK_N, HAS_EXTRA, ALIGN, RING_L, STAGES)
            # this tile's score mask, in S's column layout (its load hides behind the wait)
            _cc, vs, _r, _s = tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                        ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, COL, ALIGN)
            async_copy.wait_group(STAGES - 1)
            cta_barrier()        # every thread's copies of this tile landed; the last tile's P.V is done
            _decode(k_smem, nope_r.index(st), rope_r.index(st), sc_r.index(st), FP8_NATIVE, RING_L)
            cta_barrier()
            s = s_zero
            for kc in gl.static_range(DIM // S_CHUNK):
                a = q_smem.slice(kc * S_CHUNK, S_CHUNK, dim=1).load(A_L)
                b = k_smem.slice(kc * S_CHUNK, S_CHUNK, dim=1).permute((1, 0)).load(B_L)
                s = mma_v2(a, b, s)
            pr, alpha, m_i, l_i = softmax_step(s, vs, m_i, l_i, sm_scale_log2, 1)
            pa = gl.convert_layout(pr.to(gl.float16), A_L)
            o0 = mma_v2(pa, k_smem.slice(0 * O_CHUNK, O_CHUNK, dim=1).load(B_L), o0 * alpha[:, None])
            o1 = mma_v2(pa, k_smem.slice(1 * O_CHUNK, O_CHUNK, dim=1).load(B_L), o1 * alpha[:, None])
            o2 = mma_v2(pa, k_smem.slice(2 * O_CHUNK, O_CHUNK, dim=1).load(B_L), o2 * alpha[:, None])
            o3 = mma_v2(pa, k_smem.slice(3 * O_CHUNK, O_CHUNK, dim=1).load(B_L), o3 * alpha[:, None])
        async_copy.wait_group(0)         # the copies past the piece's last tile (zero-filled) are done,
        cta_barrier()                    # every thread's, before the next piece's copies reuse the stages
        split = (c < x0) | (c + units > x1)
        slot = 2 * p + (q != q0).to(gl.int32)
        empty, l_safe, lse2 = finish_softmax(l_i, m_i)
        if split:
            rows = slot.to(gl.int64) * h_q + heads
            gl.store(plse_ptr + rows, gl.where(empty, float("-inf"), lse2), mask=hmask)
            f = l_safe * 0.0
        else:
            rows = q.to(gl.int64) * h_q + heads
            lse = lse2 * LN2
            f = gl.full([BLOCK_H], 1.0, gl.float32, layout=ROW)
            if HAS_SINK:
                f = sink_factor(gl.load(sink_ptr + heads * sink_stride, mask=hmask, other=0.0), lse, empty)
            b = q // s_q
            gl.store(lse_ptr + (b * h_q + heads) * s_q + (q - b * s_q), gl.where(empty, float("inf"), lse),
                     mask=hmask)
        _store_chunk(o0, 0 * O_CHUNK, l_safe, f, empty, rows, hmask, split, out_ptr, po_ptr, MMA)
        _store_chunk(o1, 1 * O_CHUNK, l_safe, f, empty, rows, hmask, split, out_ptr, po_ptr, MMA)
        _store_chunk(o2, 2 * O_CHUNK, l_safe, f, empty, rows, hmask, split, out_ptr, po_ptr, MMA)
        _store_chunk(o3, 3 * O_CHUNK, l_safe, f, empty, rows, hmask, split, out_ptr, po_ptr, MMA)
        c += units


def warps_m(block_h: int, block_n: int) -> int:
    """The warps' grid over S and each O chunk is ``warps_m x (8 / warps_m)``. Per tile the warps
    read from shared memory 8 KB x (block_h / warps_m + 2 block_n / (8 / warps_m)) of Q, K and V:
    least at 2 x 4 for 64 x 64 tiles (64 units against 80 at 4 x 2, and half of V's columns a
    warp); elsewhere 16 heads a warp ties or wins."""
    return 2 if (block_h, block_n) == (64, 64) else block_h // 16


def launch_params(h_q: int, programs: int, *, block_h: int, block_n: int, fp8_native: bool, align: int,
                  stages: int) -> tuple:
    """(grid, constexpr and launch keywords) of the kernel on ``programs`` shares, besides the
    HAS_* flags."""
    grid = ((h_q + block_h - 1) // block_h, programs)
    return grid, dict(BLOCK_H=block_h, BLOCK_N=block_n, FP8_NATIVE=fp8_native, ALIGN=align, STAGES=stages,
                      WARPS_M=warps_m(block_h, block_n), num_warps=NUM_WARPS.value)
