"""bf16 rounding on the CPU interpreter: the kernels round to nearest even, as they do on a GPU.

Triton's interpreter casts fp32 -> bf16 by dropping the low 16 bits. The kernels' bf16 stores
go through :func:`mla.kernels.common.to_bf16`, which rounds explicitly there.
"""
import functools

import pytest
import torch
import triton
import triton.language as tl

import mla
import mla.validate as mv
from mla.kernels.common import to_bf16

pytestmark = pytest.mark.skipif(not mla.INTERPRET, reason="the interpreter's rounding; a GPU casts in hardware")


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(y_ptr + i, to_bf16(tl.load(x_ptr + i, mask=m)), mask=m)


def _rounded(bits: torch.Tensor) -> torch.Tensor:
    x = bits.to(torch.int32).view(torch.float32)
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y


def _same_as_torch(bits: torch.Tensor) -> torch.Tensor:
    """Per element: the kernel's bf16 equals torch's round-to-nearest-even cast, bit for bit
    (any NaN matches any NaN)."""
    y = _rounded(bits)
    ref = bits.to(torch.int32).view(torch.float32).bfloat16()
    return (y.view(torch.int16) == ref.view(torch.int16)) | (y.isnan() & ref.isnan())


CRAFTED = {
    "tie, even below: 1 + 2**-8 -> 1": 0x3F808000,
    "tie, odd below: rounds up to even": 0x3F818000,
    "just below a tie": 0x3F807FFF,
    "just above a tie": 0x3F808001,
    "negative tie, odd below": 0xBF818000,
    "largest bf16": 0x7F7F0000,
    "largest bf16 plus less than half": 0x7F7F7FFF,
    "halfway past the largest bf16 -> inf": 0x7F7F8000,
    "largest fp32 -> inf": 0x7F7FFFFF,
    "most negative fp32 -> -inf": 0xFF7FFFFF,
    "+inf": 0x7F800000,
    "-inf": 0xFF800000,
    "quiet NaN": 0x7FC00000,
    "NaN whose payload is only in the low bits": 0x7F800001,
    "negative NaN": 0xFFC00123,
    "smallest subnormal": 0x00000001,
    "subnormal tie, even below": 0x00008000,
    "subnormal tie, odd below": 0x00018000,
    "largest subnormal -> smallest normal bf16": 0x807FFFFF,
    "+0": 0x00000000,
    "-0": 0x80000000,
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_to_bf16_rounds_crafted_bit_patterns_to_nearest_even(name):
    bits = torch.tensor([CRAFTED[name]], dtype=torch.int64)
    assert bool(_same_as_torch(bits).all()), (name, hex(CRAFTED[name]), _rounded(bits).view(torch.int16).item())


def test_to_bf16_keeps_nan_and_inf():
    y = _rounded(torch.tensor([0x7FC00000, 0x7F800001, 0xFF800000, 0x7F800000], dtype=torch.int64))
    assert y[:2].isnan().all() and y[2] == float("-inf") and y[3] == float("inf")


def test_to_bf16_matches_torch_on_random_bit_patterns():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2 ** 32, (1 << 15,), generator=g, dtype=torch.int64)
    assert bool(_same_as_torch(bits).all())


def _mean_case(seed: int, n_valid: int = 3):
    """q = 0 and every index valid, so that each output is the plain mean of ``n_valid`` tokens'
    values. Returns the case and that mean rounded to nearest even: float64 sums the values
    exactly, and a quotient by 3 has no ties, so the rounding has one right answer."""
    case = mv.make_case(b=2, s_q=2, h_q=4, topk=n_valid, page=16, sink=False, invalid_frac=0.0, seed=seed)
    case["q"] = torch.zeros_like(case["q"])
    kv = mla.dequantize_kv(case["k_cache"]).reshape(-1, 512).double()
    mean = kv[case["indices"].long()].sum(2) / n_valid                       # [b, s_q, 512]
    return case, mean[:, :, None, :].expand(-1, -1, 4, -1).to(torch.bfloat16)


@pytest.mark.parametrize("impl", ["mma", "simt"])
def test_the_kernels_round_their_outputs_to_nearest(impl):
    """Every output element equals the exact mean rounded to nearest even. Before the kernels
    rounded themselves, about 6 in 10 did (the interpreter's cast rounds toward zero)."""
    for seed in (1, 2):
        case, want = _mean_case(seed)
        out, _ = mla.sparse_decode(**case, impl=impl)
        share = float((out == want).float().mean())
        assert share == 1.0, (impl, seed, share)


@pytest.mark.parametrize("impl", ["mma", "simt"])
def test_the_kernels_pass_flashmlas_cosine_check(impl):
    """FlashMLA's cosine bound on out (5e-6): a bias toward zero puts it near 8e-6."""
    row = mv.check(functools.partial(mla.sparse_decode, impl=impl), mv.quick_cases()[0])
    assert row["ok"] and abs(row["out_cos"]) <= mv.OUT_COS and abs(row["lse_cos"]) <= mv.LSE_COS, row
