"""The Hopper (sm_90) kernel, written in Gluon: the same algorithm as :mod:`mla.kernels.mma`, with
the schedule spelled out instead of left to the compiler.

Why a second kernel: the ``tl.dot`` kernel leaves the tensor cores idle while it gathers and
decodes (every wgmma wait drains the pipe), Triton lays Q.K^T out so that both warpgroups
compute the same S, and the gather's loads stall the warps that do the math. Here one program
(a query token, 64 heads, a split) runs two partitions (``gl.warp_specialize``):

- a **producer** of 4 warps that only copies: each tile's raw cache bytes (FP8 nope, bf16 rope,
  UE8M0 scales) go with ``cp.async`` into a two-stage ring in shared memory (the FP8 bytes
  group-major in the one-consumer forms, :data:`RING_GROUP_MAJOR`), holding no registers
  while they fly; its copies' completion is signalled on the stage's ``ready``
  mbarrier, and it refills a stage when the consumers release it (``empty``);
- **consumers**, 8 warps (two warpgroups) that decode each tile from the ring into one fp16
  tile buffer ``K[BLOCK_N, 512]`` (serving as K for S = Q.K^T and as V for O += P.V), then run
  S split by columns (warpgroup ``w`` computes tokens ``w*BLOCK_N/2 ..``, nothing twice), the
  online softmax, P through shared memory, and P.V with O [64, 512] split by columns (256 per
  warpgroup, 128 fp32 registers a thread).

With few heads (h_q <= 16; V4 at TP8 has 8) the consumers put the token tile, not the heads,
in the M of the dots (:func:`_consumer_t`): ``S^T = K.Q^T`` with 16 heads as N (or 8 heads with
128-token tiles, two ring stages decoded into one tile buffer), so that 8 heads are padded to
16 or 8 instead of 64. A third few-heads form (``DUO``, :func:`_consumer_d`) runs two consumer
warpgroups on alternate ring tiles, each with its own tile buffer and nothing shared in the
loop; the producer is then the default partition. Each 64-dim group of a tile is decoded once,
into registers that serve as S^T's A operand directly (Q stored with its columns reordered to
match, :data:`GL`) and are stored into the tile buffer for O^T's A.

Q (64 heads x 512, fp16) stays in shared memory for the whole program. Shared memory: Q 64 KB,
the tile buffer 64 KB, P 8 KB and the ring 2 x 40.5 KB, 217 KB of the H200's 227. The outputs
(final, or split partials for :func:`mla.kernels.mma.combine_kernel`) are those of the
``tl.dot`` kernel, so the launch wrapper, the split heuristic and the combine are shared.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import _core as _gl_core
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)

from .common import split_range, tile_source, to_bf16, token_rows

# Gluon is experimental and its names move: the CTA-wide barrier is gl.thread_barrier in Triton
# 3.6 (the GPU image) and gl.barrier in 3.9 (CPU CI, which compiles this kernel ahead of time);
# inside a warp_specialize partition it synchronizes that partition's warps only.
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
# Likewise cp.async: async_copy_global_to_shared in 3.6, async_load in 3.9.
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@_gl_core.builtin
def _reinterpret(desc, dtype, shape, layout, _semantic=None):
    """A shared-memory view of another dtype, shape and layout (a descriptor's ``_reinterpret`` in
    Triton 3.6, ``reinterpret`` in 3.9; both call this)."""
    return _semantic.memdesc_reinterpret(desc, _gl_core._unwrap_if_constexpr(dtype),
                                         [_gl_core._unwrap_if_constexpr(d) for d in shape],
                                         _gl_core._unwrap_if_constexpr(layout))

BLOCK_H = 64          #: heads per program: the M of one warpgroup's wgmma
NUM_WARPS = 8         #: the consumers (the kernel's num_warps): two warpgroups
#: the producer partition's warps: one warpgroup, so that setmaxnreg can apply to it
PRODUCER_WARPS = gl.constexpr(4)
#: its registers per thread (it holds addresses only); the consumers then get 232 in the loop
PRODUCER_REGS = 40
#: ring stages (of 64 tokens), in every variant. With 64 heads a third (40.5 KB) does not fit
#: beside Q (64 KB), the tile buffer and P; with 16 heads (tokens as M) three fit and were slower
#: on the H200 (results/h200/mma_probe_r22a.json); with 8 heads the 128-token tile buffer
#: leaves room for two
NUM_STAGES = 2
#: the two-consumer form (:func:`_consumer_d`): its ring stages (two 64 KB tile buffers leave
#: room for two: Q, P, the tile buffers and the ring take 219 KB with 8 heads), and the
#: warps of each consumer (one warpgroup) and of its kernel's default partition
DUO_STAGES = 2
DUO_WARPS = gl.constexpr(4)
#: each consumer's registers per thread (the producer, the default partition, gets the rest: 72); at
#: 232 (the producer keeping 40) each consumer loop spilled 2 registers a tile under Triton 3.6 and
#: V4-TP8 b128 and b32 took 1.7 and 1.1 us longer (results/h200/mma_probe_r26a.json)
DUO_REGS = 216
#: the FP8 ring's byte order in the one-consumer forms: 1 stores each stage group-major (the
#: 64-byte pieces of one 64-dim group of all the stage's tokens contiguous), so that a warp's copy
#: or read of 64 bytes of each of 8 tokens touches 512 contiguous bytes; 0 token-major (each
#: token's 512 bytes contiguous), where those 8 pieces, 512 bytes apart, fall in the same 16
#: banks: twice the shared-memory wavefronts (Nsight Compute: 48% of the shared loads'
#: wavefronts were bank conflicts at V4-TP8 b128). Group-major took DSA b128 from 118.9 to 111.2
#: us, V4-CSA b128 from 44.2 to 41.6, V4-TP8 b128 (8 x 128) from 30.6 to 29.2; the two-consumer
#: form, slower with it (15.7 against 15.6 us at V4-TP8 b32, 31.2 against 30.1 at b128), keeps
#: token-major (results/h200/mma_probe_r28c.json)
RING_GROUP_MAJOR = 1
#: Q's loads and O's stores, and the tokens-as-M forms' O^T once turned around: rows of 16-byte
#: accesses, a warp's 32 threads on a row's 512 contiguous bytes (8 warps, 8 rows at a time)
ROWS_L = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))
#: the same rows for a kernel of 4 warps (the two-consumer form, :func:`_consumer_d`)
ROWS_L4 = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))

#: The two-consumer form's reads of one 64-dim group of a ring stage (:func:`_decode_group`),
#: ``[64 tokens, 1, 64]``, FP8 or bf16 (the rope): each thread gets 16 contiguous dims of two
#: token rows, in the registers of a wgmma A operand (``DotOperandLayout(0, ACC, 2)`` of a
#: 4-warp accumulator ``ACC``: thread (warp w, lane 4g+t) holds rows 16w+g+8i and reduction
#: indices 2t+e+8h+16c) once the reduction index ``c*16+h*8+2t+e`` is taken to be dim
#: ``t*16+c*4+h*2+e`` of the group; Q is stored in that order (:func:`_load_q_d`).
GL = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [8, 0, 0]],
    lane_bases=[[0, 0, 16], [0, 0, 32], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 1, 64]))


def launch_options(duo: bool = False) -> dict:
    """The launch's warps and the kernel's constexprs that follow from the form (``duo``: the
    two-consumer form): ring stages and register splits, read from this module's constants at
    the call (so a probe may change them). The launch (:func:`mla.kernels.mma.mma_sparse_decode`)
    and the ahead-of-time variants (:func:`mla.aot.wgmma_variant`) both take them from here."""
    return {"num_warps": DUO_WARPS.value if duo else NUM_WARPS, "NST": DUO_STAGES if duo else NUM_STAGES,
            "DUO": int(duo), "PREG": PRODUCER_REGS, "CREG": DUO_REGS,
            "GM": 0 if duo else RING_GROUP_MAJOR}


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


@gluon.jit
def _tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
               ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2,
               BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr, ROW_L: gl.constexpr, ALIGN: gl.constexpr,
               ABLATE: gl.constexpr = 0):
    """Token tile ``ti`` of the query's list (main cache's tiles, then the extra cache's), as in
    :func:`mla.kernels.mma._tile_rows` with CLIP: a tile at or past ``hi`` is all invalid.
    ``ALIGN`` (16 or 8, :func:`row_align`) is what the caches' page strides are multiples of,
    so each token's row too (the base addresses are multiples of 16; a row is 576 bytes, a scale
    row 8): the width of the ring's cp.async copies. The stride is rebuilt as a multiple of
    ``ALIGN`` because Triton specializes an integer argument on divisibility by 16 only: from a
    stride of 8 it compiled the copies as 1-byte transfers, which cp.async does not have (on the
    H200, contiguous caches of page sizes 1, 7, 13 and 61 in the validation)."""
    cache, idx_row, t, n, n_tokens, P, stride = tile_source(ti, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                                            ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, HAS_EXTRA)
    stride = (stride // ALIGN) * ALIGN      # the same value, in a form whose alignment Triton can see
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
def _copy_tile(stage, cache, valid, row, srow, L3: gl.constexpr):
    """Issue the asynchronous copies (cp.async, no registers held) of one token tile's raw bytes
    into ring stage ``stage``: the FP8 bytes as ``[BLOCK_N, 8, 64]`` (group 7 zero-filled), the
    bf16 rope ``[BLOCK_N, 1, 64]`` and the scale row ``[BLOCK_N, 8]``, with the copying threads laid
    out as ``L3``: a warp instruction copies 64 bytes of each of 8 tokens (one token's 512 bytes
    per instruction was no faster: results/h200/mma_probe_r26a.json). Invalid tokens are
    zero-filled."""
    nope_s, rope_s, sc_s = stage
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    j = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    v2 = valid[:, None]
    v3 = v2[:, :, None]
    _cp_async(
        nope_s, cache + row[:, None, None] + (g * 64)[None, :, None] + j[None, None, :],
        mask=v3 & (g < 7)[None, :, None])
    _cp_async(sc_s, cache + srow[:, None] + g[None, :], mask=v2)
    _cp_async(
        rope_s, (cache + row + 448).to(gl.pointer_type(gl.bfloat16))[:, None, None] + j[None, None, :], mask=v3)


@gluon.jit
def _store_tile(kb, nb, sb, rope, OUT: gl.constexpr):
    """Decode one tile's raw bytes, read back from the ring in layout ``[BLOCK_N, 8, 64]`` (FP8
    times its UE8M0 scale, built as a float's exponent field: the arithmetic of
    :func:`mla.kernels.common.dequant`; the rope, which broadcasts onto group 7, as it is) and
    store it, as one ``[BLOCK_N, 512]`` block, into the tile buffer ``kb``. One store: Triton 3.6
    puts a barrier between any two stores into one allocation, slices or not."""
    scale = (sb.to(gl.int32) << 23).to(gl.float32, bitcast=True)
    v = nb.to(gl.float8e4nv, bitcast=True).to(OUT) * scale[:, :, None].to(OUT)
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, nb.type.layout)))
    v = gl.where((g < 7)[None, :, None], v, rope.to(OUT))
    kb.store(gl.reshape(v, [v.shape[0], 512]))


@gluon.jit
def _store_o(ptr, rows, hmask, o, ABLATE: gl.constexpr, RL: gl.constexpr = ROWS_L):
    """Store ``o [BH, 512]`` at ``ptr + rows*512``, laid out as ``RL`` (:data:`ROWS_L`, or
    :data:`ROWS_L4` in a 4-warp kernel) for the stores."""
    if not (ABLATE & 32):
        o = gl.convert_layout(o, RL)
        rows = gl.convert_layout(rows, gl.SliceLayout(1, RL))
        hm = gl.convert_layout(hmask, gl.SliceLayout(1, RL))
        c = gl.arange(0, 512, layout=gl.SliceLayout(0, RL))
        gl.store(ptr + rows[:, None] * 512 + c[None, :], o, mask=hm[:, None])


@gluon.jit
def _epilogue(o, m_i, l_i, hb, tok, b, s_idx, split, out_ptr, lse_ptr, sink_ptr, po_ptr, plse_ptr, s_q, h_q,
              num_splits, HAS_SINK: gl.constexpr, PARTIAL: gl.constexpr, BH: gl.constexpr, O_L: gl.constexpr,
              ABLATE: gl.constexpr = 0, RL: gl.constexpr = ROWS_L):
    """Normalize O (in layout ``O_L``) and store it with its LSE: final (sink applied) or a split's
    partial. O leaves as rows of 16-byte stores, a warp's 32 threads on 512 contiguous bytes: in
    the heads-as-M wgmma's layout each thread would store 4 bytes at a time and 8 threads 16
    bytes of a row, which cost 3.4 to 4.6 us at V4-CSA b32 and b128 and DSA b128
    (results/h200/mma_probe_r24a.json)."""
    heads = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, O_L))
    hmask = heads < h_q
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, O_L))
    empty = l_o == 0.0
    l_safe = gl.where(empty, 1.0, l_o)
    lse2 = m_o + gl.log2(l_safe)                                             # log2 units
    o = o / l_safe[:, None]
    if PARTIAL:
        prow = (tok.to(gl.int64) * num_splits + split) * h_q + heads
        gl.store(plse_ptr + prow, gl.where(empty, float("-inf"), lse2), mask=hmask)
        _store_o(po_ptr, prow, hmask, o.to(po_ptr.dtype.element_ty), ABLATE, RL)
    else:
        lse = lse2 * 0.6931471805599453
        if HAS_SINK:
            sink = gl.load(sink_ptr + heads, mask=hmask, other=0.0)
            o = o * (1.0 / (1.0 + gl.exp(sink - gl.where(empty, 0.0, lse))))[:, None]
        o = gl.where(empty[:, None], 0.0, o)
        _store_o(out_ptr, tok.to(gl.int64) * h_q + heads, hmask, to_bf16(o), ABLATE, RL)
        gl.store(lse_ptr + (b * h_q + heads) * s_q + s_idx, gl.where(empty, float("inf"), lse), mask=hmask)


@gluon.jit
def _load_q(q_ptr, tok, h_q, hb, q_smem, BH: gl.constexpr, ABLATE: gl.constexpr):
    """Q's heads ``hb*BH ..`` (zeros past h_q) into shared memory as fp16, loaded as rows of
    16-byte loads (a warp's 32 threads on 512 contiguous bytes; the decode's layout, which put 8
    threads on 128 bytes, cost 1.5 us at V4-CSA b32 and b128: results/h200/mma_probe_r24b.json)."""
    if not (ABLATE & 16):       # (timing ablation 16: no Q)
        qh = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, ROWS_L))
        qc = gl.arange(0, 512, layout=gl.SliceLayout(0, ROWS_L))
        qv = gl.load(q_ptr + ((tok.to(gl.int64) * h_q + qh) * 512)[:, None] + qc[None, :], mask=(qh < h_q)[:, None],
                     other=0.0)
        q_smem.store(qv.to(gl.float16))


@gluon.jit
def _producer(nope_r, rope_r, sc_r, ready, empty, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
              ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr,
              ALIGN: gl.constexpr, ABLATE: gl.constexpr, NST: gl.constexpr, PW: gl.constexpr, U: gl.constexpr):
    """Worker partition (the default one in the two-consumer form): copies each tile's raw bytes
    into the ring (cp.async) once the consumers have read the stage's previous tile; each copying
    thread arrives on the stage's ``ready`` barrier when its own copies have landed. Holds only
    addresses; the next tile's indices are loaded before the wait (loading two or three tiles
    ahead was slower: results/h200/mma_probe_r25d.json). For consumer tiles of ``U`` ring tiles
    it copies a multiple of ``U`` (tiles at or past ``hi`` all invalid: zero-filled)."""
    LP: gl.constexpr = gl.BlockedLayout([1, 8, 16], [8, 1, 4], [PW, 1, 1], [2, 1, 0])
    RP: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LP))
    cache, valid, row, srow = _tile_rows(lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                         ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, RP, ALIGN, ABLATE)
    for ti in range(lo, lo + (hi - lo + U - 1) // U * U):
        j = ti - lo
        st = j % NST
        mbarrier.wait(empty.index(st), ((j // NST) & 1) ^ 1)
        _copy_tile((nope_r.index(st), rope_r.index(st), sc_r.index(st)), cache, valid, row, srow, LP)
        async_copy.mbarrier_arrive(ready.index(st), increment_count=False)
        cache, valid, row, srow = _tile_rows(ti + 1, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                             ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, RP,
                                             ALIGN, ABLATE)


@gluon.jit
def _consumer(q_ptr, tok, h_q, hb, q_smem, k_smem, p_smem, nope_r, rope_r, sc_r, ready, empty, lo, hi, tiles1,
              kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, sm_scale_log2,
              BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr, ALIGN: gl.constexpr, ABLATE: gl.constexpr,
              NST: gl.constexpr, BH: gl.constexpr):
    """Default partition (8 warps): per tile, decode from the ring into the tile buffer, release
    the stage, then S, the online softmax and P.V (see the module docstring). ``BH`` is 64."""
    OUT: gl.constexpr = gl.float16
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    L3: gl.constexpr = gl.BlockedLayout([1, 8, 16], [8, 1, 4], [8, 1, 1], [2, 1, 0])
    SCOL_L: gl.constexpr = gl.SliceLayout(0, S_L)
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, S_L))
    o = gl.zeros([BH, 512], gl.float32, layout=O_L)
    s_zero = gl.zeros([BH, BLOCK_N], gl.float32, layout=S_L)
    # Q -> shared memory (fp16, heads past h_q as zeros) while the producer's first copies fly;
    # the barrier at the top of the first iteration orders it before the first wgmma.
    _load_q(q_ptr, tok, h_q, hb, q_smem, BH, ABLATE)
    for ti in range(lo, hi):
        j = ti - lo
        st = j % NST
        # This tile's score mask in S's column layout, loaded now so that its latency is spent
        # in the wait and the decode (an index reload that hits in cache costs less than moving
        # the mask between layouts).
        _c, vs, _r, _s = _tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride,
                                    ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, SCOL_L, ALIGN, ABLATE)
        mbarrier.wait(ready.index(st), (j // NST) & 1)
        _cta_barrier()             # both warpgroups are past their P.V of tile ti-1: the tile buffer is free
        nb = nope_r.index(st).load(L3)
        rope = rope_r.index(st).load(L3)
        sb = sc_r.index(st).load(gl.SliceLayout(2, L3))
        _store_tile(k_smem, nb, sb, rope, OUT)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(empty.index(st))   # every consumer thread has read the stage
        s_tok = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        s = gl.where(vs[None, :], s * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p_smem.store(p.to(OUT))
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        fence_async_shared()
        _cta_barrier()
        o_tok = warpgroup_mma(p_smem, k_smem, o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
    return m_i, l_i, o


@gluon.jit
def _softmax_t(s, vs, m_i, l_i, sm_scale_log2):
    """One online-softmax step on ``S^T [tokens, heads]`` (the tokens-as-M forms), in the exp2
    domain: tokens where ``vs`` is false are masked out; returns P^T, the rescale factor of what
    came before, and the new running max and sum per head."""
    s = gl.where(vs[:, None], s * sm_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[None, :])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=0)


@gluon.jit
def _units_mask(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n,
                idx_extra, n2, RING_N: gl.constexpr, U: gl.constexpr, HAS_EXTRA: gl.constexpr, ROW_L: gl.constexpr):
    """The valid mask of ring tiles ``ti .. ti+U-1`` as one ``[U*RING_N]`` vector (row ``r`` is
    token ``r % RING_N`` of tile ``ti + r // RING_N``); a tile at or past ``hi`` is all invalid."""
    r = gl.arange(0, U * RING_N, layout=ROW_L)
    t_i = ti + r // RING_N
    _c, idx_row, t, n, n_tokens, P, stride = tile_source(t_i, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                                         ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, HAS_EXTRA)
    n = gl.where(t_i < hi, n, 0)
    valid, _r, _s = token_rows(idx_row, t * RING_N + r % RING_N, n, n_tokens, P, stride)
    return valid


@gluon.jit
def _consumer_t(q_ptr, tok, h_q, hb, q_smem, k_smem, p_smem, nope_r, rope_r, sc_r, ready, empty, lo, hi, tiles1,
                kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2,
                sm_scale_log2, RING_N: gl.constexpr, HAS_EXTRA: gl.constexpr, ALIGN: gl.constexpr,
                ABLATE: gl.constexpr, NST: gl.constexpr, BH: gl.constexpr, U: gl.constexpr):
    """Default partition of the tokens-as-M variants (few heads): the token tile is the M of both
    dots, so that 8 heads are padded to ``BH`` (16 or 8), not 64:
    ``S^T[TN, BH] = K.Q^T`` and ``O^T[512, BH] += V^T.P^T`` (V^T read from the same tile
    buffer, transposed; the 512 rows split over the warpgroups). The softmax runs down S^T's
    columns. A tile is ``U`` ring tiles (``TN = U*RING_N`` tokens):

    - ``U = 1``, ``BH = 16``: each warpgroup computes S^T for 8 of the heads, so both read the
      whole tile for it;
    - ``U = 2``, ``BH = 8``: a 128-token tile decoded from two ring stages; each warpgroup
      computes S^T for its 64 tokens, so the tile is read once for S and once for P.V, and the
      loop's fixed costs (barriers, waits, reductions) are paid once per 128 tokens."""
    OUT: gl.constexpr = gl.float16
    TN: gl.constexpr = U * RING_N
    if U == 1:
        ST_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BH // 2, 16])
    else:
        ST_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BH, 16])
    OT_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BH, 16])
    L3: gl.constexpr = gl.BlockedLayout([1, 8, 16], [8, 1, 4], [8, 1, 1], [2, 1, 0])
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ST_L))
    l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(0, ST_L))
    ot = gl.zeros([512, BH], gl.float32, layout=OT_L)
    s_zero = gl.zeros([TN, BH], gl.float32, layout=ST_L)
    _load_q(q_ptr, tok, h_q, hb, q_smem, BH, ABLATE)
    for ti in range(lo, hi, U):
        vs = _units_mask(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n,
                         idx_extra, n2, RING_N, U, HAS_EXTRA, gl.SliceLayout(1, ST_L))
        for u in gl.static_range(U):
            k = ti - lo + u
            mbarrier.wait(ready.index(k % NST), (k // NST) & 1)
        _cta_barrier()             # both warpgroups are past their P.V of the last tile: the tile buffer is free
        for u in gl.static_range(U):
            st = (ti - lo + u) % NST
            if not (ABLATE & 2):   # (timing ablation 2: no decode)
                nb = nope_r.index(st).load(L3)
                rope = rope_r.index(st).load(L3)
                sb = sc_r.index(st).load(gl.SliceLayout(2, L3))
                _store_tile(k_smem.slice(u * RING_N, RING_N), nb, sb, rope, OUT)
            if u + 1 < U:          # release this stage now, so that its refill starts during the next decode
                _cta_barrier()
                mbarrier.arrive(empty.index(st))
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(empty.index((ti - lo + U - 1) % NST))
        if ABLATE & 4:             # (timing ablation 4: no S wgmma)
            s = s_zero
        else:
            s_tok = warpgroup_mma(k_smem, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        p, alpha, m_i, l_i = _softmax_t(s, vs, m_i, l_i, sm_scale_log2)
        p_smem.store(gl.permute(p.to(OUT), (1, 0)))
        ot = ot * gl.convert_layout(alpha, gl.SliceLayout(0, OT_L))[None, :]
        fence_async_shared()
        _cta_barrier()
        if not (ABLATE & 8):       # (timing ablation 8: no P.V wgmma)
            o_tok = warpgroup_mma(k_smem.permute((1, 0)), p_smem.permute((1, 0)), ot, is_async=True)
            ot = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
    return m_i, l_i, ot


@gluon.jit
def _decode_group(nope_st, rope_st, sc_st, g: gl.constexpr, ABLATE: gl.constexpr = 0):
    """Group ``g`` (dims ``64g ..``) of a ring stage as fp16 ``[64 tokens, 1, 64]`` in :data:`GL`:
    FP8 times its UE8M0 scale (groups 0-6), or the bf16 rope (group 7). (Timing ablation 2:
    zeros, nothing read.)"""
    if ABLATE & 2:
        v = gl.zeros([64, 1, 64], gl.float16, GL)
    elif g < 7:
        raw = nope_st.slice(g, 1, dim=1).load(GL)
        sb = sc_st.slice(g, 1, dim=1).load(gl.SliceLayout(2, GL))
        scale = (sb.to(gl.int32) << 23).to(gl.float32, bitcast=True)
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
def _load_q_d(q_ptr, tok, h_q, hb, q_smem, BH: gl.constexpr, ABLATE: gl.constexpr):
    """Q's heads ``hb*BH ..`` into shared memory as fp16 for the two-consumer form, each 64-dim
    group's columns in the order of :data:`GL`: column ``64g + k`` holds dim ``64g + 16*((k>>1)&3)
    + 4*(k>>4) + 2*((k>>3)&1) + (k&1)``."""
    if not (ABLATE & 16):
        L: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0])
        qh = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, L))
        k = gl.arange(0, 512, layout=gl.SliceLayout(0, L))
        kg = k & 63
        d = (k >> 6) * 64 + ((kg >> 1) & 3) * 16 + (kg >> 4) * 4 + ((kg >> 3) & 1) * 2 + (kg & 1)
        q = gl.load(q_ptr + ((tok.to(gl.int64) * h_q + qh) * 512)[:, None] + d[None, :], mask=(qh < h_q)[:, None],
                    other=0.0)
        q_smem.store(q.to(gl.float16))


@gluon.jit
def _consumer_d(WHICH: gl.constexpr, q_smem, k_smem, p_smem, nope_r, rope_r, sc_r, ready, empty, lo, hi, tiles1,
                kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2,
                sm_scale_log2, RING_N: gl.constexpr, HAS_EXTRA: gl.constexpr, ALIGN: gl.constexpr,
                ABLATE: gl.constexpr, NST: gl.constexpr, BH: gl.constexpr):
    """One consumer warpgroup of the two-consumer form: ring tiles ``WHICH, WHICH+2, ..`` of the
    program's range, tokens as M. Each 64-dim group of a tile is decoded once, into registers
    that are both S^T's A operand (``S^T = K.Q^T``, Q in :data:`GL`'s order) and the source of
    this consumer's tile buffer (natural order), which is O^T's A (``O^T += V^T.P^T``). The ring
    stage is released as soon as it is decoded. Returns this consumer's (m, l, O^T)."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ACC))
    l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(0, ACC))
    ot = gl.zeros([512, BH], gl.float32, layout=ACC)
    s_zero = gl.zeros([RING_N, BH], gl.float32, layout=ACC)
    for ti in range(lo + WHICH, hi, 2):
        j = ti - lo
        st = j % NST
        _c, vs, _r, _s = _tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride,
                                    ec_P, ec_n, idx_extra, n2, RING_N, HAS_EXTRA, gl.SliceLayout(1, ACC), ALIGN,
                                    ABLATE)
        nope_st = nope_r.index(st)
        rope_st = rope_r.index(st)
        sc_st = sc_r.index(st)
        mbarrier.wait(ready.index(st), (j // NST) & 1)
        _cta_barrier()             # this warpgroup is past its P.V of its last tile: its tile buffer is free
        v = _decode_group(nope_st, rope_st, sc_st, 0, ABLATE)
        k_smem.slice(0, 64, dim=1).store(gl.reshape(v, [64, 64]))
        if ABLATE & 4:             # (timing ablation 4: no S^T wgmma)
            for g in gl.static_range(1, 8):
                v = _decode_group(nope_st, rope_st, sc_st, g, ABLATE)
                k_smem.slice(64 * g, 64, dim=1).store(gl.reshape(v, [64, 64]))
            s = s_zero
        else:
            a = _as_a(v, A_L)
            s = warpgroup_mma(a, q_smem.slice(0, 64, dim=1).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            for g in gl.static_range(1, 8):
                v = _decode_group(nope_st, rope_st, sc_st, g, ABLATE)
                k_smem.slice(64 * g, 64, dim=1).store(gl.reshape(v, [64, 64]))
                a_n = _as_a(v, A_L)
                s = warpgroup_mma(a_n, q_smem.slice(64 * g, 64, dim=1).permute((1, 0)), s, is_async=True)
                s, a = warpgroup_mma_wait(num_outstanding=1, deps=(s, a))
                a = a_n
            s, a = warpgroup_mma_wait(num_outstanding=0, deps=(s, a))
        _cta_barrier()             # every thread of this warpgroup has read the stage
        mbarrier.arrive(empty.index(st))
        p, alpha, m_i, l_i = _softmax_t(s, vs, m_i, l_i, sm_scale_log2)
        p_smem.store(gl.permute(p.to(gl.float16), (1, 0)))
        ot = ot * alpha[None, :]
        fence_async_shared()
        _cta_barrier()             # the tile buffer and P are written
        if not (ABLATE & 8):       # (timing ablation 8: no O^T wgmma)
            o_tok = warpgroup_mma(k_smem.permute((1, 0)), p_smem.permute((1, 0)), ot, is_async=True)
            ot = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
    return m_i, l_i, ot


@gluon.jit
def _consumer_w(WHICH: gl.constexpr, x_smem, xml_smem, q_smem, k_smem, p_smem, nope_r, rope_r, sc_r, ready, empty, lo,
                hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2,
                sm_scale_log2, RING_N: gl.constexpr, HAS_EXTRA: gl.constexpr, ALIGN: gl.constexpr,
                ABLATE: gl.constexpr, NST: gl.constexpr, BH: gl.constexpr):
    """Worker partition: consumer ``WHICH`` (:func:`_consumer_d`), which leaves its O^T in
    ``x_smem`` (its own tile buffer, reinterpreted) and its m and l in rows ``2*WHICH`` and
    ``2*WHICH+1`` of ``xml_smem``, for the epilogue to merge."""
    m_i, l_i, ot = _consumer_d(WHICH, q_smem, k_smem, p_smem, nope_r, rope_r, sc_r, ready, empty, lo, hi, tiles1,
                               kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra,
                               n2, sm_scale_log2, RING_N, HAS_EXTRA, ALIGN, ABLATE, NST, BH)
    _cta_barrier()                 # its last P.V has read the tile buffer that x_smem aliases
    x_smem.store(ot)
    xml_smem.index(2 * WHICH).store(m_i)
    xml_smem.index(2 * WHICH + 1).store(l_i)


@gluon.jit
def wgmma_decode_kernel(
    q_ptr, out_ptr, lse_ptr, sink_ptr, po_ptr, plse_ptr,
    kc_ptr, kc_stride, kc_P, kc_n, idx_ptr, topk, len_ptr,
    ec_ptr, ec_stride, ec_P, ec_n, eidx_ptr, etopk, elen_ptr,
    s_q, h_q, sm_scale_log2, num_splits,
    HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_ELEN: gl.constexpr,
    PARTIAL: gl.constexpr, BLOCK_N: gl.constexpr, ALIGN: gl.constexpr = 16, ABLATE: gl.constexpr = 0,
    BH: gl.constexpr = 64, NST: gl.constexpr = 2, U: gl.constexpr = 1, DUO: gl.constexpr = 0,
    PREG: gl.constexpr = PRODUCER_REGS, CREG: gl.constexpr = DUO_REGS, GM: gl.constexpr = RING_GROUP_MAJOR,
):
    """One program per (query token, ``BH`` heads, split); see the module docstring. ``BH`` 64:
    heads as the M of the dots; 16 or 8: tokens as M (:func:`_consumer_t`), with tiles of ``U``
    ring tiles of ``BLOCK_N`` tokens; ``DUO`` (8 heads): two consumers (:func:`_consumer_d`,
    launched with :data:`DUO_WARPS` warps, the default partition's). ``NST``: ring stages
    (:data:`NUM_STAGES`, :data:`DUO_STAGES`). ``PREG``: the producer's registers when it is a
    worker; ``CREG``: each of the two consumers'. ``GM``: the FP8 ring stored group-major
    (:data:`RING_GROUP_MAJOR`). ``ALIGN``: see :func:`_tile_rows` and
    :func:`row_align`. ``ABLATE``: timing ablations, whose results are wrong (bits: 1 every tile
    reads the first tokens of page 0; with tokens as M, 2 no decode, 4 no S^T, 8 no P.V; 16 no Q
    load; 32 no store of O; 64 no tiles)."""
    gl.static_assert(BLOCK_N == 64, "shared memory is sized for 64-token ring tiles")
    if DUO:
        gl.static_assert(BH == 8 and U == 1, "two consumers: 8 heads x 64 tokens (16 heads take 235 KB)")
    else:
        gl.static_assert((BH == 64 and U == 1) or (BH == 16 and U == 1) or (BH == 8 and U == 2),
                         "heads x tile: 64 x 64 (heads as M), 16 x 64 or 8 x 128 (tokens as M)")
    OUT: gl.constexpr = gl.float16
    PW: gl.constexpr = PRODUCER_WARPS
    Q_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, 512], OUT)
    K_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([U * BLOCK_N, 512], OUT)
    P_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, U * BLOCK_N], OUT)
    # vec 16: 16 contiguous elements per copy; Triton 3.9 sizes its cp.async by it (with vec 1
    # it copies 8 bytes), 3.6 compiles the same SASS either way.
    R3: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 1, [2, 1, 0])
    RN: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 1, [2, 0, 1] if GM else [2, 1, 0])   # RING_GROUP_MAJOR
    R2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    hb = gl.program_id(0)
    split = gl.program_id(1)
    tok = gl.program_id(2)
    b = tok // s_q
    s_idx = tok - b * s_q
    n1, tiles1, n2, lo, hi = split_range(b, split, topk, len_ptr, etopk, elen_ptr, num_splits, BLOCK_N, HAS_LEN,
                                         HAS_EXTRA, HAS_ELEN)
    if U > 1:   # each split takes a multiple of U ring tiles
        tiles = tiles1 + (n2 + BLOCK_N - 1) // BLOCK_N
        per = ((tiles + num_splits - 1) // num_splits + U - 1) // U * U
        lo = split * per
        hi = gl.minimum(lo + per, tiles)
    if ABLATE & 64:     # (timing ablation 64: no tiles)
        hi = lo
    idx_main = idx_ptr + tok.to(gl.int64) * topk
    idx_extra = eidx_ptr + tok.to(gl.int64) * etopk

    nope_r = gl.allocate_shared_memory(gl.uint8, [NST, BLOCK_N, 8, 64], RN)
    rope_r = gl.allocate_shared_memory(gl.bfloat16, [NST, BLOCK_N, 1, 64], R3)
    sc_r = gl.allocate_shared_memory(gl.uint8, [NST, BLOCK_N, 8], R2)
    ready = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NST):
        mbarrier.init(ready.index(i), count=PW * 32)
        mbarrier.init(empty.index(i), count=1)

    if DUO:
        q_smem = gl.allocate_shared_memory(OUT, [BH, 512], Q_S)
        k0_smem = gl.allocate_shared_memory(OUT, [BLOCK_N, 512], K_S)
        k1_smem = gl.allocate_shared_memory(OUT, [BLOCK_N, 512], K_S)
        p0_smem = gl.allocate_shared_memory(OUT, [BH, BLOCK_N], P_S)
        p1_smem = gl.allocate_shared_memory(OUT, [BH, BLOCK_N], P_S)
        xml_smem = gl.allocate_shared_memory(gl.float32, [4, BH], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        # each consumer's O^T, handed over in its own tile buffer once its last P.V is done
        X_S: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        x0_smem = _reinterpret(k0_smem, gl.float32, [512, BH], X_S)
        x1_smem = _reinterpret(k1_smem, gl.float32, [512, BH], X_S)
        _load_q_d(q_ptr, tok, h_q, hb, q_smem, BH, ABLATE)
    else:
        q_smem = gl.allocate_shared_memory(OUT, [BH, 512], Q_S)
        k_smem = gl.allocate_shared_memory(OUT, [U * BLOCK_N, 512], K_S)
        p_smem = gl.allocate_shared_memory(OUT, [BH, U * BLOCK_N], P_S)
    fence_async_shared()
    _cta_barrier()

    if DUO:
        # the producer is the default partition (it gets the registers the consumers leave)
        gl.warp_specialize([
            (_producer, (nope_r, rope_r, sc_r, ready, empty, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n,
                         idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, ALIGN,
                         ABLATE, NST, PW, 1)),
            (_consumer_w, (0, x0_smem, xml_smem, q_smem, k0_smem, p0_smem, nope_r, rope_r, sc_r, ready, empty, lo, hi,
                           tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n,
                           idx_extra, n2, sm_scale_log2, BLOCK_N, HAS_EXTRA, ALIGN, ABLATE, NST, BH)),
            (_consumer_w, (1, x1_smem, xml_smem, q_smem, k1_smem, p1_smem, nope_r, rope_r, sc_r, ready, empty, lo, hi,
                           tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n,
                           idx_extra, n2, sm_scale_log2, BLOCK_N, HAS_EXTRA, ALIGN, ABLATE, NST, BH)),
        ], [DUO_WARPS, DUO_WARPS], [CREG, CREG])
        # merge the two consumers' online-softmax states
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
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
        _epilogue(o, m_i, l_i, hb, tok, b, s_idx, split, out_ptr, lse_ptr, sink_ptr, po_ptr, plse_ptr, s_q, h_q,
                  num_splits, HAS_SINK, PARTIAL, BH, ROWS_L4, ABLATE, ROWS_L4)
    elif BH == 64:
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, 256, 16])
        m_i, l_i, o = gl.warp_specialize([
            (_consumer, (q_ptr, tok, h_q, hb, q_smem, k_smem, p_smem, nope_r, rope_r, sc_r, ready, empty, lo, hi,
                         tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra,
                         n2, sm_scale_log2, BLOCK_N, HAS_EXTRA, ALIGN, ABLATE, NST, BH)),
            (_producer, (nope_r, rope_r, sc_r, ready, empty, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n,
                         idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, ALIGN,
                         ABLATE, NST, PW, 1)),
        ], [PW], [PREG])
        _epilogue(o, m_i, l_i, hb, tok, b, s_idx, split, out_ptr, lse_ptr, sink_ptr, po_ptr, plse_ptr, s_q, h_q,
                  num_splits, HAS_SINK, PARTIAL, BH, O_L, ABLATE)
    else:
        # O^T back to [BH, 512], in the layout of the epilogue's row-wise stores.
        m_i, l_i, ot = gl.warp_specialize([
            (_consumer_t, (q_ptr, tok, h_q, hb, q_smem, k_smem, p_smem, nope_r, rope_r, sc_r, ready, empty, lo, hi,
                           tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n,
                           idx_extra, n2, sm_scale_log2, BLOCK_N, HAS_EXTRA, ALIGN, ABLATE, NST, BH, U)),
            (_producer, (nope_r, rope_r, sc_r, ready, empty, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n,
                         idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, ALIGN,
                         ABLATE, NST, PW, U)),
        ], [PW], [PREG])
        o = gl.convert_layout(gl.permute(ot, (1, 0)), ROWS_L)
        _epilogue(o, m_i, l_i, hb, tok, b, s_idx, split, out_ptr, lse_ptr, sink_ptr, po_ptr, plse_ptr, s_q, h_q,
                  num_splits, HAS_SINK, PARTIAL, BH, ROWS_L, ABLATE)
