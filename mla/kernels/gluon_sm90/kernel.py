"""The Gluon sm_90 kernel itself: its shared memory, its partitions, its epilogue and its launch.

One persistent program per (head block, share of the work list) runs a producer partition
(:func:`~.ring.producer`, 4 warps, cp.async into a two-stage ring) beside consumers
(:mod:`.consumers`), over the pieces of the queries in its share. Shared memory with 64 heads:
Q 64 KB, the tile buffer 64 KB, P 8 KB and the ring 2 x 40.5 KB, 217 KB of the H200's 227. The outputs (final, or split partials for
:mod:`mla.kernels.combine`) are those of the ``tl.dot`` kernel.

DeepSeek-V3.2's cache (``V32``, heads as M only) adds 64 rope columns to Q and K and leaves V the
512 nope ones. Its rope is not decoded: S adds ``Q_rope . K_rope^T`` in bf16 from Q's own 8 KB and
from the ring stage, so the tile buffer stays ``[64, 512]``; with the 4 float32 scales the plan is
226 KB.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ..common import DIM, ROPE_W, query_rows, share_bounds, split_range, write_share_record
from .compat import cta_barrier, reinterpret
from .consumers import ROWS_L4, consumer_heads, consumer_pair, consumer_tokens, load_q_pair, store_piece
from .ring import RING_N, producer, producer_one

#: the consumers of the one-consumer forms (the kernel's num_warps): two warpgroups
NUM_WARPS = 8
#: the producer partition's warps: one warpgroup, so that setmaxnreg can apply to it
PRODUCER_WARPS = gl.constexpr(4)
#: its registers per thread (addresses, and its loop over the share's queries): at 40 it spilled
#: under Triton 3.6 once the work list came; the consumers then get 224 in the loop
PRODUCER_REGS = 56
#: ring stages of 64 tokens. With 64 heads a third stage (40.5 KB) does not fit beside Q, the
#: tile buffer and P; with 16 heads three fit and were no faster on the H200
STAGES = 2
#: the two-consumer form: warps of each consumer (one warpgroup), which are also those of the
#: kernel's default partition, the producer there
PAIR_WARPS = gl.constexpr(4)
#: each consumer's registers per thread in the two-consumer form (the producer gets the rest:
#: 72); at 232 each consumer's loop spilled under Triton 3.6
PAIR_REGS = 216
#: the FP8 ring's byte order in the one-consumer forms: group-major (the 64-byte pieces of one
#: 64-dim group of all the stage's tokens contiguous), so that a warp's copy or read of 64 bytes
#: of each of 8 tokens touches 512 contiguous bytes rather than 8 pieces in the same 16 banks;
#: the two-consumer form, which reads a group for all tokens at once, keeps token-major
GROUP_MAJOR = 1


def launch_options(heads: int, tile_tokens: int, two_consumers: bool, v32: bool = False) -> dict:
    """The launch's warps and the kernel's constexprs for a form: ``heads`` per program,
    ``tile_tokens`` per consumer tile (64 or 128), and whether two consumers share the program
    (the forms are :data:`mla.configs.GLUON_FORMS`), ``v32`` for DeepSeek-V3.2's cache. The
    launch (:func:`launch_params`) and the ahead-of-time variants (:mod:`mla.aot`) both take them
    from here; a MODEL1 launch passes no ``V32``, so that its compiled variant is the same."""
    opts = {"num_warps": PAIR_WARPS.value if two_consumers else NUM_WARPS, "HEADS": heads,
            "RING_TILES": tile_tokens // RING_N.value, "TWO_CONSUMERS": int(two_consumers), "STAGES": STAGES,
            "PRODUCER_REGS": PRODUCER_REGS, "CONSUMER_REGS": PAIR_REGS,
            "GROUP_MAJOR": 0 if two_consumers else GROUP_MAJOR}
    return {"V32": True, **opts} if v32 else opts


def row_align(*caches) -> int:
    """The ``ALIGN`` the kernel takes for these ``(uint8 view, page stride)`` caches, whose base
    addresses must be multiples of 16 (a fresh allocation's are): 16 when every page stride is
    a multiple of 16, 8 when of 8, else 0, which the kernel cannot copy. The padded MODEL1
    stride (``P*584`` rounded up to a multiple of 576) is a multiple of 64; a contiguous cache's
    (``P*584``, which is what ``.to(device)`` of a padded cache gives: torch copies a tensor with
    gaps into a contiguous one) is a multiple of 16 only for an even page size."""
    if any(c.data_ptr() % 16 for c, _ in caches):
        return 0
    for a in (16, 8):
        if all(stride % a == 0 for _, stride in caches):
            return a
    return 0


#: the query rows of one pass of the work list's prefix sums (:func:`mla.kernels.common.share_bounds`),
#: spread over the one-consumer forms' 8 warps
ROWS_1D = gl.constexpr(gl.BlockedLayout([1], [32], [8], [0]))


@gluon.jit(do_not_specialize=["n_q", "s_q", "h_q", "share", "num_programs"])  # one variant for every grid
def gluon_decode_kernel(
    q_ptr, q_sb, q_ss, q_sh, out_ptr, lse_ptr, sink_ptr, sink_stride, po_ptr, plse_ptr, rec_ptr,
    kc_ptr, kc_stride, kc_P, kc_n, idx_ptr, idx_sb, idx_ss, topk, len_ptr, len_stride,
    ec_ptr, ec_stride, ec_P, ec_n, eidx_ptr, eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride,
    n_q, s_q, h_q, sm_scale_log2, share, num_programs,
    HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_ELEN: gl.constexpr,
    ALIGN: gl.constexpr, HEADS: gl.constexpr, RING_TILES: gl.constexpr,
    TWO_CONSUMERS: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    GROUP_MAJOR: gl.constexpr, V32: gl.constexpr = False,
):
    """In a form of :data:`mla.configs.GLUON_FORMS` (:func:`launch_options` gives its constexprs):
    ``HEADS`` 64, heads as the M of the dots; 16 or 8, tokens as M, with tiles of ``RING_TILES``
    ring tiles: one persistent program per (``HEADS`` heads, share of the work list), over the
    pieces of its share (:func:`mla.kernels.common.share_bounds`). ``TWO_CONSUMERS`` (8 heads),
    two consumer warpgroups: one program per (query row, uniform split ``num_programs``).
    ``STAGES``: ring stages; ``PRODUCER_REGS``: the producer's registers when it is a worker;
    ``CONSUMER_REGS``: each of the two consumers'; ``GROUP_MAJOR``: the FP8 ring's byte order;
    ``ALIGN``: the width of the ring's copies (:func:`row_align`); ``V32``: DeepSeek-V3.2's cache."""
    if TWO_CONSUMERS:
        gl.static_assert(HEADS == 8 and RING_TILES == 1, "two consumers: 8 heads x 64 tokens (16 heads take 235 KB)")
    else:
        gl.static_assert((HEADS == 64 and RING_TILES == 1) or (HEADS == 16 and RING_TILES == 1)
                         or (HEADS == 8 and RING_TILES == 2),
                         "heads x tile: 64 x 64 (heads as M), 16 x 64 or 8 x 128 (tokens as M)")
    gl.static_assert(not V32 or (HEADS == 64 and not TWO_CONSUMERS), "V3.2's cache: the heads-as-M form only")
    OUT: gl.constexpr = gl.float16
    PW: gl.constexpr = PRODUCER_WARPS
    Q_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, DIM], OUT)
    K_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([RING_TILES * RING_N, DIM], OUT)
    P_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, RING_TILES * RING_N], OUT)
    # vec 16: 16 contiguous elements per copy; Triton 3.9 sizes its cp.async by it (with vec 1
    # it copies 8 bytes), 3.6 compiles the same SASS either way.
    R3: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 1, [2, 1, 0])
    RN: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 1, [2, 0, 1] if GROUP_MAJOR else [2, 1, 0])
    R2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    K_ROPE_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([RING_N, ROPE_W], gl.bfloat16)
    Q_ROPE_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, ROPE_W], gl.bfloat16)

    hb = gl.program_id(0)
    p = gl.program_id(1)
    if TWO_CONSUMERS:
        tok = gl.program_id(2)
        n1, tiles1, n2, lo, hi = split_range(tok, p, s_q, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride,
                                             num_programs, RING_N, HAS_LEN, HAS_EXTRA, HAS_ELEN)
        q_off, i_off, e_off = query_rows(tok, s_q, q_sb, q_ss, idx_sb, idx_ss, eidx_sb, eidx_ss)
        idx_main = idx_ptr + i_off
        idx_extra = eidx_ptr + e_off
    else:
        p_last, x0, x1, q0, c0, q_end, c_last, u_last = share_bounds(
            p, n_q, s_q, share, num_programs, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride,
            gl.arange(0, 256, layout=ROWS_1D), RING_N, RING_TILES, HAS_LEN,
            HAS_EXTRA, HAS_ELEN)
        if hb == 0:
            write_share_record(rec_ptr, p, p_last, x0, x1, q0, c0, q_end, c_last, u_last, n_q, num_programs)

    nope_r = gl.allocate_shared_memory(gl.uint8, [STAGES, RING_N, 8, 64], RN)
    if V32:       # the rope as S's second B operand, read in place; 4 float32 scales a token
        rope_r = gl.allocate_shared_memory(gl.bfloat16, [STAGES, RING_N, ROPE_W], K_ROPE_S)
        sc_r = gl.allocate_shared_memory(gl.float32, [STAGES, RING_N, 4], R2)
    else:
        rope_r = gl.allocate_shared_memory(gl.bfloat16, [STAGES, RING_N, 1, 64], R3)
        sc_r = gl.allocate_shared_memory(gl.uint8, [STAGES, RING_N, 8], R2)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=PW * 32)
        mbarrier.init(empty.index(i), count=1)

    if TWO_CONSUMERS:
        q_smem = gl.allocate_shared_memory(OUT, [HEADS, DIM], Q_S)
        k0_smem = gl.allocate_shared_memory(OUT, [RING_N, DIM], K_S)
        k1_smem = gl.allocate_shared_memory(OUT, [RING_N, DIM], K_S)
        p0_smem = gl.allocate_shared_memory(OUT, [HEADS, RING_N], P_S)
        p1_smem = gl.allocate_shared_memory(OUT, [HEADS, RING_N], P_S)
        xml_smem = gl.allocate_shared_memory(gl.float32, [4, HEADS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        # each consumer's O^T, handed over in its own tile buffer once its last P.V is done
        X_S: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        x0_smem = reinterpret(k0_smem, gl.float32, [DIM, HEADS], X_S)
        x1_smem = reinterpret(k1_smem, gl.float32, [DIM, HEADS], X_S)
        load_q_pair(q_ptr + q_off, q_sh, h_q, hb, q_smem, HEADS)
    else:
        q_smem = gl.allocate_shared_memory(OUT, [HEADS, DIM], Q_S)
        k_smem = gl.allocate_shared_memory(OUT, [RING_TILES * RING_N, DIM], K_S)
        p_smem = gl.allocate_shared_memory(OUT, [HEADS, RING_TILES * RING_N], P_S)
        kbf_smem = reinterpret(k_smem, gl.bfloat16, [RING_TILES * RING_N, DIM], K_S)   # heads as M's output stage
        if V32:
            qr_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS, ROPE_W], Q_ROPE_S)
        else:
            qr_smem = q_smem          # a stand-in, never read: MODEL1's Q has no rope of its own
    fence_async_shared()
    cta_barrier()

    if TWO_CONSUMERS:
        # the producer is the default partition (it gets the registers the consumers leave)
        gl.warp_specialize([
            (producer_one, (nope_r, rope_r, sc_r, ready, empty, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n,
                            idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, HAS_EXTRA, ALIGN, STAGES,
                            PW)),
            (consumer_pair, (0, x0_smem, xml_smem, q_smem, k0_smem, p0_smem, nope_r, rope_r, sc_r, ready, empty,
                             lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P,
                             ec_n, idx_extra, n2, sm_scale_log2, HAS_EXTRA, ALIGN, STAGES, HEADS)),
            (consumer_pair, (1, x1_smem, xml_smem, q_smem, k1_smem, p1_smem, nope_r, rope_r, sc_r, ready, empty,
                             lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P,
                             ec_n, idx_extra, n2, sm_scale_log2, HAS_EXTRA, ALIGN, STAGES, HEADS)),
        ], [PAIR_WARPS, PAIR_WARPS], [CONSUMER_REGS, CONSUMER_REGS])
        # merge the two consumers' online-softmax states
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HEADS, 16])
        m0 = xml_smem.index(0).load(gl.SliceLayout(0, ACC))
        l0 = xml_smem.index(1).load(gl.SliceLayout(0, ACC))
        m1 = xml_smem.index(2).load(gl.SliceLayout(0, ACC))
        l1 = xml_smem.index(3).load(gl.SliceLayout(0, ACC))
        ot0 = x0_smem.load(ACC)
        ot1 = x1_smem.load(ACC)
        m_i = gl.maximum(m0, m1)
        m_safe = gl.where(m_i == float("-inf"), 0.0, m_i)
        a0 = gl.exp2(m0 - m_safe)
        a1 = gl.exp2(m1 - m_safe)
        l_i = l0 * a0 + l1 * a1
        o = gl.convert_layout(gl.permute(ot0 * a0[None, :] + ot1 * a1[None, :], (1, 0)), ROWS_L4)
        store_piece(o, m_i, l_i, hb, tok, s_q, h_q, num_programs > 1, tok * num_programs + p, out_ptr, lse_ptr,
                    sink_ptr, sink_stride, po_ptr, plse_ptr, HAS_SINK, HEADS, ROWS_L4, ROWS_L4)
    elif HEADS == 64:
        gl.warp_specialize([
            (consumer_heads, (hb, p, x0, x1, q0, c0, q_end, s_q, h_q, q_ptr, q_sb, q_ss, q_sh, out_ptr, lse_ptr,
                              sink_ptr, sink_stride, po_ptr, plse_ptr, idx_ptr, idx_sb, idx_ss, topk, len_ptr,
                              len_stride, eidx_ptr, eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride, q_smem, k_smem,
                              kbf_smem, p_smem, nope_r, rope_r, sc_r, ready, empty, kc_ptr, kc_stride, kc_P, kc_n,
                              ec_ptr, ec_stride, ec_P, ec_n, sm_scale_log2, qr_smem, HAS_SINK, HAS_LEN, HAS_EXTRA,
                              HAS_ELEN, ALIGN, STAGES, HEADS, V32)),
            (producer, (nope_r, rope_r, sc_r, ready, empty, x0, x1, q0, c0, q_end, n_q, s_q, idx_ptr, idx_sb, idx_ss,
                        topk, len_ptr, len_stride, eidx_ptr, eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride, kc_ptr,
                        kc_stride, kc_P, kc_n, ec_ptr, ec_stride, ec_P, ec_n, HAS_LEN, HAS_EXTRA, HAS_ELEN, ALIGN,
                        STAGES, PW, 1, V32)),
        ], [PW], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (consumer_tokens, (hb, p, x0, x1, q0, c0, q_end, s_q, h_q, q_ptr, q_sb, q_ss, q_sh, out_ptr, lse_ptr,
                               sink_ptr, sink_stride, po_ptr, plse_ptr, idx_ptr, idx_sb, idx_ss, topk, len_ptr,
                               len_stride, eidx_ptr, eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride, q_smem, k_smem,
                               p_smem, nope_r, rope_r, sc_r, ready, empty, kc_ptr, kc_stride, kc_P, kc_n, ec_ptr,
                               ec_stride, ec_P, ec_n, sm_scale_log2, HAS_SINK, HAS_LEN, HAS_EXTRA, HAS_ELEN, ALIGN,
                               STAGES, HEADS, RING_TILES)),
            (producer, (nope_r, rope_r, sc_r, ready, empty, x0, x1, q0, c0, q_end, n_q, s_q, idx_ptr, idx_sb, idx_ss,
                        topk, len_ptr, len_stride, eidx_ptr, eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride, kc_ptr,
                        kc_stride, kc_P, kc_n, ec_ptr, ec_stride, ec_P, ec_n, HAS_LEN, HAS_EXTRA, HAS_ELEN, ALIGN,
                        STAGES, PW, RING_TILES)),
        ], [PW], [PRODUCER_REGS])


def launch_params(n_q: int, h_q: int, programs: int, *, heads: int, tile_tokens: int, two_consumers: bool,
                  align: int, v32: bool = False) -> tuple:
    """(grid, constexpr and launch keywords) of the kernel in a form (:func:`launch_options`),
    besides the HAS_* flags: ``programs`` shares of the work list, or for the two-consumer form
    ``programs`` uniform splits of each of the ``n_q`` query rows."""
    grid = ((h_q + heads - 1) // heads, programs) + ((n_q,) if two_consumers else ())
    return grid, dict(ALIGN=align, **launch_options(heads, tile_tokens, two_consumers, v32))
