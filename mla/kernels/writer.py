"""The cache writer: quantize new bf16 latent rows into their slots of a cache, in place.

One program per row. It reads the row, takes each nope tile's amax, its power-of-two scale and
FP8 bytes, and writes the token's bytes at slot ``block * P + offset`` of the page. MODEL1: the
512 values as 8 lanes of 64 (7 nope tiles and the rope's place), the 576-byte data row (448 FP8
bytes, then the 64 bf16 rope values as they are) and the 8-byte scale row (7 UE8M0 bytes, a
zero pad byte). V3.2 (``V32``): the 576 values as 4 nope tiles of 128 and the rope, the
656-byte token (512 FP8 bytes, the 4 scales as float32, the rope). The bytes are those
:func:`mla.layout.quantize_kv` writes: the scale exponent and the FP8 rounding are computed
exactly with integer arithmetic (no division, no log2, no hardware FP8 cast), so every target,
the interpreter included, writes the same bytes. A slot outside the cache is skipped: nothing
is written for it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import NOPE, NOPE_TILES, ROPE_W, V32_ROPE, V32_TILE, V32_TILES, token_rows

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
def write_kv_kernel(kv_ptr, kv_row_stride, slot_ptr, cache_ptr, page_stride, P, n_tokens, V32: tl.constexpr = False):
    """Row ``program_id(0)`` of ``kv`` into its slot (skipped when outside ``[0, n_tokens)``)."""
    r = tl.program_id(0)
    LANES: tl.constexpr = V32_TILES if V32 else NOPE_TILES + 1      # a lane per tile (MODEL1: and the rope's)
    WIDTH: tl.constexpr = V32_TILE if V32 else 64
    D_NOPE: tl.constexpr = V32_TILES * V32_TILE if V32 else NOPE
    t = tl.arange(0, LANES)
    j = tl.arange(0, WIDTH)
    row = kv_ptr + r.to(tl.int64) * kv_row_stride
    # the row's slot, loaded once per lane (the interpreter needs a mask that is a tensor)
    ok, data, srow = token_rows(slot_ptr + r, t * 0, 1, n_tokens, P, page_stride, V32)
    col = (t * WIDTH)[:, None] + j[None, :]
    x = tl.load(row + col).to(tl.float32)                                           # [lanes, width]
    k = scale_exponent(tl.max(tl.abs(x), 1))                                        # [lanes]
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)                            # 2**-k
    nope = t < (V32_TILES if V32 else NOPE_TILES)
    tl.store(cache_ptr + data[:, None] + col, e4m3_from_f32(x * inv[:, None]),
             mask=(ok & nope)[:, None] & (j < WIDTH)[None, :])
    if V32:                                                                         # 2**k as a float32
        tl.store((cache_ptr + srow + 4 * t).to(tl.pointer_type(tl.int32)), (k + 127) << 23, mask=ok)
    else:                                                                           # its UE8M0 byte, a zero pad
        tl.store(cache_ptr + srow + t, tl.where(nope, k + 127, 0).to(tl.uint8), mask=ok)
    c = tl.arange(0, ROPE_W)
    ok_c, data_c, _ = token_rows(slot_ptr + r, c * 0, 1, n_tokens, P, page_stride, V32)   # per rope value
    rope = (cache_ptr + data_c + (V32_ROPE if V32 else NOPE)).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope + c, tl.load(row + D_NOPE + c), mask=ok_c)                      # the bf16 bits as they are


def write_kv(kv, cache_u8, page_stride: int, page_size: int, num_blocks: int, slot_mapping, v32: bool = False) -> None:
    """Launch the writer: ``kv`` ``[N, 512]`` (MODEL1) or ``[N, 576]`` (``v32``) bf16 (rows
    contiguous), ``slot_mapping`` ``[N]``, into the cache's bytes ``cache_u8`` (its first page's
    start)."""
    n = kv.shape[0]
    if n:
        write_kv_kernel[(n,)](kv, kv.stride(0), slot_mapping, cache_u8, page_stride, page_size,
                              num_blocks * page_size, V32=v32, num_warps=2)
