"""Triton building blocks shared by the kernels: the layout's constants, FP8 decoding, a
query's token list and its split, the gather of one token tile, the online-softmax step, the
epilogue's pieces, and the bf16 store.

A token tile is held as ``[BLOCK_N, 8, 64]``: tile ``t < 7`` of the last two dims is nope tile
``t`` (FP8 times its UE8M0 scale) and tile 7 is the 64 bf16 rope values. Read row-major, the
last two dims are exactly the 512 columns of the latent (448 nope then 64 rope), so the same
tensor serves as K for Q.K^T and as V for P.V.

DeepSeek-V3.2's layout (the helpers' ``V32`` constexpr, :data:`mla.layout.V32`): q and k are
576 wide, V is the first 512 columns, all nope. The same ``[BLOCK_N, 8, 64]`` tile holds those
512 columns (chunk ``t`` is half of 128-value tile ``t // 2``, FP8 times that tile's float32
scale), K and V as before, and the 64 rope columns are a second, ``[BLOCK_N, 64]`` tile
(:func:`load_rope`) that only Q.K^T reads. A token's bytes lie together (an array of
structures), so its scales are found from its row, not from a scale row of the page.

The scalar and elementwise helpers here are plain ``@triton.jit`` functions that the Gluon
kernel (:mod:`mla.kernels.gluon_sm90`) calls too: they take their layouts from their arguments.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _runtime
from ..layout import D_QK, DATA_BYTES, N_TILES, NOPE_BYTES, SCALE_BYTES, V32 as V32_LAYOUT

#: Whether the kernels run in Triton's interpreter (a constexpr: the compiled kernels do not see it).
_INTERPRET = tl.constexpr(_runtime.INTERPRET)

#: The layout's constants as Triton constexprs (:mod:`mla.layout`).
DATA = tl.constexpr(DATA_BYTES)      #: 576 bytes: a token's data row
NOPE = tl.constexpr(NOPE_BYTES)      #: 448 bytes: its FP8 nope values; the bf16 rope follows
SROW = tl.constexpr(SCALE_BYTES)     #: 8 bytes: a token's scale row
NOPE_TILES = tl.constexpr(N_TILES)   #: 7 nope tiles of 64; tile 7 of a token tile is the rope
DIM = tl.constexpr(D_QK)             #: 512: the width of q, k, v and out

#: V3.2's (:data:`mla.layout.V32`): a token is one 656-byte row of FP8 nope, scales and rope
V32_ROW = tl.constexpr(V32_LAYOUT.row_bytes)          #: 656 bytes from one token to the next
V32_SCALES = tl.constexpr(V32_LAYOUT.scales_at)       #: 512: its 4 float32 scales follow the nope
V32_ROPE = tl.constexpr(V32_LAYOUT.rope_at)           #: 528: its 64 bf16 rope values
V32_TILES = tl.constexpr(V32_LAYOUT.n_tiles)          #: 4 nope tiles ...
V32_TILE = tl.constexpr(V32_LAYOUT.tile)              #: ... of 128 values, one scale each
V32_QK = tl.constexpr(V32_LAYOUT.d_qk)                #: 576: the width of q and k
ROPE_W = tl.constexpr(V32_LAYOUT.d_rope)              #: 64 rope columns (both layouts)

#: log2(e), for a softmax scale in the exp2 domain (host side: the kernels take the product).
LOG2E = 1.4426950408889634
#: ln(2): an lse in log2 units times this is the natural-log lse.
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def e4m3_to_f32(bits):
    """FP8 e4m3fn byte (uint8) -> float32 with integer operations only (any architecture,
    including sm_80, which has no fp8e4nv type). Exact, NaN (S.1111.111) included.

    The 7 magnitude bits shifted left by 7 form an fp16 whose 5-bit exponent field holds the
    4-bit e4m3 exponent: its value is the e4m3 value times 2**-8 (bias 15 versus 7), and fp16
    subnormals line up with e4m3 subnormals. fp16 -> fp32 is exact."""
    b = bits.to(tl.uint16)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    f = h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((b & 0x7F) == 0x7F, float("nan"), f)


@triton.jit
def to_bf16(x):
    """fp32 -> bf16, rounded to nearest even on every target. Every bf16 store of the kernels
    goes through here. On a GPU it is the plain cast. Triton's interpreter casts by dropping the
    low 16 bits (rounding toward zero, a bias that FlashMLA's cosine check catches), so there the
    bf16 bits are made from the fp32 bits with integer arithmetic: add 0x7FFF plus the lowest
    kept bit, keep the high half. NaN stays NaN (quieted), inf stays inf, subnormals round like
    normal numbers, and a finite value past the largest bf16 rounds to inf, as on the GPU."""
    if _INTERPRET:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        bits = tl.where(nan, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def ue8m0_to_f32(bits):
    """UE8M0 byte (uint8) -> float32 2**(byte-127), built as the float's exponent field."""
    return (bits.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def token_rows(idx_row_ptr, offs, n, n_tokens, P, page_stride, V32: tl.constexpr = False):
    """Load indices at ``offs`` (positions < n), and return (valid mask, byte offset of each
    token's data row, byte offset of its scales: MODEL1's scale row in the page's scale rows,
    V3.2's inside the token's row). Invalid tokens point at byte 0 and are never read (the loads
    are masked with ``valid``)."""
    inb = offs < n
    idx = tl.load(idx_row_ptr + offs, mask=inb, other=-1)
    valid = inb & (idx >= 0) & (idx < n_tokens)
    idx64 = tl.where(valid, idx, 0).to(tl.int64)
    blk = idx64 // P
    off = idx64 - blk * P
    page = blk * page_stride
    if V32:
        row = page + off * V32_ROW
        return valid, row, row + V32_SCALES
    else:
        return valid, page + off * DATA, page + P * DATA + off * SROW


@triton.jit
def tile_source(ti, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr, ec_stride, ec_P, ec_n, idx_extra,
                n2, HAS_EXTRA: tl.constexpr):
    """Where token tile ``ti`` of a query's list comes from (the main cache's ``tiles1`` tiles,
    then the extra cache's): (cache, index row, tile number in that cache, its valid length,
    tokens, page size, page stride), picked with scalar selects so that both caches run through
    one loop. Shared by the ``tl.dot`` and the Gluon kernels (scalar code, so it compiles under
    either)."""
    if HAS_EXTRA:
        main = ti < tiles1
        cache = tl.where(main, kc_ptr, ec_ptr)
        idx_row = tl.where(main, idx_main, idx_extra)
        t = tl.where(main, ti, ti - tiles1)
        n = tl.where(main, n1, n2)
        n_tokens = tl.where(main, kc_n, ec_n)
        P = tl.where(main, kc_P, ec_P)
        stride = tl.where(main, kc_stride, ec_stride)
    else:
        cache, idx_row, t, n, n_tokens, P, stride = kc_ptr, idx_main, ti, n1, kc_n, kc_P, kc_stride
    return cache, idx_row, t, n, n_tokens, P, stride


@triton.jit
def query_lengths(q, s_q, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride, mask, HAS_LEN: tl.constexpr,
                  HAS_EXTRA: tl.constexpr, HAS_ELEN: tl.constexpr):
    """The valid positions (main cache, extra cache) of query row ``q`` (``b * s_q + s``; a
    scalar, or a vector whose rows outside ``mask`` read nothing): ``topk`` and ``etopk``, cut
    to the request's lengths where they are given."""
    b = (q // s_q).to(tl.int64)
    n1 = topk + q * 0
    if HAS_LEN:
        n1 = tl.minimum(n1, tl.maximum(tl.load(len_ptr + b * len_stride, mask=mask, other=0), 0))
    n2 = q * 0
    if HAS_EXTRA:
        n2 = etopk + q * 0
        if HAS_ELEN:
            n2 = tl.minimum(n2, tl.maximum(tl.load(elen_ptr + b * elen_stride, mask=mask, other=0), 0))
    return n1, n2


@triton.jit
def query_units(n1, n2, BLOCK_N: tl.constexpr, UNIT: tl.constexpr):
    """(tiles of the main cache, tiles in all, schedule units) of a query with ``n1`` and ``n2``
    valid positions: tiles of BLOCK_N tokens, UNIT tiles a unit, and at least one unit, so that a
    query with no valid token still gets its output written (:func:`mla.schedule.query_units`)."""
    tiles1 = (n1 + BLOCK_N - 1) // BLOCK_N
    tiles = tiles1 + (n2 + BLOCK_N - 1) // BLOCK_N
    return tiles1, tiles, tl.maximum((tiles + UNIT - 1) // UNIT, 1)


@triton.jit
def split_range(q, split, s_q, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride, num_splits,
                BLOCK_N: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_ELEN: tl.constexpr):
    """The uniform split of the one form that takes one query per program (the Gluon kernel's two
    consumers): query row ``q``'s valid lengths in each cache and the token tiles ``[lo, hi)`` of
    its list that split ``split`` of ``num_splits`` takes: (n1, tiles1, n2, lo, hi)."""
    n1, n2 = query_lengths(q, s_q, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride, q >= 0, HAS_LEN,
                           HAS_EXTRA, HAS_ELEN)
    tiles1, tiles, _u = query_units(n1, n2, BLOCK_N, 1)
    per = (tiles + num_splits - 1) // num_splits
    lo = split * per
    hi = tl.minimum(lo + per, tiles)
    return n1, tiles1, n2, lo, hi


@triton.jit(noinline=True)
def _share_from_lengths_call(p, n_q, s_q, num_programs, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride,
                             ROWS: tl.constexpr, BLOCK_N: tl.constexpr, UNIT: tl.constexpr, HAS_LEN: tl.constexpr,
                             HAS_EXTRA: tl.constexpr, HAS_ELEN: tl.constexpr):
    """:func:`_share_from_lengths` as a call of its own (not inlined): inlined into the ``tl.dot``
    kernel, its vector passes cost its token-tile loop a fifth more instructions and five times
    the spills under Triton 3.6."""
    return _share_from_lengths(p, n_q, s_q, num_programs, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride,
                               tl.arange(0, ROWS), BLOCK_N, UNIT, HAS_LEN, HAS_EXTRA, HAS_ELEN)


@triton.jit
def _share_from_lengths(p, n_q, s_q, num_programs, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride, rows,
                        BLOCK_N: tl.constexpr, UNIT: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr,
                        HAS_ELEN: tl.constexpr):
    """:func:`share_bounds` where the lengths are on the device: the prefix sums of the queries'
    units, ``rows`` (a vector of row offsets) at a time."""
    total = 0
    for base in tl.range(0, n_q, rows.shape[0], num_stages=1):
        q = base + rows
        n1, n2 = query_lengths(q, s_q, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride, q < n_q,
                               HAS_LEN, HAS_EXTRA, HAS_ELEN)
        _t1, _t, u = query_units(n1, n2, BLOCK_N, UNIT)
        total += tl.sum(tl.where(q < n_q, u, 0), 0)
    x0, x1 = share_range(p, total, num_programs, 0)
    q0 = 0
    c0 = 0
    q_end = 0
    c_last = 0
    run = 0
    for base in tl.range(0, n_q, rows.shape[0], num_stages=1):
        q = base + rows
        n1, n2 = query_lengths(q, s_q, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride, q < n_q,
                               HAS_LEN, HAS_EXTRA, HAS_ELEN)
        _t1, _t, u = query_units(n1, n2, BLOCK_N, UNIT)
        u = tl.where(q < n_q, u, 0)
        ends = run + tl.cumsum(u, 0)          # where each query's units end
        starts = ends - u
        done = (q < n_q) & (ends <= x0)       # queries wholly before the share
        begun = (q < n_q) & (starts < x1)     # queries that start before its end
        q0 += tl.sum(done.to(tl.int32), 0)
        c0 = tl.maximum(c0, tl.max(tl.where(done, ends, 0), 0))
        q_end += tl.sum(begun.to(tl.int32), 0)
        c_last = tl.maximum(c_last, tl.max(tl.where(begun, starts, 0), 0))
        run += tl.sum(u, 0)
    n1, n2 = query_lengths(q_end - 1, s_q, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride, q_end > 0,
                           HAS_LEN, HAS_EXTRA, HAS_ELEN)
    _t1, _t, u_last = query_units(n1, n2, BLOCK_N, UNIT)
    return share_owner(c_last + u_last - 1, total, num_programs, 0), x0, x1, q0, c0, q_end, c_last, u_last


@triton.jit
def share_range(p, total, num_programs, share):
    """Units ``[x0, x1)`` of program ``p``'s share (:func:`mla.schedule.share_range`): every
    ``share`` units, or (``share`` 0) balanced over ``num_programs`` programs, or over ``total``
    where that is fewer (no empty share between two others); floor(p*total/n) as
    p*(total//n) + p*(total%n)//n, whose products stay in 32 bits."""
    if share == 0:
        n = tl.minimum(num_programs, total)
        per = total // n
        rest = total - per * n
        x0 = tl.minimum(p * per + p * rest // n, total)
        x1 = tl.minimum((p + 1) * per + (p + 1) * rest // n, total)
    else:
        x0 = p * share
        x1 = tl.minimum(x0 + share, total)
    return x0, x1


@triton.jit
def share_owner(x, total, num_programs, share):
    """The program whose share (:func:`share_range`) holds unit ``x``."""
    if share == 0:
        owner = (((x + 1).to(tl.int64) * tl.minimum(num_programs, total) - 1) // total).to(tl.int32)
    else:
        owner = x // share
    return owner


@triton.jit
def share_bounds(p, n_q, s_q, share, num_programs, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride, rows,
                 BLOCK_N: tl.constexpr, UNIT: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr,
                 HAS_ELEN: tl.constexpr):
    """Program ``p``'s share of the flat work list (:mod:`mla.schedule`): every query row's units
    end to end, cut every ``share`` units (0: into ``num_programs`` balanced shares). Returns
    (the program holding the last unit of its last query, its first unit x0, its end x1, its
    first query q0 and that query's first unit c0, the end of its queries q_end, the first unit
    c_last and the units u_last of its last query).
    With lengths on the device the prefix sums are taken on the device (:func:`_share_from_lengths`,
    ``rows`` query rows at a time: a vector of row offsets in the caller's layout, or None for a
    call of its own of 256); without, every query has the same units."""
    if HAS_LEN or HAS_ELEN:
        if rows is None:
            p_last, x0, x1, q0, c0, q_end, c_last, u_last = _share_from_lengths_call(
                p, n_q, s_q, num_programs, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride, 256, BLOCK_N,
                UNIT, HAS_LEN, HAS_EXTRA, HAS_ELEN)
        else:
            p_last, x0, x1, q0, c0, q_end, c_last, u_last = _share_from_lengths(
                p, n_q, s_q, num_programs, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride, rows, BLOCK_N,
                UNIT, HAS_LEN, HAS_EXTRA, HAS_ELEN)
    else:
        n2 = 0
        if HAS_EXTRA:
            n2 = etopk
        _t1, _t, units = query_units(topk, n2, BLOCK_N, UNIT)
        total = n_q * units
        x0, x1 = share_range(p, total, num_programs, share)
        q0 = x0 // units
        c0 = q0 * units
        q_end = (x1 + units - 1) // units
        c_last = (q_end - 1) * units
        u_last = units
        p_last = share_owner(c_last + u_last - 1, total, num_programs, share)
    q_end = tl.where(x0 < x1, q_end, q0)      # programs past the work: no piece
    return p_last, x0, x1, q0, c0, q_end, c_last, u_last


@triton.jit
def piece(q, c, x0, x1, s_q, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride, BLOCK_N: tl.constexpr,
          UNIT: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_ELEN: tl.constexpr):
    """Query ``q``'s piece in a share of units ``[x0, x1)``, the query's units starting at ``c``:
    its tiles ``[lo, hi)``, whether the query is split (it has units outside the share), and the
    query's tiles of the main cache, valid lengths and units: (lo, hi, split, tiles1, n1, n2,
    units)."""
    n1, n2 = query_lengths(q, s_q, topk, len_ptr, len_stride, etopk, elen_ptr, elen_stride, q >= 0, HAS_LEN,
                           HAS_EXTRA, HAS_ELEN)
    tiles1, tiles, units = query_units(n1, n2, BLOCK_N, UNIT)
    lo = tl.maximum(x0 - c, 0)
    hi = tl.minimum(x1 - c, units)
    return lo * UNIT, tl.minimum(hi * UNIT, tiles), (lo > 0) | (hi < units), tiles1, n1, n2, units


@triton.jit
def write_share_record(rec_ptr, p, p_last, x0, x1, q0, c0, q_end, c_last, u_last, n_q, num_programs):
    """What the combine needs of program ``p``'s share: when its last query starts in it and goes
    on past its end (the one split query whose first piece it holds), (that query, the last
    program holding a piece of it, ``p_last`` of :func:`share_bounds`, the slot of this first
    piece); else (-1, 0, 0). Where there
    are fewer query rows than programs the combine runs a program per query row
    (:func:`mla.kernels.combine.launch_params`): then the share also writes, after the programs'
    records, each query starting in it: the program of its first piece if it is split, else -1."""
    starts_here = (x0 < x1) & (c_last >= x0) & (c_last + u_last > x1)
    q = q_end - 1
    tl.store(rec_ptr + 3 * p, tl.where(starts_here, q, -1))
    tl.store(rec_ptr + 3 * p + 1, tl.where(starts_here, p_last, 0))
    tl.store(rec_ptr + 3 * p + 2, tl.where(starts_here, 2 * p + (q != q0).to(tl.int32), 0))
    if (n_q < num_programs) & (x0 < x1):
        for qs in range(q0 + (c0 < x0).to(tl.int32), q_end):
            tl.store(rec_ptr + 3 * num_programs + qs, tl.where(starts_here & (qs == q), p, -1))


@triton.jit
def query_rows(q, s_q, q_sb, q_ss, idx_sb, idx_ss, eidx_sb, eidx_ss):
    """Offsets, in elements, of query row ``q``'s q block (add the head's stride) and of its index
    rows in the main and the extra cache: strided inputs are read in place."""
    b = (q // s_q).to(tl.int64)
    s = (q % s_q).to(tl.int64)
    return b * q_sb + s * q_ss, b * idx_sb + s * idx_ss, b * eidx_sb + s * eidx_ss


@triton.jit
def load_raw(cache_ptr, row, srow, valid, T0: tl.constexpr, NT: tl.constexpr, V32: tl.constexpr = False):
    """Issue the loads of tiles ``T0 .. T0+NT-1`` of a token tile, without decoding them:
    FP8 bytes ``[BLOCK_N, NT, 64]``, the scales ``[BLOCK_N, NT]`` (MODEL1: UE8M0 bytes; V3.2:
    the float32 of each chunk's 128-value tile) and, when MODEL1's tile 7 is among them, the bf16
    rope ``[BLOCK_N, 1, 64]`` (V3.2's rope is :func:`load_rope`'s). Split from :func:`dequant`
    so that a kernel can issue the next tile's loads before it decodes and multiplies the
    current one."""
    t = T0 + tl.arange(0, NT)
    j = tl.arange(0, 64)
    if V32:
        nb = tl.load(cache_ptr + row[:, None, None] + (t * 64)[None, :, None] + j[None, None, :],
                     mask=valid[:, None, None], other=0)
        scale_ptr = (cache_ptr + srow).to(tl.pointer_type(tl.float32))
        sb = tl.load(scale_ptr[:, None] + (t // (V32_TILE // 64))[None, :], mask=valid[:, None], other=0.0)
        rope = tl.zeros([nb.shape[0], 1, 64], tl.bfloat16)
    else:
        is_nope = t < NOPE_TILES
        nb = tl.load(cache_ptr + row[:, None, None] + (t * 64)[None, :, None] + j[None, None, :],
                     mask=valid[:, None, None] & is_nope[None, :, None], other=0)
        sb = tl.load(cache_ptr + srow[:, None] + t[None, :], mask=valid[:, None] & is_nope[None, :], other=0)
        if T0 + NT > NOPE_TILES:
            rope_ptr = (cache_ptr + row + NOPE).to(tl.pointer_type(tl.bfloat16))
            rope = tl.load(rope_ptr[:, None, None] + j[None, None, :], mask=valid[:, None, None], other=0.0)
        else:
            rope = tl.zeros([nb.shape[0], 1, 64], tl.bfloat16)
    return nb, sb, rope


@triton.jit
def dequant(nb, sb, rope, T0: tl.constexpr, NT: tl.constexpr, FP8_NATIVE: tl.constexpr, OUT: tl.constexpr,
            V32: tl.constexpr = False):
    """FP8 bytes times their scale (exact for the power-of-two scales the layouts hold), and
    MODEL1's rope where its tile 7 is, as ``OUT``."""
    t = T0 + tl.arange(0, NT)
    if V32:
        scale = sb
    else:
        scale = ue8m0_to_f32(sb)
    if FP8_NATIVE:
        v = nb.to(tl.float8e4nv, bitcast=True).to(OUT) * scale[:, :, None].to(OUT)
    else:
        v = (e4m3_to_f32(nb) * scale[:, :, None]).to(OUT)
    if V32:
        pass
    elif T0 + NT > NOPE_TILES:
        v = tl.where((t < NOPE_TILES)[None, :, None], v, rope.to(OUT))
    return v


@triton.jit
def load_token_tile(cache_ptr, row, srow, valid, FP8_NATIVE: tl.constexpr, OUT: tl.constexpr,
                    T0: tl.constexpr = 0, NT: tl.constexpr = 8, V32: tl.constexpr = False):
    """Gather and dequantize tiles ``T0 .. T0+NT-1`` of tokens into ``[BLOCK_N, NT, 64]`` of
    dtype ``OUT`` (MODEL1: tiles 0..6 are nope, tile 7 is rope; V3.2: all 8 are nope, the 512
    columns of V; 8 tiles are the full 512 columns).

    ``cache_ptr`` is the cache as uint8. Masked (invalid) tokens come out as exact zeros,
    whatever their bytes hold (0 * NaN is NaN, so a mask on the probabilities is not enough)."""
    nb, sb, rope = load_raw(cache_ptr, row, srow, valid, T0, NT, V32)
    return dequant(nb, sb, rope, T0, NT, FP8_NATIVE, OUT, V32)


@triton.jit
def load_rope(cache_ptr, row, valid, OUT: tl.constexpr, V32: tl.constexpr = False):
    """The 64 bf16 rope values of each token as ``[BLOCK_N, 64]`` of dtype ``OUT``, zeros where
    invalid: V3.2's second tile, which only Q.K^T reads (MODEL1's rope is tile 7 of
    :func:`load_token_tile`, in V as well)."""
    j = tl.arange(0, ROPE_W)
    rope_ptr = (cache_ptr + row + (V32_ROPE if V32 else NOPE)).to(tl.pointer_type(tl.bfloat16))
    return tl.load(rope_ptr[:, None] + j[None, :], mask=valid[:, None], other=0.0).to(OUT)


@triton.jit
def softmax_step(s, valid, m_i, l_i, sm_scale_log2, TOKEN_AXIS: tl.constexpr):
    """One tile of the online softmax, in the exp2 domain: the scores ``s`` (unscaled, tokens
    along ``TOKEN_AXIS``: 1 for ``[heads, tokens]``, 0 for ``[tokens, heads]``), masked where
    ``valid`` is false, fold into the running max ``m_i`` and sum ``l_i`` of each head. Returns
    (P, the factor that rescales what came before, the new max, the new sum). A head with no
    valid token yet keeps max -inf and sum 0 (its P is 0, not NaN)."""
    s = tl.where(tl.expand_dims(valid, 1 - TOKEN_AXIS), s * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, TOKEN_AXIS))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - tl.expand_dims(m_safe, TOKEN_AXIS))
    return p, alpha, m_new, l_i * alpha + tl.sum(p, TOKEN_AXIS)


@triton.jit
def finish_softmax(l_i, m_i):
    """The end of the online softmax: (empty: no valid token; the sum to divide by, 1 where
    empty; the lse in log2 units)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    return empty, l_safe, m_i + tl.log2(l_safe)


@triton.jit
def sink_factor(sink, lse, empty):
    """The attention sink's factor on the output, ``1 / (1 + exp(sink - lse))`` (natural log;
    the lse of an empty query taken as 0, whose output is zeroed anyway)."""
    return 1.0 / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse)))


def fp8_native(device: torch.device) -> bool:
    """Whether Triton can decode e4m3 natively on this device (sm_89 and newer, not the
    interpreter). sm_80 has no fp8e4nv: the integer decode is used there."""
    if _runtime.INTERPRET or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def cache_args(cache):
    """(uint8 view, page stride in bytes, P, number of tokens) of a cache tensor."""
    nb, p = cache.shape[0], cache.shape[1]
    return cache.view(torch.uint8), cache.stride(0), p, nb * p

