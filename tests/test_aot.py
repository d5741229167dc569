"""Ahead-of-time compiles (no GPU needed): every config mla may launch fits its architecture."""
import pytest

from mla import aot


@pytest.fixture(scope="module")
def compiled():
    variants = [v for arch in aot.ARCHS for v in aot.shipped_variants(arch)]
    return aot.report(variants)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_shipped_config_compiles_and_fits_shared_memory(compiled):
    archs = set()
    for r in compiled:
        assert "error" not in r, r
        assert r["shared"] <= aot.SMEM_LIMIT[r["arch"]], r
        assert r["usable"], f"compiled to a trap, not a kernel: {r}"
        assert r["regs"] > 0, r
        assert r["fits"]
        archs.add(r["arch"])
    assert archs == set(aot.ARCHS)


@pytest.mark.slow
def test_a_register_cap_is_honoured_and_its_spills_reported():
    """MMAConfig.maxnreg reaches ptxas: the V4-TP8 config (208 registers, no spills under Triton
    3.6) capped at 128 registers uses at most 128 and spills."""
    from mla.kernels.mma import MMAConfig

    free, capped = aot.report([aot.config_variant(90, MMAConfig(block_h=16, block_n=64, num_warps=8)),
                               aot.config_variant(90, MMAConfig(block_h=16, block_n=64, num_warps=8, maxnreg=128))])
    assert "error" not in free and "error" not in capped, (free, capped)
    assert free["regs"] > 128
    assert 0 < capped["regs"] <= 128 and capped["spill_bytes"] > free["spill_bytes"]


@pytest.mark.slow
def test_a_config_too_big_for_99kb_is_reported_as_not_fitting():
    """The check is not vacuous: two pipeline stages at BLOCK_N 64, h_q 64 need more than
    sm_120's 99 KB (the H200's shipped h_q-64 config would not fit there)."""
    (r,) = aot.report([aot.mma_variant(120, block_h=64, block_n=64, num_warps=8, num_stages=2)])
    assert "error" not in r, r
    assert r["shared"] > aot.SMEM_LIMIT[120]
    assert not r["fits"]


@pytest.mark.slow
def test_a_kernel_lowered_to_a_trap_is_reported_as_not_usable():
    """Triton 3.9 lowers a BLOCK_H 64 program for sm_100 to a lone `trap` (its accumulators do
    not fit tensor memory); the report must not call that a fitting kernel. If a later Triton
    compiles it for real, this test says so and the generic sm_100 table can go back to 64."""
    (r,) = aot.report([aot.mma_variant(100, block_h=64, block_n=64, num_warps=8)])
    assert "error" not in r, r
    assert not r["usable"] and not r["fits"]
