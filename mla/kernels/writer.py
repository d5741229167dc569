"""The cache writer: quantize new bf16 latent rows into their slots of a MODEL1 cache, in place.

One program per row. It reads the row's 512 bf16 values, takes each 64-value nope tile's amax,
its UE8M0 scale and FP8 bytes, and writes the token's 576-byte data row (448 FP8 bytes, then the
64 bf16 rope values as they are) and its 8-byte scale row (7 scale bytes, a zero pad byte) at
slot ``block * P + offset`` of the page. The bytes are those :func:`mla.layout.quantize_kv`
writes: the scale exponent and the FP8 rounding are computed exactly with integer arithmetic
(no division, no log2, no hardware FP8 cast), so every target, the interpreter included,
writes the same bytes. A slot outside the cache is skipped: nothing is written for it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import DATA, NOPE, NOPE_TILES, SROW

#: the floor of a tile's scale exponent: 2**ceil(log2(1e-4)) is 2**-13 (mla.layout.AMAX_FLOOR)
MIN_SCALE_EXP = tl.constexpr(-13)


@triton.jit
def scale_exponent(amax):
    """``ceil(log2(max(amax / 448, 1e-4)))`` for a bf16-valued fp32 ``amax >= 0``, exactly: with
    ``amax = M * 2**E`` (1 <= M < 2), ``amax / 448 = (M / 7) * 2**(E - 6)`` and ``M / 7`` lies in
    [1/7, 2/7), so the ceiling is ``E - 8`` when ``M <= 1.75`` and ``E - 7`` above; the floor of
    1e-4 is ``2**-13``'s exponent."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    k = e - 7 - ((bits & 0x7FFFFF) <= 0x600000).to(tl.int32)
    return tl.maximum(k, MIN_SCALE_EXP)


@triton.jit
def e4m3_from_f32(y):
    """fp32 ``|y| <= 448`` -> its FP8 e4m3fn byte, rounded to nearest even (as torch's cast), with
    integer operations only: normal results keep 3 mantissa bits of the fp32's 23, subnormal
    ones (below 2**-6) are multiples of 2**-9, fp32 subnormals round to zero."""
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    e32 = (bits >> 23) & 0xFF
    full = (bits & 0x7FFFFF) | 0x800000
    # the shift that leaves the kept bits: 20 for a normal e4m3 (exponent field e32 - 120 >= 1),
    # more below, where the kept value is a count of 2**-9
    shift = tl.minimum(tl.maximum(141 - e32, 20), 30)
    q = full >> shift
    rem = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    normal = e32 >= 121
    v = tl.where(normal, ((e32 - 120) << 3) + (q & 7), q) + up.to(tl.int32)
    v = tl.where(e32 == 0, 0, v)
    return (sign | v).to(tl.uint8)


@triton.jit
def _slot_rows(slot_ptr, r, lanes, cache_ptr, page_stride, P, n_tokens):
    """Row ``r``'s slot, loaded once per lane of ``lanes`` (the interpreter needs a mask that is a
    tensor): (in the cache, data row address, scale row address)."""
    slot = tl.load(slot_ptr + r + lanes * 0).to(tl.int64)
    ok = (slot >= 0) & (slot < n_tokens)
    slot = tl.where(ok, slot, 0)
    blk = slot // P
    off = slot - blk * P
    page = cache_ptr + blk * page_stride
    return ok, page + off * DATA, page + P * DATA + off * SROW


@triton.jit
def write_kv_kernel(kv_ptr, kv_row_stride, slot_ptr, cache_ptr, page_stride, P, n_tokens):
    """Row ``program_id(0)`` of ``kv`` into its slot (skipped when outside ``[0, n_tokens)``)."""
    r = tl.program_id(0)
    t = tl.arange(0, 8)
    j = tl.arange(0, 64)
    row = kv_ptr + r.to(tl.int64) * kv_row_stride
    ok, data, srow = _slot_rows(slot_ptr, r, t, cache_ptr, page_stride, P, n_tokens)       # per tile
    col = (t * 64)[:, None] + j[None, :]
    x = tl.load(row + col).to(tl.float32)                                           # [8, 64]
    k = scale_exponent(tl.max(tl.abs(x), 1))                                        # [8]
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)                            # 2**-k
    nope = t < NOPE_TILES
    tl.store(data[:, None] + col, e4m3_from_f32(x * inv[:, None]), mask=(ok & nope)[:, None] & (j < 64)[None, :])
    tl.store(srow + t, tl.where(nope, k + 127, 0).to(tl.uint8), mask=ok)
    ok_j, data_j, _ = _slot_rows(slot_ptr, r, j, cache_ptr, page_stride, P, n_tokens)       # per rope value
    rope = (data_j + NOPE).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope + j, tl.load(row + NOPE + j), mask=ok_j)                           # the bf16 bits as they are


def write_kv(kv, cache_u8, page_stride: int, page_size: int, num_blocks: int, slot_mapping) -> None:
    """Launch the writer: ``kv`` ``[N, 512]`` bf16 (rows contiguous), ``slot_mapping`` ``[N]``,
    into the cache's bytes ``cache_u8`` (its first page's start)."""
    n = kv.shape[0]
    if n:
        write_kv_kernel[(n,)](kv, kv.stride(0), slot_mapping, cache_u8, page_stride, page_size,
                              num_blocks * page_size, num_warps=2)
