"""The FP8 cache layouts, MODEL1's and V3.2's, byte by byte.

Every expected byte and offset below is worked out by hand (the arithmetic is in the comment
beside it), never computed by the code under test.

e4m3fn, used throughout: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits.
A normal byte ``s eeee mmm`` is ``(-1)**s * (1 + m/8) * 2**(e-7)``; a subnormal (e = 0) is
``(-1)**s * m/8 * 2**-6 = m * 2**-9``; ``0x7F`` / ``0xFF`` are NaN; the largest finite value is
``0 1111 110`` = 0x7E = 1.75 * 2**8 = 448. Conversions round to nearest, ties to even.
"""
import importlib.util
import math
import os
import pathlib
import struct

import pytest
import torch

import mla
from mla import layout
from mla.layout import MODEL1, V32, cache_bytes, dequantize_kv, gather_tokens, quantize_kv


def storage_bytes(cache):
    """Every byte of the cache's storage (including the last page's stride padding)."""
    assert cache.storage_offset() == 0
    return torch.as_strided(cache.view(torch.uint8), (cache.untyped_storage().nbytes(),), (1,), 0)


def e4m3fn_decode(byte: int) -> float:
    """An independent, pure-Python e4m3fn decoder (not torch's)."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    mag = m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


E4M3_LUT = torch.tensor([e4m3fn_decode(b) for b in range(256)], dtype=torch.float64)


def test_e4m3_lut_sanity():
    # The test's own decoder: 0x7E = 0 1111 110 = 1.75 * 2**8 = 448; 0x38 = 0 0111 000 = 1.0;
    # 0x01 = smallest subnormal 2**-9; 0xB8 = -1.0; 0x7F is NaN.
    assert e4m3fn_decode(0x7E) == 448.0
    assert e4m3fn_decode(0x38) == 1.0
    assert e4m3fn_decode(0x01) == 2.0 ** -9
    assert e4m3fn_decode(0xB8) == -1.0
    assert math.isnan(e4m3fn_decode(0x7F))


# --------------------------------------------------------------------------------------------
# Page stride and regions
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lay, p, expected", [
    (MODEL1, 1, 1152),      # 1*584 = 584 > 576 -> 2 rows of 576 = 1152
    (MODEL1, 2, 1728),      # 2*584 = 1168 > 1152 = 2*576 -> 3*576 = 1728
    (MODEL1, 61, 35712),    # 61*584 = 35624 = 61*576 + 488 -> 62*576 = 35712
    (MODEL1, 64, 37440),    # 64*584 = 37376 = 64*576 + 512 -> 65*576 = 37440
    (MODEL1, 72, 42048),    # 72*584 = 42048 = 73*576 exactly: no padding
    (MODEL1, 256, 149760),  # 256*584 = 149504 = 256*576 + 2048; 2048/576 = 3.56 -> 260*576 = 149760
    (V32, 1, 1312),         # V3.2: P + 1 tokens of 656 bytes: 2*656
    (V32, 2, 1968),         # 3*656
    (V32, 61, 40672),       # 62*656
    (V32, 64, 42640),       # 65*656
], ids=lambda v: getattr(v, "name", v))
def test_page_stride(lay, p, expected):
    assert layout.page_stride(p, lay) == expected
    assert lay.page_stride(p) == expected
    if lay is MODEL1:
        assert layout.page_stride(p) == expected and mla.page_stride(p) == expected


@pytest.mark.parametrize("lay", [MODEL1, V32], ids=lambda v: v.name)
def test_page_stride_rejects_zero(lay):
    with pytest.raises(ValueError):
        layout.page_stride(0, lay)


def test_constants():
    # 7 tiles * 64 = 448 fp8 bytes; 64 bf16 rope = 128 bytes; 448 + 128 = 576; + 8 = 584.
    assert (layout.D_NOPE, layout.D_ROPE, layout.D_QK, layout.D_V) == (448, 64, 512, 512)
    assert (layout.TILE, layout.N_TILES) == (64, 7)
    assert (layout.DATA_BYTES, layout.SCALE_BYTES, layout.TOKEN_BYTES) == (576, 8, 584)
    assert (MODEL1.d_qk, MODEL1.d_v, MODEL1.tile, MODEL1.n_tiles, MODEL1.scale_size) == (512, 512, 64, 7, 1)
    assert (MODEL1.token_bytes, MODEL1.rope_at, MODEL1.scales_at) == (584, 448, 576)
    # V3.2: 4 tiles * 128 = 512 fp8 bytes; 4 float32 scales = 16 bytes at 512; 64 bf16 rope = 128 bytes
    # at 512 + 16 = 528; 528 + 128 = 656. q and k are 512 + 64 = 576 wide; V is the 512 nope columns.
    assert (V32.d_nope, V32.d_rope, V32.d_qk, V32.d_v) == (512, 64, 576, 512)
    assert (V32.tile, V32.n_tiles, V32.scale_format, V32.scale_size) == (128, 4, "float32", 4)
    assert (V32.token_bytes, V32.scales_at, V32.rope_at, V32.row_bytes) == (656, 512, 528, 656)


def test_the_last_dim_and_the_head_dim_name_the_layout():
    assert layout.cache_layout(torch.zeros(1, 1, 1, 584, dtype=torch.uint8)) is MODEL1
    assert layout.cache_layout(torch.zeros(1, 1, 1, 656, dtype=torch.uint8)) is V32
    assert layout.layout_for_head_dim(512) is MODEL1 and layout.layout_for_head_dim(576) is V32
    with pytest.raises(ValueError, match="^k_cache:"):
        layout.cache_layout(torch.zeros(1, 1, 1, 576, dtype=torch.uint8))
    with pytest.raises(ValueError, match="^q:"):
        layout.layout_for_head_dim(448)
    with pytest.raises(ValueError, match="^extra_k_cache: 656-byte tokens are the V3.2 layout"):
        layout.check_cache(quantize_kv(torch.zeros(1, 2, 576, dtype=torch.bfloat16)), "extra_k_cache", MODEL1)
    with pytest.raises(ValueError, match="^k_cache: 584-byte tokens are the MODEL1 layout"):
        layout.check_cache(quantize_kv(torch.zeros(1, 2, 512, dtype=torch.bfloat16)), "k_cache", V32)


def test_v32_caches_whose_tokens_are_not_656_bytes_apart_or_misaligned_are_refused():
    """V3.2's tokens are an array of structures: the kernels find token i of a page at i*656, so
    stride(1) must be 656; its float32 scales need 4-byte alignment of the pages."""
    buf = torch.zeros(3 * 2 * 700 + 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="^k_cache: .*stride\\(1\\) = 656, got 700"):
        layout.check_cache(buf.as_strided((3, 2, 1, 656), (1400, 700, 700, 1)))
    with pytest.raises(ValueError, match="^k_cache: .*multiples of 4"):
        layout.check_cache(buf.as_strided((3, 2, 1, 656), (1314, 656, 656, 1)))
    with pytest.raises(ValueError, match="^k_cache: .*multiples of 4"):
        layout.check_cache(buf[2:].as_strided((3, 2, 1, 656), (1312, 656, 656, 1)))
    assert layout.check_cache(buf.as_strided((3, 2, 1, 656), (1312, 656, 656, 1))) is V32


def test_v32_token_regions_cover_656_bytes():
    regs = layout.token_regions(V32)
    assert sum(r.size for r in regs) == 656 and regs[0].start == 0 and regs[-1].end == 656
    for a, b in zip(regs, regs[1:]):
        assert a.end == b.start
    by_name = {r.name: (r.start, r.end) for r in regs}
    assert by_name["nope tile 0"] == (0, 128) and by_name["nope tile 3"] == (384, 512)
    assert by_name["scale 0"] == (512, 516) and by_name["scale 3"] == (524, 528)     # 512 + 3*4
    assert by_name["rope (bf16)"] == (528, 656) and "pad" not in by_name
    # a page: P tokens, then one token's worth of stride padding
    assert [(r.name, r.start, r.end) for r in layout.page_regions(3, V32)] == [
        ("tokens", 0, 1968), ("stride padding", 1968, 2624)]              # 3*656, 4*656
    assert layout.token_offsets(3, 2, V32) == {"nope": 1312, "scales": 1824, "rope": 1840}   # 2*656 (+512, +528)


def test_token_regions_cover_584_bytes():
    regs = layout.token_regions()
    assert sum(r.size for r in regs) == 584
    assert regs[0].start == 0 and regs[-1].end == 584
    for a, b in zip(regs, regs[1:]):
        assert a.end == b.start
    by_name = {r.name: (r.start, r.end) for r in regs}
    assert by_name["nope tile 0"] == (0, 64)
    assert by_name["nope tile 6"] == (384, 448)     # 6*64 = 384, 7*64 = 448
    assert by_name["rope (bf16)"] == (448, 576)     # 448 + 2*64 = 576
    assert by_name["scale 0"] == (576, 577)
    assert by_name["scale 6"] == (582, 583)
    assert by_name["pad"] == (583, 584)


@pytest.mark.parametrize("p, stride, pad", [
    (1, 1152, 568),     # 1152 - 584
    (4, 2880, 544),     # 4*584 = 2336 -> 5*576 = 2880; 2880 - 2336 = 544
    (64, 37440, 64),    # 37440 - 37376
    (72, 42048, 0),
    (256, 149760, 256),  # 149760 - 149504
])
def test_page_regions_cover_the_stride(p, stride, pad):
    regs = layout.page_regions(p)
    assert sum(r.size for r in regs) == stride
    assert regs[0].start == 0 and regs[-1].end == stride
    for a, b in zip(regs, regs[1:]):
        assert a.end == b.start
    by_name = {r.name: r for r in regs}
    assert (by_name["data rows"].start, by_name["data rows"].end) == (0, p * 576)
    assert by_name["scale rows"].size == p * 8
    assert (by_name["stride padding"].size if "stride padding" in by_name else 0) == pad


@pytest.mark.parametrize("p, i, nope, rope, scales", [
    (3, 0, 0, 448, 1728),            # scales at 3*576 = 1728
    (3, 2, 1152, 1600, 1744),        # 2*576 = 1152; +448 = 1600; 1728 + 2*8 = 1744
    (64, 63, 36288, 36736, 37368),   # 63*576 = 36288; +448; 64*576 + 63*8 = 36864 + 504
])
def test_token_offsets(p, i, nope, rope, scales):
    assert layout.token_offsets(p, i) == {"nope": nope, "rope": rope, "scales": scales}


def test_token_offsets_rejects_out_of_page():
    with pytest.raises(ValueError):
        layout.token_offsets(4, 4)
    with pytest.raises(ValueError):
        layout.token_offsets(4, -1)


# --------------------------------------------------------------------------------------------
# quantize_kv: the structure-of-arrays placement, checked on every byte of a small cache
# --------------------------------------------------------------------------------------------

# Token g (g = block*P + offset, 0..5) holds, in tile t, the value 448 * 2**(t-g) at the tile's
# first element, so tile t's scale is 2**(t-g) (amax/448 = 2**(t-g), a power of two) and its
# UE8M0 byte is 127 + t - g; the scaled value 448 encodes as 0x7E. Element 1 of tile 0 holds
# (g+1) * 2**-g, which scales (by 2**-g) to g+1:
MARKER_BYTE = [
    0x38,  # 1 = 1.0  * 2**0 -> 0 0111 000
    0x40,  # 2 = 1.0  * 2**1 -> 0 1000 000
    0x44,  # 3 = 1.5  * 2**1 -> 0 1000 100
    0x48,  # 4 = 1.0  * 2**2 -> 0 1001 000
    0x4A,  # 5 = 1.25 * 2**2 -> 0 1001 010
    0x4C,  # 6 = 1.5  * 2**2 -> 0 1001 100
]
# Rope element 0 of token g is the bf16 g+1, stored little-endian:
ROPE_BYTES = [
    (0x80, 0x3F),  # 1.0 = 0x3F80
    (0x00, 0x40),  # 2.0 = 0x4000
    (0x40, 0x40),  # 3.0 = 0x4040 (exponent 128, mantissa .1)
    (0x80, 0x40),  # 4.0 = 0x4080
    (0xA0, 0x40),  # 5.0 = 0x40A0 (exponent 129, mantissa .01)
    (0xC0, 0x40),  # 6.0 = 0x40C0 (exponent 129, mantissa .1)
]
# With P = 3 the page stride is 2304 (3*584 = 1752 -> 4*576) and the scale rows start at
# 3*576 = 1728. Data row of token (b, i) at b*2304 + i*576, scale row at b*2304 + 1728 + i*8:
DATA_AT = [0, 576, 1152, 2304, 2880, 3456]
SCALE_AT = [1728, 1736, 1744, 4032, 4040, 4048]


def _marked_kv(lay=MODEL1):
    """Six tokens marked as above: the layout's tiles (MODEL1 7 of 64, V3.2 4 of 128), its rope
    after its nope columns."""
    kv = torch.zeros(2, 3, lay.d_qk, dtype=torch.bfloat16)
    for g in range(6):
        b, i = divmod(g, 3)
        for t in range(lay.n_tiles):
            kv[b, i, lay.tile * t] = 448.0 * 2.0 ** (t - g)
        kv[b, i, 1] = (g + 1) * 2.0 ** -g
        kv[b, i, lay.d_nope] = g + 1.0
    return kv


def test_quantize_kv_structure_of_arrays_bytes():
    cache = quantize_kv(_marked_kv())
    assert cache.dtype == torch.float8_e4m3fn
    assert tuple(cache.shape) == (2, 3, 1, 584)
    assert cache.stride() == (2304, 584, 584, 1)
    assert cache.untyped_storage().nbytes() == 2 * 2304

    expected = torch.zeros(2 * 2304, dtype=torch.uint8)
    for g in range(6):
        d, s = DATA_AT[g], SCALE_AT[g]
        for t in range(7):
            expected[d + 64 * t] = 0x7E
            expected[s + t] = 127 + t - g
        expected[d + 1] = MARKER_BYTE[g]
        expected[d + 448], expected[d + 449] = ROPE_BYTES[g]
        # expected[s + 7], the pad byte, stays 0; so do the rows' other bytes and the padding.

    flat = cache_bytes(cache)
    assert flat.numel() == 2304 + 1752          # cache_bytes ends at the last scale row
    assert torch.equal(flat, expected[: 2304 + 1752])
    assert torch.equal(storage_bytes(cache), expected)   # incl. stride padding [1752, 2304) etc.


def test_quantize_kv_accepts_one_head_dim():
    kv = _marked_kv()
    assert torch.equal(storage_bytes(quantize_kv(kv[:, :, None])), storage_bytes(quantize_kv(kv)))


# --------------------------------------------------------------------------------------------
# quantize_kv: crafted tiles (one token, P = 1: data row at 0, scale row at 576)
# --------------------------------------------------------------------------------------------

def _one_token(values_by_dim):
    kv = torch.zeros(1, 1, 512, dtype=torch.bfloat16)
    for dim, v in values_by_dim.items():
        kv[0, 0, dim] = v
    cache = quantize_kv(kv)
    flat = storage_bytes(cache)
    assert flat.numel() == 1152
    return flat


CRAFTED = {
    # tile 0 (dims 0..63): amax 448 -> 448/448 = 1 = 2**0 -> scale 1, UE8M0 byte 127.
    0: 448.0,          # 448 = 1.75 * 2**8 -> 0 1111 110 = 0x7E
    1: -448.0,         # sign bit: 0x80 | 0x7E = 0xFE
    2: 1.0,            # 0 0111 000 = 0x38
    3: -1.0,           # 0xB8
    4: 1.0625,         # halfway 1.0 (m=000) / 1.125 (m=001): ties to even -> 0x38
    5: 1.1875,         # halfway 1.125 (001) / 1.25 (010): ties to even -> 010 -> 0x3A
    6: 2.0 ** -9,      # smallest subnormal, m = 001 -> 0x01
    7: 3 * 2.0 ** -10,  # 1.5 * 2**-9: halfway 001 / 010 -> even -> 0x02
    8: 2.0 ** -10,     # halfway 0 / 2**-9 -> even -> 0x00
    # tile 1 (64..127): amax 450 (bf16-exact; 449 is not: it rounds to 448 in bf16).
    # 450/448 > 1 -> ceil(log2) = 1 -> scale 2, byte 128.
    64: 450.0,         # 225 -> nearest e4m3 in [128, 256) (step 16) is 224 = 1.75*2**7 -> 0 1110 110 = 0x76
    65: 2.0,           # 1.0 -> 0x38
    # tile 2 (128..191): amax 896 -> 896/448 = 2 -> scale 2, byte 128.
    128: 896.0,        # 448 -> 0x7E
    129: -3.0,         # -1.5 = -(1 + 4/8) * 2**0 -> 1 0111 100 = 0xBC
    # tile 3 (192..255): all zero -> max(0, 1e-4) -> log2(1e-4) = -13.29 -> ceil -13 -> byte 114.
    # tile 4 (256..319): amax 1.0 -> 1/448 = 2**-8.81 -> ceil -8 -> scale 2**-8, byte 119.
    256: 1.0,          # 1/2**-8 = 256 = 2**8 -> 0 1111 000 = 0x78
    257: 0.5,          # 128 = 2**7 -> 0 1110 000 = 0x70
    258: -0.25,        # -64 = -2**6 -> 1 1101 000 = 0xE8
    # tile 5 (320..383): amax 3.0 -> 3/448 = 2**-7.22 -> ceil -7 -> scale 2**-7, byte 120.
    320: 3.0,          # 384 = 1.5 * 2**8 -> 0 1111 100 = 0x7C
    321: 1.0,          # 128 -> 0x70
    # tile 6 (384..447): amax 2**-12 -> 2**-12/448 < 1e-4 -> floor -> scale 2**-13, byte 114.
    384: 2.0 ** -12,   # 2**-12 / 2**-13 = 2 -> 0 1000 000 = 0x40
    385: 2.0 ** -20,   # 2**-7 = 4 * 2**-9, subnormal m = 100 -> 0x04
    # rope (448..511), bf16 little-endian, not quantized:
    448: 1.0,          # 0x3F80 -> 0x80, 0x3F
    449: -2.0,         # 0xC000 -> 0x00, 0xC0
    450: 1.0 / 3.0,    # fp32 0x3EAAAAAB -> bf16 round-to-nearest 0x3EAB -> 0xAB, 0x3E
    451: 1000.0,       # 1.953125 * 2**9: exp 136 = 0x88, mantissa 1111010 -> 0x447A -> 0x7A, 0x44
}

CRAFTED_NOPE_BYTES = {0: 0x7E, 1: 0xFE, 2: 0x38, 3: 0xB8, 4: 0x38, 5: 0x3A, 6: 0x01, 7: 0x02, 8: 0x00,
                      64: 0x76, 65: 0x38, 128: 0x7E, 129: 0xBC, 256: 0x78, 257: 0x70, 258: 0xE8,
                      320: 0x7C, 321: 0x70, 384: 0x40, 385: 0x04}
CRAFTED_ROPE_BYTES = [0x80, 0x3F, 0x00, 0xC0, 0xAB, 0x3E, 0x7A, 0x44]   # bytes 448..455
CRAFTED_SCALES = [127, 128, 128, 114, 119, 120, 114]


def test_crafted_tiles_every_byte():
    flat = _one_token(CRAFTED)
    expected = torch.zeros(1152, dtype=torch.uint8)
    for at, byte in CRAFTED_NOPE_BYTES.items():
        expected[at] = byte
    expected[448:456] = torch.tensor(CRAFTED_ROPE_BYTES, dtype=torch.uint8)
    expected[576:583] = torch.tensor(CRAFTED_SCALES, dtype=torch.uint8)
    # expected[583] (pad) and [584, 1152) (stride padding) stay 0.
    assert torch.equal(flat, expected)


def test_crafted_tiles_dequantize_to_hand_values():
    kv = torch.zeros(1, 1, 512, dtype=torch.bfloat16)
    for dim, v in CRAFTED.items():
        kv[0, 0, dim] = v
    deq = dequantize_kv(quantize_kv(kv))[0, 0].double()
    # value = fp8 value * scale, worked out above:
    want = torch.zeros(512, dtype=torch.float64)
    want[[0, 1, 2, 3, 4, 5, 6, 7, 8]] = torch.tensor(
        [448, -448, 1, -1, 1.0, 1.25, 2.0 ** -9, 2.0 ** -8, 0], dtype=torch.float64)
    want[64], want[65] = 224 * 2, 1.0 * 2        # 448 (450 lost 2), 2
    want[128], want[129] = 448 * 2, -1.5 * 2
    want[256], want[257], want[258] = 1.0, 0.5, -0.25
    want[320], want[321] = 3.0, 1.0
    want[384], want[385] = 2.0 ** -12, 2.0 ** -20
    want[448], want[449], want[451] = 1.0, -2.0, 1000.0
    want[450] = 0.333984375                      # bf16 0x3EAB = (1 + 43/128) * 2**-2 = 171/512
    assert torch.equal(deq, want)


def test_ue8m0_decode():
    # byte e -> 2**(e - 127)
    got = layout.ue8m0_decode(torch.tensor([127, 128, 114, 119, 0, 254], dtype=torch.uint8))
    want = torch.tensor([1.0, 2.0, 2.0 ** -13, 2.0 ** -8, 2.0 ** -127, 2.0 ** 127], dtype=torch.float32)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# Dequantization: exact, and the round-trip error of FP8
# --------------------------------------------------------------------------------------------

def _random_kv(nb, p, seed=0, width=512):
    g = torch.Generator().manual_seed(seed)
    # Per-tile magnitudes spread over 2**-4 .. 2**4, random signs: every scaled value is normal
    # (its ratio to the tile's amax is >= 2**-8, so scaled >= 224 * 2**-8 > 2**-6).
    mag = torch.exp2(torch.rand(nb, p, width, generator=g) * 8 - 4)
    sign = torch.where(torch.rand(nb, p, width, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).to(torch.bfloat16)


def test_dequantize_is_exact_and_requantization_is_stable():
    kv = _random_kv(3, 5)
    cache = quantize_kv(kv)
    deq = dequantize_kv(cache)
    assert deq.dtype == torch.bfloat16 and tuple(deq.shape) == (3, 5, 512)
    # Dequantized values are a fixed point of quantize -> dequantize.
    requant = quantize_kv(deq)
    assert torch.equal(dequantize_kv(requant), deq)

    # Decode the raw bytes independently. P = 5: 5*584 = 2920 = 5*576 + 40 -> page stride
    # 6*576 = 3456; data rows at i*576, scale rows at 5*576 + i*8 = 2880 + i*8.
    assert cache.stride(0) == 3456
    raw = storage_bytes(cache).view(3, 3456)
    data = raw[:, : 5 * 576].reshape(3, 5, 576)
    exps = raw[:, 2880: 2880 + 5 * 8].reshape(3, 5, 8)[..., :7]
    nope = E4M3_LUT[data[..., :448].long()].view(3, 5, 7, 64)
    nope = nope * torch.exp2(exps.double() - 127)[..., None]
    assert torch.equal(deq[..., :448].double(), nope.view(3, 5, 448))
    # rope is stored verbatim
    assert torch.equal(deq[..., 448:], kv[..., 448:])
    assert torch.equal(data[..., 448:].contiguous().view(torch.bfloat16), kv[..., 448:])

    # Re-quantizing gives the same bytes, except in a tile whose largest scaled value rounded
    # DOWN to 224 (e.g. 225..231 -> 224; [128, 256) has step 16): its dequantized amax is then
    # 224 * s = 448 * (s/2), so the re-quantized scale is s/2 (UE8M0 byte one lower) and the
    # values are re-encoded one binade up. Same values, different bytes. Seed 0 hits such tiles.
    raw2 = storage_bytes(requant).view(3, 3456)
    exps2 = raw2[:, 2880: 2880 + 5 * 8].reshape(3, 5, 8)[..., :7]
    tile_amax = E4M3_LUT[data[..., :448].long()].view(3, 5, 7, 64).abs().amax(-1)
    moved = tile_amax == 224
    assert 0 < int(moved.sum()) < moved.numel()
    assert torch.equal(exps2.int(), exps.int() - moved.int())
    data2 = raw2[:, : 5 * 576].reshape(3, 5, 576)
    assert torch.equal(data2[..., :448].reshape(3, 5, 7, 64)[~moved],
                       data[..., :448].reshape(3, 5, 7, 64)[~moved])
    assert torch.equal(E4M3_LUT[data2[..., :448].reshape(3, 5, 7, 64)[moved].long()],
                       2 * E4M3_LUT[data[..., :448].reshape(3, 5, 7, 64)[moved].long()])
    assert torch.equal(data2[..., 448:], data[..., 448:])


def test_requantize_of_a_rounded_down_amax_moves_the_scale():
    # 450 -> scale 2 (byte 128), 450/2 = 225 -> 224 (0x76); dequantized: 448.
    # Re-quantized: 448/448 = 1 -> scale 1 (byte 127), 448 -> 0x7E. Same value 448, new bytes.
    first = _one_token({0: 450.0})
    assert (int(first[0]), int(first[576])) == (0x76, 128)
    deq = dequantize_kv(quantize_kv(torch.tensor([[[450.0] + [0.0] * 511]], dtype=torch.bfloat16)))
    assert float(deq[0, 0, 0]) == 448.0
    second = storage_bytes(quantize_kv(deq))
    assert (int(second[0]), int(second[576])) == (0x7E, 127)
    # A tile whose scaled amax does not round down to 224 re-quantizes to identical bytes:
    again = storage_bytes(quantize_kv(dequantize_kv(quantize_kv(deq))))
    assert torch.equal(again, second)


@pytest.mark.parametrize("width, nope", [(512, 448), (576, 512)], ids=["MODEL1", "V3.2"])
def test_round_trip_relative_error_within_e4m3_bound(width, nope):
    kv = _random_kv(2, 8, seed=1, width=width)
    deq = dequantize_kv(quantize_kv(kv))
    assert torch.equal(deq[..., nope:], kv[..., nope:])          # rope verbatim
    rel = ((deq.double() - kv.double()).abs() / kv.double().abs())[..., :nope]
    # 3 mantissa bits, round to nearest: |err| <= 2**-4 * 2**floor(log2|x|) <= 2**-4 * |x|.
    assert rel.max().item() <= 2.0 ** -4
    assert rel.max().item() > 2.0 ** -6      # it is a real 3-bit quantizer, not the identity


@pytest.mark.parametrize("width, stride", [(512, 2304), (576, 2624)], ids=["MODEL1", "V3.2"])
def test_uint8_view_is_accepted(width, stride):
    kv = _random_kv(2, 3, seed=2, width=width)
    cache = quantize_kv(kv)
    u8 = cache.view(torch.uint8)
    assert u8.stride(0) == stride    # MODEL1 3*584 = 1752 -> 4*576; V3.2 (3+1)*656
    assert torch.equal(dequantize_kv(u8), dequantize_kv(cache))


@pytest.mark.parametrize("width, p, stride", [(512, 1, 1152), (512, 2, 1728), (512, 61, 35712), (512, 64, 37440),
                                              (576, 1, 1312), (576, 61, 40672), (576, 64, 42640)])
def test_stride0_is_the_padded_page_stride(width, p, stride):
    cache = quantize_kv(torch.zeros(2, p, width, dtype=torch.bfloat16))
    assert cache.stride(0) == stride
    assert cache.untyped_storage().nbytes() == 2 * stride


@pytest.mark.parametrize("lay, shape, strides", [
    (MODEL1, (3, 4, 1, 584), (2880, 584, 584, 1)),     # 4*584 = 2336 -> 5*576 = 2880
    (V32, (3, 4, 1, 656), (3280, 656, 656, 1)),        # (4+1)*656
], ids=lambda v: getattr(v, "name", None))
def test_empty_cache_strides_and_fill(lay, shape, strides):
    c = layout.empty_cache(3, 4, fill=0x7F, layout=lay)
    assert c.dtype == torch.float8_e4m3fn and tuple(c.shape) == shape
    assert c.stride() == strides
    assert c.untyped_storage().nbytes() == 3 * strides[0]
    assert bool((storage_bytes(c) == 0x7F).all())


# --------------------------------------------------------------------------------------------
# gather_tokens reads only the tokens it is asked for
# --------------------------------------------------------------------------------------------

def test_gather_tokens_reads_only_indexed_tokens():
    nb, p = 3, 4                        # page stride 2880 (4*584 = 2336 -> 5*576)
    kv = _random_kv(nb, p, seed=3)
    cache = quantize_kv(kv)
    want = dequantize_kv(cache).view(nb * p, 512)
    keep = [5, 10]                      # (block 1, offset 1), (block 2, offset 2)
    raw = storage_bytes(cache)
    saved = {}
    for g, (data_at, scale_at) in zip(keep, [(2880 + 576, 2880 + 2304 + 8),
                                            (5760 + 1152, 5760 + 2304 + 16)]):
        saved[g] = (data_at, raw[data_at: data_at + 576].clone(), scale_at, raw[scale_at: scale_at + 8].clone())
    raw.fill_(0x7F)                     # fp8 NaN everywhere, padding included
    for data_at, d, scale_at, s in saved.values():
        raw[data_at: data_at + 576] = d
        raw[scale_at: scale_at + 8] = s

    got = gather_tokens(cache, torch.tensor([[5, 10], [10, 5]], dtype=torch.int32))
    assert got.shape == (2, 2, 512)
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got[0, 0], want[5]) and torch.equal(got[0, 1], want[10])
    assert torch.equal(got[1, 0], want[10]) and torch.equal(got[1, 1], want[5])
    # ... and the poison is real: any other token decodes to NaN.
    assert bool(torch.isnan(gather_tokens(cache, torch.tensor([4]))[0, :448]).all())


# --------------------------------------------------------------------------------------------
# V3.2: the array-of-structures layout, every byte worked out by hand
# --------------------------------------------------------------------------------------------

def f32_bytes(x: float) -> list[int]:
    """A float32's four bytes, little-endian (the test's own encoder: Python's struct)."""
    return list(struct.pack("<f", x))


V32_CRAFTED = {
    # tile 0 (dims 0..127, one tile of 128: dim 64 is in it too): amax 448 -> scale 1.0
    0: 448.0,          # 0x7E
    64: 2.0,           # 0 1000 000 = 0x40
    127: -1.0,         # 0xB8
    # tile 1 (128..255): amax 450 -> 450/448 > 1 -> scale 2
    128: 450.0,        # 225 -> 224 = 1.75 * 2**7 -> 0 1110 110 = 0x76
    200: 3.0,          # 1.5 -> 0 0111 100 = 0x3C
    # tile 2 (256..383): all zero -> max(0, 1e-4) -> scale 2**-13
    # tile 3 (384..511): amax 1.0 -> 1/448 = 2**-8.81 -> ceil -8 -> scale 2**-8
    384: 1.0,          # 256 = 2**8 -> 0 1111 000 = 0x78
    511: -0.25,        # -64 = -2**6 -> 1 1101 000 = 0xE8
    # rope (512..575), bf16 little-endian at byte 528 + 2*(dim - 512):
    512: 1.0,          # 0x3F80
    513: -2.0,         # 0xC000
    575: 1000.0,       # 0x447A
}
V32_CRAFTED_NOPE_BYTES = {0: 0x7E, 64: 0x40, 127: 0xB8, 128: 0x76, 200: 0x3C, 384: 0x78, 511: 0xE8}
# the scales as float32 at 512, 516, 520, 524: 1.0 = 0x3F800000, 2.0 = 0x40000000,
# 2**-13 = (127-13) << 23 = 0x39000000, 2**-8 = (127-8) << 23 = 0x3B800000, little-endian:
V32_CRAFTED_SCALE_BYTES = [0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0x40,
                           0x00, 0x00, 0x00, 0x39, 0x00, 0x00, 0x80, 0x3B]
V32_CRAFTED_ROPE_BYTES = {528: 0x80, 529: 0x3F, 530: 0x00, 531: 0xC0, 654: 0x7A, 655: 0x44}


def test_v32_crafted_token_every_byte():
    kv = torch.zeros(1, 1, 576, dtype=torch.bfloat16)
    for dim, v in V32_CRAFTED.items():
        kv[0, 0, dim] = v
    cache = quantize_kv(kv)
    assert tuple(cache.shape) == (1, 1, 1, 656) and cache.stride() == (1312, 656, 656, 1)
    flat = storage_bytes(cache)
    assert flat.numel() == 1312                   # one page of P = 1: (1+1)*656
    expected = torch.zeros(1312, dtype=torch.uint8)
    for at, byte in {**V32_CRAFTED_NOPE_BYTES, **V32_CRAFTED_ROPE_BYTES}.items():
        expected[at] = byte
    expected[512:528] = torch.tensor(V32_CRAFTED_SCALE_BYTES, dtype=torch.uint8)
    assert V32_CRAFTED_SCALE_BYTES == f32_bytes(1.0) + f32_bytes(2.0) + f32_bytes(2.0 ** -13) + f32_bytes(2.0 ** -8)
    assert torch.equal(flat, expected)            # [656, 1312), the page's spare token, stays 0

    deq = dequantize_kv(cache)[0, 0].double()
    assert deq.shape == (576,)
    want = torch.zeros(576, dtype=torch.float64)
    want[[0, 64, 127, 128, 200, 384, 511]] = torch.tensor([448, 2, -1, 448, 3, 1, -0.25], dtype=torch.float64)
    want[[512, 513, 575]] = torch.tensor([1.0, -2.0, 1000.0], dtype=torch.float64)
    assert torch.equal(deq, want)


def test_v32_tokens_are_an_array_of_structures():
    """Token g = block*3 + i of a P = 3 cache (page stride (3+1)*656 = 2624) lies at
    block*2624 + i*656: its tile t holds 448 * 2**(t-g) at its first element (scale 2**(t-g),
    a float32 at 512 + 4t), element 1 the marker (g+1) * 2**-g, rope element 0 g+1."""
    kv = _marked_kv(V32)
    assert kv.shape == (2, 3, 576) and float(kv[0, 1, 128]) == 448.0 * 2.0 ** (1 - 1) and float(kv[1, 0, 512]) == 4.0
    cache = quantize_kv(kv)
    expected = torch.zeros(2 * 2624, dtype=torch.uint8)
    for g in range(6):
        at = (g // 3) * 2624 + (g % 3) * 656
        for t in range(4):
            expected[at + 128 * t] = 0x7E
            expected[at + 512 + 4 * t: at + 516 + 4 * t] = torch.tensor(f32_bytes(2.0 ** (t - g)), dtype=torch.uint8)
        expected[at + 1] = MARKER_BYTE[g]
        expected[at + 528], expected[at + 529] = ROPE_BYTES[g]
    assert torch.equal(storage_bytes(cache), expected)
    assert cache_bytes(cache).numel() == 2624 + 3 * 656      # to the end of the last page's last token


def test_v32_dequantize_is_exact():
    kv = _random_kv(3, 5, seed=4, width=576)
    cache = quantize_kv(kv)
    deq = dequantize_kv(cache)
    assert deq.dtype == torch.bfloat16 and tuple(deq.shape) == (3, 5, 576)
    # decode the raw bytes independently: token i of page b at b*3936 + i*656 ((5+1)*656 = 3936)
    raw = storage_bytes(cache).view(3, 3936)[:, :5 * 656].reshape(3, 5, 656)
    scales = torch.tensor(struct.unpack("<60f", bytes(raw[..., 512:528].flatten().tolist())),
                          dtype=torch.float64).view(3, 5, 4)
    assert bool((torch.log2(scales) == torch.log2(scales).round()).all())       # powers of two
    nope = E4M3_LUT[raw[..., :512].long()].view(3, 5, 4, 128) * scales[..., None]
    assert torch.equal(deq[..., :512].double(), nope.view(3, 5, 512))
    assert torch.equal(deq[..., 512:], kv[..., 512:])
    assert torch.equal(dequantize_kv(quantize_kv(deq)), deq)                      # a fixed point


def test_v32_gather_tokens_reads_only_indexed_tokens():
    nb, p = 3, 4                        # page stride (4+1)*656 = 3280
    cache = quantize_kv(_random_kv(nb, p, seed=5, width=576))
    want = dequantize_kv(cache).view(nb * p, 576)
    raw = storage_bytes(cache)
    keep = {5: 3280 + 656, 10: 2 * 3280 + 2 * 656}       # (block 1, offset 1), (block 2, offset 2)
    saved = {g: raw[at: at + 656].clone() for g, at in keep.items()}
    raw.fill_(0x7F)
    for g, at in keep.items():
        raw[at: at + 656] = saved[g]
    got = gather_tokens(cache, torch.tensor([[5, 10], [10, 5]], dtype=torch.int32))
    assert got.shape == (2, 2, 576) and bool(torch.isfinite(got).all())
    assert torch.equal(got[0, 0], want[5]) and torch.equal(got[0, 1], want[10]) and torch.equal(got[1, 0], want[10])
    assert bool(torch.isnan(gather_tokens(cache, torch.tensor([4]))[0, :512]).all())


# --------------------------------------------------------------------------------------------
# Against FlashMLA's own quantizer (tests/quant.py of a FlashMLA checkout): run where
# FLASHMLA_SRC names one, skipped elsewhere. Nothing of FlashMLA is part of this repository.
# --------------------------------------------------------------------------------------------

def _flashmla_quant():
    src = os.environ.get("FLASHMLA_SRC")
    path = pathlib.Path(src or ".") / "tests" / "quant.py"
    if not src or not path.is_file():
        pytest.skip("set FLASHMLA_SRC to a FlashMLA checkout (its tests/quant.py) to compare with it")
    spec = importlib.util.spec_from_file_location("flashmla_quant", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("width", [512, 576], ids=["MODEL1", "V3.2"])
@pytest.mark.parametrize("p", [1, 2, 61, 64])
def test_quantize_kv_writes_flashmlas_bytes(width, p):
    """mla.quantize_kv and FlashMLA's quantize_k_cache give the same tensor (shape, strides) and
    the same bytes in every token, on latents spread over 24 binades (and an all-zero token); the
    two dequantize alike. FlashMLA leaves what is not a token's unwritten (torch.empty): MODEL1's
    pad byte, the stride padding, V3.2's spare token of a page; mla zeroes them."""
    quant = _flashmla_quant()
    kind = quant.FP8KVCacheLayout.MODEL1_FP8Sparse if width == 512 else quant.FP8KVCacheLayout.V32_FP8Sparse
    g = torch.Generator().manual_seed(p)
    kv = (torch.randn(3, p, 1, width, generator=g)
          * torch.exp2(torch.randint(-12, 12, (3, p, 1, 1), generator=g).float())).bfloat16()
    kv[0, 0] = 0
    theirs, ours = quant.quantize_k_cache(kv, kind), quantize_kv(kv)
    assert theirs.shape == ours.shape and theirs.stride() == ours.stride() and theirs.dtype == ours.dtype
    tokens = torch.arange(3 * p)
    a, b = layout.token_bytes(ours, tokens), layout.token_bytes(theirs, tokens)
    if width == 512:
        a, b = a[..., :583], b[..., :583]             # all but the pad byte
    assert torch.equal(a, b)
    assert torch.equal(quant.dequantize_k_cache(theirs, kind)[:, :, 0], dequantize_kv(ours))
