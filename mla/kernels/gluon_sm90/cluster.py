"""The 128-head form of the Gluon sm_90 kernel: a cluster of 2 CTAs that decodes each token tile
once.

The two-program form runs 128 heads as two 64-head programs, and each gathers and decodes every
tile. Here the CTAs of a cluster own 64 heads each (Q, S, P and O split by heads) and split each
64-token tile by tokens: CTA ``r`` copies tokens ``32r ..`` of it (cp.async into its ring, its
stages ``STAGES - 1`` tiles ahead), decodes them, and stores them (``st.async``) into both CTAs'
tile buffers; a transaction mbarrier in each CTA counts the 64 KB that land in it. Then each CTA
computes S = Q.K^T for its heads with the whole tile, the softmax, and O += P.V. One cluster
barrier a tile, before the stores, frees both buffers (each CTA's last P.V is done).

Cost, per tile and CTA, against the two-program form: half the gather and the decode, 32 KB sent
to the peer over the cluster's shared-memory network, and one cluster barrier. Shared memory per
CTA: Q 64 KB, the tile buffer 64 KB, P 8 KB and ``STAGES`` ring stages of 32 tokens (20.25 KB).

Compiles under Triton 3.9 (the cross-CTA stores and CGA layouts; 3.6 fails LLVM's verifier on
the cluster address mapping): :data:`SUPPORTED`.
"""
from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import cluster, fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

from ..common import DIM, NOPE_TILES, piece, query_rows, share_bounds, softmax_step, ue8m0_to_f32, write_share_record
from .compat import cta_barrier, reinterpret
from .consumers import load_q, store_piece
from .ring import RING_N, ring_start, ring_step, tile_rows

#: whether this Triton compiles the cluster form (its Gluon has cross-CTA stores)
SUPPORTED = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9)
#: heads a cluster (64 a CTA), CTAs a cluster, warps a CTA
HEADS = gl.constexpr(128)
NUM_CTAS = 2
NUM_WARPS = 8
#: ring stages of 32 tokens a CTA (a power of two, as CGA layouts need): with 4, Q, the tile buffer,
#: P and the ring take 217 KB
STAGES = gl.constexpr(4)

#: CGA bases (one: 2 CTAs): a tensor's first dim split over the CTAs, or whole in each
SPLIT0 = gl.constexpr([[1, 0]])
WHOLE = gl.constexpr([[0, 0]])
#: Q's loads and O's stores: rows of 16-byte accesses, the heads split over the CTAs
ROWS_L = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0], cga_layout=SPLIT0))
#: the query rows of one pass of the work list's prefix sums, the same in both CTAs
ROWS_1D = gl.constexpr(gl.BlockedLayout([1], [32], [8], [0], cga_layout=[[0]]))
#: a ring stage copied or read back, ``[64 tokens, 8 groups, 64 bytes]``, each CTA its 32 tokens:
#: a warp instruction moves 64 bytes of each of 8 tokens' groups
RING_L = gl.constexpr(gl.BlockedLayout([1, 4, 16], [8, 1, 4], [4, 2, 1], [2, 1, 0], cga_layout=[[1, 0, 0]]))
#: the decoded half tile on its way to both CTAs: ``[2 copies, 64 tokens, 8, 64]``, every thread
#: holding its tokens' values for both copies, the tokens split over the CTAs
SEND_L = gl.constexpr(gl.BlockedLayout([2, 1, 1, 8], [1, 4, 1, 8], [1, 8, 1, 1], [3, 2, 1, 0],
                                       cga_layout=[[0, 1, 0, 0]]))


@gluon.jit
def _decode_half(nope_st, rope_st, sc_st):
    """This CTA's half of a ring stage decoded (FP8 times its UE8M0 scale; the rope on group 7)
    and broadcast to both copies, ``[2, 64, 512]`` fp16 in :data:`SEND_L`."""
    L3: gl.constexpr = gl.SliceLayout(0, SEND_L)
    nb = nope_st.load(L3)
    rope = rope_st.load(L3)
    scale = ue8m0_to_f32(sc_st.load(gl.SliceLayout(2, L3)))
    v = nb.to(gl.float8e4nv, bitcast=True).to(gl.float16) * scale[:, :, None].to(gl.float16)
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    v = gl.where((g < NOPE_TILES)[None, :, None], v, rope.to(gl.float16))
    both = gl.broadcast(gl.expand_dims(v, 0), gl.full([2, RING_N, 8, 64], 0.0, gl.float16, SEND_L))[0]
    return gl.reshape(both, [2, RING_N, DIM])


@gluon.jit(do_not_specialize=["n_q", "s_q", "h_q", "share", "num_programs"])
def gluon_cluster_kernel(
    q_ptr, q_sb, q_ss, q_sh, out_ptr, lse_ptr, sink_ptr, sink_stride, po_ptr, plse_ptr, rec_ptr,
    kc_ptr, kc_stride, kc_P, kc_n, idx_ptr, idx_sb, idx_ss, topk, len_ptr, len_stride,
    ec_ptr, ec_stride, ec_P, ec_n, eidx_ptr, eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride,
    n_q, s_q, h_q, sm_scale_log2, share, num_programs,
    HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_ELEN: gl.constexpr,
    ALIGN: gl.constexpr, STAGES: gl.constexpr,
):
    """One persistent cluster per (128 heads, share of the work list), over the pieces of its
    share (:func:`mla.kernels.common.share_bounds`), as the two-program form's programs are; the
    outputs are the other forms'. Launched with ``num_ctas=2``."""
    OUT: gl.constexpr = gl.float16
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, RING_N // 2, 16], cga_layout=SPLIT0)
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16],
                                                  cga_layout=SPLIT0)
    Q_S: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=SPLIT0)
    P_S: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=SPLIT0)
    COPIES_S: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3,
                                                  cga_layout=[[1, 0, 0]])
    K_S: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=WHOLE)
    # the tile buffer as the epilogue's staging area: [128 heads, 512], each CTA its 64 heads
    STAGE_S: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2,
                                                 cga_layout=SPLIT0)
    # the ring's layouts are those of one stage (the leading dim of an allocation indexes stages)
    RN: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 1, [2, 1, 0], cga_layout=[[1, 0, 0]])
    R2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0], cga_layout=SPLIT0)
    SCOL_L: gl.constexpr = gl.SliceLayout(0, S_L)

    hb = gl.program_id(0)
    p = gl.program_id(1)
    p_last, x0, x1, q0, c0, q_end, c_last, u_last = share_bounds(
        p, n_q, s_q, share, num_programs, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride,
        gl.arange(0, 256, layout=ROWS_1D), RING_N, 1, HAS_LEN, HAS_EXTRA, HAS_ELEN)
    if hb == 0:
        write_share_record(rec_ptr, p, p_last, x0, x1, q0, c0, q_end, c_last, u_last, n_q, num_programs)

    nope_r = gl.allocate_shared_memory(gl.uint8, [STAGES, RING_N, 8, 64], RN)
    rope_r = gl.allocate_shared_memory(gl.bfloat16, [STAGES, RING_N, 1, 64], RN)
    sc_r = gl.allocate_shared_memory(gl.uint8, [STAGES, RING_N, 8], R2)
    q_smem = gl.allocate_shared_memory(OUT, [HEADS, DIM], Q_S)
    p_smem = gl.allocate_shared_memory(OUT, [HEADS, RING_N], P_S)
    copies = gl.allocate_shared_memory(OUT, [2, RING_N, DIM], COPIES_S)     # copy c lives in CTA c
    k_smem = copies.reinterpret(shape=[RING_N, DIM], layout=K_S)            # each CTA: its copy, whole
    stage_fp16 = reinterpret(copies, gl.float16, [HEADS, DIM], STAGE_S)
    stage_bf16 = reinterpret(copies, gl.bfloat16, [HEADS, DIM], STAGE_S)
    full = mbarrier.allocate_mbarrier()
    mbarrier.init(full, count=1)
    fence_async_shared(cluster=True)
    cluster.barrier()        # both CTAs' barriers are initialized before either stores into the other

    s_zero = gl.zeros([HEADS, RING_N], gl.float32, layout=S_L)
    j = c0 * 0
    c = c0
    for q in range(q0, q_end):
        lo, hi, split, tiles1, n1, n2, units = piece(q, c, x0, x1, s_q, topk, len_ptr, len_stride, etopk, elen_ptr,
                                                     elen_stride, RING_N, 1, HAS_LEN, HAS_EXTRA, HAS_ELEN)
        q_off, i_off, e_off = query_rows(q, s_q, q_sb, q_ss, idx_sb, idx_ss, eidx_sb, eidx_ss)
        idx_main = idx_ptr + i_off
        idx_extra = eidx_ptr + e_off
        ring = (nope_r, rope_r, sc_r)
        src = (tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2)
        nxt = ring_start(ring, lo, hi, src, RING_N, HAS_EXTRA, ALIGN, RING_L, STAGES)
        # Q in while the copies fly; the last piece's S (its wgmma waited on) was Q's last reader
        load_q(q_ptr + q_off, q_sh, h_q, hb, q_smem, HEADS, ROWS_L)
        fence_async_shared()           # for the wgmma, after the barrier that follows the first tile's wait
        m_i = gl.full([HEADS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([HEADS], gl.float32, layout=gl.SliceLayout(1, S_L))
        o = gl.zeros([HEADS, DIM], gl.float32, layout=O_L)
        for ti in range(lo, hi):
            st = (ti - lo) % STAGES
            # the tile STAGES - 1 ahead in flight, and the rows of the one after it loading
            nxt = ring_step(ring, ti, lo, hi, nxt, src, RING_N, HAS_EXTRA, ALIGN, RING_L, STAGES)
            # this tile's score mask for all 64 tokens, in S's column layout (the same in both CTAs)
            _c, vs, _r, _s = tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                       ec_stride, ec_P, ec_n, idx_extra, n2, RING_N, HAS_EXTRA, SCOL_L, ALIGN)
            async_copy.wait_group(STAGES - 1)
            cta_barrier()                  # every thread's copies of this tile have landed
            both = _decode_half(nope_r.index(st), rope_r.index(st), sc_r.index(st))
            cluster.barrier()              # both CTAs are past their last P.V: both tile buffers are free
            mbarrier.expect(full, copies.nbytes_per_cta)
            hopper.async_store(copies, both, full)
            mbarrier.wait(full, j & 1, deps=[copies])
            s_tok = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
            pr, alpha, m_i, l_i = softmax_step(s, vs, m_i, l_i, sm_scale_log2, 1)
            p_smem.store(pr.to(OUT))
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            fence_async_shared()
            cta_barrier()
            o_tok = warpgroup_mma(p_smem, k_smem, o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
            j += 1
        async_copy.wait_group(0)     # the copies past the piece's last tile are done before the next
        cta_barrier()                # piece's copies reuse the stages
        split = (c < x0) | (c + units > x1)
        # staged through this CTA's own tile buffer: the peer stores into it again only after the
        # next tile's cluster barrier
        store_piece(o, m_i, l_i, hb, q, s_q, h_q, split, 2 * p + (q != q0).to(gl.int32), out_ptr, lse_ptr, sink_ptr,
                    sink_stride, po_ptr, plse_ptr, HAS_SINK, HEADS, O_L, ROWS_L, stage_fp16, stage_bf16)
        c += units


def launch_params(h_q: int, programs: int, *, align: int) -> tuple:
    """(grid, constexpr and launch keywords) of the cluster form on ``programs`` shares, besides
    the HAS_* flags: a cluster per (128 heads, share)."""
    grid = ((h_q + HEADS.value - 1) // HEADS.value, programs)
    return grid, dict(ALIGN=align, STAGES=STAGES.value, num_warps=NUM_WARPS, num_ctas=NUM_CTAS)
