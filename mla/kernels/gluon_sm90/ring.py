"""The producer side of the Gluon kernel: which cache bytes a token tile needs, and their copy
into the shared-memory ring.

The producer partition holds addresses only. For each 64-token ring tile of its program's share
of the work list, query after query, it waits until the consumers have released the stage
(``empty``), issues ``cp.async`` copies of the tile's raw bytes (FP8 nope, bf16 rope, UE8M0
scales; invalid tokens zero-filled) into it, and each copying thread arrives on the stage's
``ready`` barrier once its own copies have landed. ``V32``: DeepSeek-V3.2's cache, whose token
is one 656-byte row (8 groups of FP8 nope, 4 float32 scales, the rope); its rope lands in a
wgmma operand layout, which the consumers' S reads in place.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ..common import NOPE, NOPE_TILES, V32_ROPE, piece, query_rows, tile_source, token_rows
from .compat import cp_async

#: tokens per ring stage
RING_N = gl.constexpr(64)


@gluon.jit
def tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
              ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2,
              BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr, ROW_L: gl.constexpr, ALIGN: gl.constexpr,
              V32: gl.constexpr = False):
    """Token tile ``ti`` of the query's list (main cache's tiles, then the extra cache's): the
    cache it comes from and, per position in layout ``ROW_L``, (valid, data row, scale row); a
    tile at or past ``hi`` is all invalid. ``ALIGN`` (16 or 8, :func:`~.kernel.row_align`) is what
    the caches' page strides are multiples of, so each token's row too (the base addresses are
    multiples of 16; a row is 576 bytes, a scale row 8): the width of the ring's cp.async copies.
    The stride is rebuilt as a multiple of ``ALIGN`` because Triton specializes an integer argument
    on divisibility by 16 only: from a stride of 8 it compiled the copies as 1-byte transfers,
    which cp.async does not have. ``V32``: the rows of DeepSeek-V3.2's cache."""
    cache, idx_row, t, n, n_tokens, P, stride = tile_source(ti, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                                            ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, HAS_EXTRA)
    stride = (stride // ALIGN) * ALIGN      # the same value, in a form whose alignment Triton can see
    n = gl.where(ti < hi, n, 0)
    valid, row, srow = token_rows(idx_row, t * BLOCK_N + gl.arange(0, BLOCK_N, layout=ROW_L), n, n_tokens, P,
                                  stride, V32)
    return cache, valid, row, srow


@gluon.jit
def _copy_tile(stage, cache, valid, row, srow, L3: gl.constexpr, V32: gl.constexpr = False):
    """Issue the asynchronous copies (cp.async, no registers held) of one token tile's raw bytes
    into ring stage ``stage``: the FP8 bytes as ``[BLOCK_N, 8, 64]`` (group 7 zero-filled), the
    bf16 rope ``[BLOCK_N, 1, 64]`` and the scale row ``[BLOCK_N, 8]``, with the copying threads laid
    out as ``L3``: a warp instruction copies 64 bytes of each of 8 tokens. Invalid tokens are
    zero-filled. ``V32``: all 8 groups are FP8, the scales 4 float32 ``[BLOCK_N, 4]`` and the rope
    ``[BLOCK_N, 64]`` in the stage's (wgmma operand) layout."""
    nope_s, rope_s, sc_s = stage
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    j = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    v2 = valid[:, None]
    v3 = v2[:, :, None]
    if V32:
        cp_async(nope_s, cache + row[:, None, None] + (g * 64)[None, :, None] + j[None, None, :], mask=v3)
        k = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        cp_async(sc_s, (cache + srow).to(gl.pointer_type(gl.float32))[:, None] + k[None, :], mask=v2)
        rope_rows = gl.convert_layout(row, gl.SliceLayout(1, gl.SliceLayout(1, L3)))
        cp_async(rope_s, (cache + rope_rows + V32_ROPE).to(gl.pointer_type(gl.bfloat16))[:, None] + j[None, :],
                 mask=gl.convert_layout(valid, gl.SliceLayout(1, gl.SliceLayout(1, L3)))[:, None])
    else:
        cp_async(
            nope_s, cache + row[:, None, None] + (g * 64)[None, :, None] + j[None, None, :],
            mask=v3 & (g < NOPE_TILES)[None, :, None])
        cp_async(sc_s, cache + srow[:, None] + g[None, :], mask=v2)
        cp_async(
            rope_s, (cache + row + NOPE).to(gl.pointer_type(gl.bfloat16))[:, None, None] + j[None, None, :],
            mask=v3)


@gluon.jit
def ring_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n,
              idx_extra, n2, BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr, ALIGN: gl.constexpr,
              RING_L: gl.constexpr):
    """(cache, valid, row, scale row) of token tile ``ti`` (all invalid at or past ``hi``), one
    token a thread in the copying threads' layout ``RING_L``: the rows a one-partition kernel's
    threads copy (:func:`issue_group`)."""
    return tile_rows(ti, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n,
                     idx_extra, n2, BLOCK_N, HAS_EXTRA, gl.SliceLayout(1, gl.SliceLayout(2, RING_L)), ALIGN)


@gluon.jit
def issue_group(stage, rows, RING_L: gl.constexpr):
    """The copies of one token tile (its :func:`ring_rows`) into one ring stage, as one cp.async
    group."""
    cache, valid, row, srow = rows
    _copy_tile(stage, cache, valid, row, srow, RING_L)
    async_copy.commit_group()


@gluon.jit
def ring_start(ring, lo, hi, src, BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr, ALIGN: gl.constexpr,
               RING_L: gl.constexpr, STAGES: gl.constexpr):
    """A one-partition kernel's ring at the start of a piece: the copies of its first
    ``STAGES - 1`` token tiles into the first stages of ``ring`` (nope, rope, scales), a cp.async
    group each, and the rows of the next tile, which the loop's first step issues
    (:func:`ring_step`). ``src``: where the rows come from, the arguments of :func:`ring_rows`
    after ``hi``, ``BLOCK_N`` excluded."""
    nope_r, rope_r, sc_r = ring
    tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2 = src
    for u in gl.static_range(STAGES - 1):
        issue_group((nope_r.index(u), rope_r.index(u), sc_r.index(u)),
                    ring_rows(lo + u, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride,
                              ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, ALIGN, RING_L), RING_L)
    return ring_rows(lo + STAGES - 1, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride,
                     ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, ALIGN, RING_L)


@gluon.jit
def ring_step(ring, ti, lo, hi, nxt, src, BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr, ALIGN: gl.constexpr,
              RING_L: gl.constexpr, STAGES: gl.constexpr):
    """Token tile ``ti``'s step of the ring (:func:`ring_start`): the copies of tile
    ``ti + STAGES - 1`` (its rows ``nxt``) into the stage tile ``ti - 1`` was decoded from, and
    the rows of tile ``ti + STAGES``, whose load flies while this tile is computed."""
    nope_r, rope_r, sc_r = ring
    tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2 = src
    ahead = (ti - lo + STAGES - 1) % STAGES
    issue_group((nope_r.index(ahead), rope_r.index(ahead), sc_r.index(ahead)), nxt, RING_L)
    return ring_rows(ti + STAGES, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride,
                     ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, ALIGN, RING_L)


@gluon.jit
def _produce(j, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n,
             idx_extra, n2, nope_r, rope_r, sc_r, ready, empty, HAS_EXTRA: gl.constexpr, ALIGN: gl.constexpr,
             STAGES: gl.constexpr, RING_TILES: gl.constexpr, LP: gl.constexpr, V32: gl.constexpr = False):
    """Copy ring tiles ``[lo, hi)`` of one query, rounded up to a multiple of ``RING_TILES`` (tiles
    at or past ``hi`` all invalid: zero-filled), into the ring from its ``j``-th stage use on; each
    waits until the consumers have read the stage's previous tile, and the next tile's indices are
    loaded before that wait. Returns the count of stage uses after them."""
    RP: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LP))
    cache, valid, row, srow = tile_rows(lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                        ec_stride, ec_P, ec_n, idx_extra, n2, RING_N, HAS_EXTRA, RP, ALIGN, V32)
    for ti in range(lo, lo + (hi - lo + RING_TILES - 1) // RING_TILES * RING_TILES):
        st = j % STAGES
        mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
        _copy_tile((nope_r.index(st), rope_r.index(st), sc_r.index(st)), cache, valid, row, srow, LP, V32)
        async_copy.mbarrier_arrive(ready.index(st), increment_count=False)
        cache, valid, row, srow = tile_rows(ti + 1, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                                            ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, RING_N, HAS_EXTRA, RP,
                                            ALIGN, V32)
        j += 1
    return j


@gluon.jit
def producer(nope_r, rope_r, sc_r, ready, empty, x0, x1, q0, c0, q_end, n_q, s_q, idx_ptr, idx_sb, idx_ss, topk,
             len_ptr, len_stride, eidx_ptr, eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride, kc_ptr, kc_stride, kc_P,
             kc_n, ec_ptr, ec_stride, ec_P, ec_n, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr,
             HAS_ELEN: gl.constexpr, ALIGN: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
             RING_TILES: gl.constexpr, V32: gl.constexpr = False):
    """The producer partition of a persistent program: the raw bytes of every tile of its share
    of the work list (units ``[x0, x1)``, queries ``q0 .. q_end-1``, the first starting at unit
    ``c0``), query after query, into the ring, running ahead of the consumers across queries
    (``V32``: from DeepSeek-V3.2's cache)."""
    LP: gl.constexpr = gl.BlockedLayout([1, 8, 16], [8, 1, 4], [WARPS, 1, 1], [2, 1, 0])
    j = c0 * 0
    c = c0
    for q in range(q0, q_end):
        lo, hi, split, tiles1, n1, n2, units = piece(q, c, x0, x1, s_q, topk, len_ptr, len_stride, etopk, elen_ptr,
                                                     elen_stride, RING_N, RING_TILES, HAS_LEN, HAS_EXTRA,
                                                     HAS_ELEN)
        _q, i_off, e_off = query_rows(q, s_q, 0, 0, idx_sb, idx_ss, eidx_sb, eidx_ss)
        j = _produce(j, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_ptr + i_off, n1, ec_ptr, ec_stride, ec_P,
                     ec_n, eidx_ptr + e_off, n2, nope_r, rope_r, sc_r, ready, empty, HAS_EXTRA, ALIGN, STAGES,
                     RING_TILES, LP, V32)
        c += units


@gluon.jit
def producer_one(nope_r, rope_r, sc_r, ready, empty, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1,
                 ec_ptr, ec_stride, ec_P, ec_n, idx_extra, n2, HAS_EXTRA: gl.constexpr, ALIGN: gl.constexpr,
                 STAGES: gl.constexpr, WARPS: gl.constexpr):
    """The producer partition of the one form with a program per query piece (two consumers): the
    tiles ``[lo, hi)`` of one query."""
    LP: gl.constexpr = gl.BlockedLayout([1, 8, 16], [8, 1, 4], [WARPS, 1, 1], [2, 1, 0])
    _produce(lo * 0, lo, hi, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n,
             idx_extra, n2, nope_r, rope_r, sc_r, ready, empty, HAS_EXTRA, ALIGN, STAGES, 1, LP)
