"""Ahead-of-time compiles (no GPU needed): every config mla may launch fits its architecture."""
import collections
import dataclasses
import re

import pytest
import triton

from mla import aot, configs, dispatch
from mla.configs import GLUON_FORMS, GluonConfig, PortableConfig, TlDotConfig


@pytest.fixture(scope="module")
def compiled():
    variants = [v for arch in aot.ARCHS for v in aot.shipped_variants(arch)]
    for v in variants:
        v["loops"] = v["arch"] != 90          # the other architectures' token-tile loops, from their SASS
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
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("arch", [a for a in aot.ARCHS if a != 90])
def test_the_other_architectures_run_their_loop_on_the_tensor_cores_without_spills(compiled, arch):
    """sm_80, sm_89, sm_100 and sm_120 get the generic table, derived from their limits
    (:func:`mla.configs.generic`): each shipped config's token-tile loop issues tensor-core
    instructions and keeps every value in registers (no local-memory load or store in it), and
    its accumulator share is within the architecture's limit. Under Triton 3.6 (the GPU image's)
    the 32-head configs of sm_89, sm_100 and sm_120 load a few spilled values a tile and store
    none (results/h200/runs/tl_dot_prefetch_aot.json); from 3.9 on nothing spills."""
    rows = [r for r in compiled if r["arch"] == arch]
    assert len(rows) == len(aot.shipped_tl_dot_configs(arch)) > 0
    for cfg, r in zip(aot.shipped_tl_dot_configs(arch), rows):
        assert "error" not in r and r["fits"] and r["usable"], r
        (loop,) = r["loops"]
        assert loop["tensor_core"] > 0, (cfg, loop)
        if triton.__version__.startswith("3.6.") and cfg.block_h == 32:
            assert loop["spill_loads"] <= 32 and loop["spill_stores"] == 0, (cfg, loop)
        else:
            assert loop["spill_loads"] == 0 and loop["spill_stores"] == 0, (cfg, loop)
        assert configs.accumulator_regs(cfg) <= configs.ACCUMULATOR_REGS[arch], cfg


@pytest.fixture(scope="module")
def compiled_v32():
    """The V3.2 form of every shipped tl.dot config on every architecture, beside its MODEL1 form,
    with their token-tile loops."""
    variants = [dict(v, loops=True) for arch in aot.ARCHS for v32 in (True, False)
                for v in aot.shipped_variants(arch, v32=v32) if v["kernel"] == "tl_dot_decode_kernel"]
    return aot.report(variants)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_v32_form_of_every_shipped_tl_dot_config_compiles_and_fits_shared_memory(compiled_v32):
    """DeepSeek-V3.2's calls run the tl.dot kernel with the configs MODEL1's would get on a GPU
    without Gluon (:func:`mla.dispatch.decide`): in its V3.2 form each compiles for sm_80, 89, 90,
    100 and 120 to a usable kernel inside the architecture's shared memory, with one token-tile
    loop on the tensor cores that issues more tensor-core instructions than the MODEL1 form's (the
    third dot, of the 64 rope columns). (Under Triton 3.9 that loop spills a few registers a tile
    on every architecture, where MODEL1's spills on sm_90's 32- and 64-head configs only.)"""
    v32 = [r for r in compiled_v32 if r["constexprs"].get("V32")]
    model1 = {(r["arch"], r["num_warps"], r["num_stages"], r["constexprs"]["BLOCK_H"], r["constexprs"]["DV_HALVES"]): r
              for r in compiled_v32 if not r["constexprs"].get("V32")}
    assert {r["arch"] for r in v32} == set(aot.ARCHS)
    assert len(v32) == sum(len(aot.shipped_tl_dot_configs(a)) for a in aot.ARCHS) == len(model1)
    for r in v32:
        assert "error" not in r, r
        assert r["usable"] and r["fits"] and r["regs"] > 0, r
        assert r["shared"] <= aot.SMEM_LIMIT[r["arch"]], r
        (loop,) = r["loops"]
        twin = model1[(r["arch"], r["num_warps"], r["num_stages"], r["constexprs"]["BLOCK_H"],
                       r["constexprs"]["DV_HALVES"])]
        assert loop["tensor_core"] > twin["loops"][0]["tensor_core"] > 0, (r, twin)


def test_the_gluon_kernel_has_a_v32_form_in_heads_as_m_only():
    """The V3.2 variants ``mla`` may launch on sm_90 (mla.dispatch.GLUON_LAYOUTS): the tl.dot
    configs' and the Gluon kernel's heads-as-M form, each with ``V32`` set; the MODEL1 variants
    are spelled as before (no ``V32``), and a V3.2 variant of another Gluon form is refused."""
    v32 = aot.shipped_variants(90, v32=True)
    assert all(v["constexprs"]["V32"] is True for v in v32)
    (gluon,) = [v for v in v32 if v["kernel"] == "gluon_decode_kernel"]
    assert gluon["constexprs"]["HEADS"] == 64 and gluon["constexprs"]["TWO_CONSUMERS"] == 0
    assert all("V32" not in v["constexprs"] for v in aot.shipped_variants(90))     # MODEL1's spelled as before
    for form in GLUON_FORMS:
        if form != "heads as M":
            with pytest.raises(ValueError, match=r"^v32: the Gluon kernel reads V3.2's cache in the forms"):
                aot.config_variant(90, GluonConfig(form), v32=True)
    with pytest.raises(ValueError, match="^v32: the portable Gluon kernel reads the MODEL1 cache only"):
        aot.config_variant(90, PortableConfig(), v32=True)


@pytest.mark.slow
def test_the_v32_gluon_form_reads_its_rope_in_place_within_shared_memory_without_spills():
    """V3.2's heads-as-M form (576-wide Q and K, V the 512 nope columns): Q's 64 rope columns in
    their own 8 KB of bf16, the ring stage's rope read in place as S's second B operand, the tile
    buffer [64, 512] as MODEL1's. Per warp and tile: MODEL1's 32 + 4 wgmma, plus 64/16 = 4 of
    N = 32 on bf16 operands (the rope's part of S). The plan is 226 KB, under sm_90's 227; the
    loop does not spill; every copy of the ring is a 16-byte cp.async (LDGSTS.128)."""
    ours, model1 = aot.report([aot.gluon_variant(loops=True, asm=("ptx", "sass"), v32=True),
                               aot.gluon_variant(loops=True)])
    assert "error" not in ours and "error" not in model1, (ours, model1)
    assert ours["fits"] and model1["shared"] + 8 * 1024 < ours["shared"] <= aot.SMEM_LIMIT[90], ours["shared"]
    (loop,) = ours["loops"]
    assert loop["tensor_core"] == 32 + 4 + 4 == model1["loops"][0]["tensor_core"] + 4, loop
    assert loop["spill_loads"] == 0 and loop["spill_stores"] == 0, loop
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n32k16\.f32\.bf16\.bf16", ours["ptx"])) == 4
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^\]]*\], \[[^\]]*\], (0x\w+)", ours["ptx"])
    assert copies and set(copies) == {"0x10"}, collections.Counter(copies)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_prefill_configs_compile_and_fit_with_their_loop_in_registers():
    """The sparse prefill's config of each architecture (:data:`mla.configs.PREFILL`), at d_qk 512
    and 576: inside the shared memory, a kernel (not a trap), its token-tile loop on the tensor
    cores. sm_90 (64 heads x 64 tokens: the accumulator is 128 registers a thread, and the
    gathered tile passes through registers to be converted to fp16) stores and reloads a few
    spilled values a tile, under Triton 3.9 4 at d_qk 512 and 5 at 576 of some 1300-1500
    instructions; every other variant none."""
    variants = [v for arch in aot.ARCHS for v in aot.shipped_prefill_variants(arch)]
    for v, r in zip(variants, aot.report(variants)):
        assert "error" not in r and r["fits"] and r["usable"], r
        (loop,) = r["loops"]
        bound = 8 if r["arch"] == 90 else 0
        assert loop["tensor_core"] > 0 and loop["spill_stores"] <= bound and loop["spill_loads"] <= bound, r


def test_the_generic_tables_follow_the_register_rule():
    """The rule, not a copy of the H200's table: the largest head block per bucket whose
    accumulator share fits the architecture, the whole 512 columns before half of them."""
    for arch in (80, 89, 100, 120):
        table = configs.generic(arch)
        for h, cfg in table.items():
            assert configs.accumulator_regs(cfg) <= configs.ACCUMULATOR_REGS[arch] and cfg.block_h <= h
            bigger = dataclasses.replace(cfg, block_h=2 * cfg.block_h) if cfg.block_h < min(h, 64) else None
            assert bigger is None or configs.accumulator_regs(dataclasses.replace(bigger, dv_halves=2)) \
                > configs.ACCUMULATOR_REGS[arch]
    assert configs.generic(80)[64] == TlDotConfig(block_h=16, dv_halves=2)
    assert configs.generic(120)[64] == TlDotConfig(block_h=32, dv_halves=2)
    assert configs.generic(90)[64] == TlDotConfig(block_h=64)


@pytest.mark.slow
def test_a_register_cap_is_honoured_and_its_spills_reported():
    """A register cap reaches ptxas: the h_q-16 config, which takes more than 128 registers
    free, capped at 128 uses at most 128, and spills no less than it did."""
    free, capped = aot.report([aot.tl_dot_variant(90, block_h=16, block_n=64, num_warps=8),
                               aot.tl_dot_variant(90, block_h=16, block_n=64, num_warps=8, maxnreg=128)])
    assert "error" not in free and "error" not in capped, (free, capped)
    assert free["regs"] > 128
    assert 0 < capped["regs"] <= 128 and capped["spill_bytes"] >= free["spill_bytes"]


@pytest.mark.slow
def test_the_small_grid_form_keeps_its_loop_in_registers_on_sm_90():
    """The form the launch rule runs on small grids of sm_90 (:func:`mla.dispatch.fill_small_grid`:
    two programs a 64-head block, each with 256 of the output columns) at the 8 warps it ships
    with: its token-tile loop has no local-memory traffic under Triton 3.6 (the H200's record)
    and at most a tenth of the 4-warp form's elsewhere. At 4 warps, its form before v34, Q and
    the 256 accumulator columns do not fit one warpgroup's registers and the loop spills."""
    shipped = dispatch.fill_small_grid(configs.generic(90)[64], 1, 1, 64, 2048, sms=132)
    assert shipped.dv_halves == 2 and shipped.num_warps == 8
    eight, four = aot.report([aot.config_variant(90, shipped, loops=True),
                              aot.config_variant(90, dataclasses.replace(shipped, num_warps=4), loops=True)])
    assert "error" not in eight and "error" not in four, (eight, four)
    (loop8,), (loop4,) = eight["loops"], four["loops"]
    spills8, spills4 = (lp["spill_loads"] + lp["spill_stores"] for lp in (loop8, loop4))
    assert loop8["tensor_core"] > 0 and spills4 >= 20 and 10 * spills8 <= spills4, (loop8, loop4)
    if triton.__version__.startswith("3.6."):
        assert spills8 == 0, loop8


@pytest.mark.slow
def test_both_caches_run_through_one_tensor_core_loop():
    """The decode kernel has one token-tile loop whatever the caches: with an extra cache the
    SASS holds one loop with tensor-core instructions, as with the main cache alone (two loops,
    one per cache, spilled ten times more in the second: the version log's v11)."""
    cfg = TlDotConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    both, one = aot.report([aot.config_variant(90, cfg, loops=True),
                            aot.config_variant(90, cfg, loops=True, has_extra=False)])
    assert "error" not in both and "error" not in one, (both, one)
    assert len(both["loops"]) == 1 and len(one["loops"]) == 1, (both["loops"], one["loops"])
    loop = both["loops"][0]
    assert loop["tensor_core"] > 0 and loop["instructions"] > loop["tensor_core"]
    # the loop body is the same code with one cache or two, give or take the per-tile selects
    assert abs(loop["instructions"] - one["loops"][0]["instructions"]) < 0.1 * loop["instructions"]


@pytest.mark.slow
def test_the_gluon_kernel_computes_s_once_in_one_loop_without_spills():
    """The sm_90 Gluon kernel (mla.kernels.gluon_sm90): one token-tile loop in its consumer
    partition, no spill traffic in it, and 36 wgmma instructions per warp per tile: S = Q.K^T
    as 512/16 = 32 instructions of N = BLOCK_N/2 (each warpgroup computes its half of the tile's
    columns) and P.V as 64/16 = 4 instructions of N = 256 (its half of the output). The tl.dot
    kernel issues 72, both warpgroups computing all of S. The variant for page strides that are
    multiples of 8 only (a contiguous cache at an odd page size; rows copied 8 bytes at a time)
    builds too."""
    gl_cfg, tl_cfg = GluonConfig(), TlDotConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    ours, theirs, odd = aot.report([aot.config_variant(90, gl_cfg, loops=True, asm=("sass",)),
                                    aot.config_variant(90, tl_cfg, loops=True),
                                    aot.gluon_variant(align=8, loops=True, asm=("sass",))])
    assert "error" not in ours and "error" not in theirs and "error" not in odd, (ours, theirs, odd)
    assert ours["fits"] and ours["shared"] <= aot.SMEM_LIMIT[90]
    for r in (ours, odd):
        (loop,) = r["loops"]
        assert loop["tensor_core"] == 32 + 4, loop
        assert loop["spill_loads"] == 0 and loop["spill_stores"] == 0, loop
    assert theirs["loops"][0]["tensor_core"] > ours["loops"][0]["tensor_core"], theirs["loops"]
    # the ring's cp.async copies (LDGSTS): 16 bytes wide at ALIGN 16, never wider than 8 at ALIGN 8
    wide = re.compile(r"LDGSTS\S*\.128")
    assert len(wide.findall(ours["sass"])) >= 16 and not wide.findall(odd["sass"])
    assert "LDGSTS" in odd["sass"]


@pytest.mark.slow
def test_the_gluon_kernels_tokens_as_m_variants_build_without_spills():
    """The few-heads variants (h_q <= 16), tokens as the M of both dots: per warp and tile,
    S^T = K.Q^T as 512/16 = 32 wgmma of N = 8 and O^T += V^T.P^T as (512/128 rows per warp) x
    (tile/16) wgmma: 4 x 4 = 16 at 16 heads x 64 tokens, 4 x 8 = 32 at 8 heads x 128 tokens
    (each warpgroup computes S^T for its 64 tokens, so the tile is read once for S). Both fit the
    H200's shared memory (the 128-token tile buffer with two 64-token ring stages) and their
    token-tile loops do not spill."""
    t16, t8 = aot.report([aot.gluon_variant("tokens as M, 16 x 64", loops=True),
                          aot.gluon_variant("tokens as M, 8 x 128", loops=True)])
    for r, wgmma in ((t16, 32 + 16), (t8, 32 + 32)):
        assert "error" not in r, r
        assert r["fits"] and r["shared"] <= aot.SMEM_LIMIT[90], r
        (loop,) = r["loops"]
        assert loop["tensor_core"] == wgmma, loop
        assert loop["spill_loads"] == 0 and loop["spill_stores"] == 0, loop
    assert t8["shared"] > 200 * 1024      # the 128-token fp16 tile buffer alone is 128 KB


@pytest.mark.slow
def test_the_gluon_kernels_two_consumer_variant_builds_within_the_h200s_shared_memory():
    """The two-consumer form (8 heads, two warpgroups on alternate 64-token tiles, each with its
    own 64 KB tile buffer): each consumer's loop issues, per tile, S^T as 8 groups x 4 wgmma of
    K = 16 (A from registers) and O^T as (512/64 rows) x 4 = 32 wgmma; both loops are in the SASS
    (one per consumer partition). Shared memory: Q 8 KB, two tile buffers, two P and two ring
    stages, within the H200's 227 KB. Neither loop spills at the consumers' 216 registers (at
    232 each spilled 2 registers a tile under Triton 3.6)."""
    (r,) = aot.report([aot.gluon_variant("tokens as M, two consumers", loops=True)])
    assert "error" not in r, r
    assert r["fits"] and 200 * 1024 < r["shared"] <= aot.SMEM_LIMIT[90], r
    assert r["num_warps"] == 4
    assert len(r["loops"]) == 2, r["loops"]
    for loop in r["loops"]:
        assert loop["tensor_core"] == 32 + 32, loop
        assert loop["spill_loads"] == 0 and loop["spill_stores"] == 0, loop


def test_sass_loops_finds_backward_branches_with_tensor_core_work():
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x32x16.F32 R24, R0, gdesc[UR4], R24 ;
        /*0020*/                   LDL R2, [R1] ;
        /*0030*/                   STL [R1+0x4], R3 ;
        /*0034*/                   STAS.128 [R5+URZ], R8 ;
        /*0038*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*003c*/                   UCGABAR_ARV ;
        /*003e*/                   UCGABAR_WAIT ;
        /*0040*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0050*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0060*/               @P1 BRA `(.L_x_2) ;
        /*0070*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*0080*/                   EXIT ;
"""
    assert aot.sass_loops(sass) == [{"instructions": 8, "tensor_core": 1, "spill_loads": 1, "spill_stores": 1,
                                     "cta_barriers": 1, "cluster_barriers": 1, "cluster_stores": 1}]


def test_sass_loops_leaves_out_a_branch_back_over_a_whole_loop():
    """A warp-specialized kernel's mbarrier spin-wait sits out of line and branches back over
    the whole partition: only the innermost loop is the token-tile loop."""
    sass = """
.L_x_1:
        /*0000*/                   IADD3 R4, R4, 0x1, RZ ;
.L_x_2:
        /*0010*/                   HGMMA.64x32x16.F32 R24, R0, gdesc[UR4], R24 ;
        /*0020*/               @P0 BRA `(.L_x_2) ;
        /*0030*/                   EXIT ;
.L_x_3:
        /*0040*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR4], R3 ;
        /*0050*/              @!P2 BRA `(.L_x_1) ;
"""
    assert aot.sass_loops(sass) == [{"instructions": 2, "tensor_core": 1, "spill_loads": 0, "spill_stores": 0,
                                     "cta_barriers": 0, "cluster_barriers": 0, "cluster_stores": 0}]


@pytest.mark.slow
def test_a_config_too_big_for_99kb_is_reported_as_not_fitting():
    """The check is not vacuous: two pipeline stages at BLOCK_N 64, h_q 64 need more than
    sm_120's 99 KB (the H200's shipped h_q-64 config would not fit there)."""
    (r,) = aot.report([aot.tl_dot_variant(120, block_h=64, block_n=64, num_warps=8, num_stages=2)])
    assert "error" not in r, r
    assert r["shared"] > aot.SMEM_LIMIT[120]
    assert not r["fits"]


@pytest.mark.slow
def test_a_kernel_lowered_to_a_trap_is_reported_as_not_usable():
    """Triton 3.9 lowers a BLOCK_H 64 program for sm_100 to a lone `trap` (its accumulators do
    not fit tensor memory); the report must not call that a fitting kernel. If a later Triton
    compiles it for real, this test says so and the generic sm_100 table can go back to 64."""
    (r,) = aot.report([aot.tl_dot_variant(100, block_h=64, block_n=64, num_warps=8)])
    assert "error" not in r, r
    assert not r["usable"] and not r["fits"]


@pytest.mark.slow
def test_the_group_major_ring_changes_addresses_only():
    """The FP8 ring stored group-major (the Gluon kernel's GROUP_MAJOR) is a shared-memory layout
    order only: the heads-as-M form compiles to the same copies and loads (16-byte cp.async and
    16-byte shared loads, as many of each) and about the same loop as with the token-major ring
    (its address arithmetic differs). The launch ships it for the one-consumer forms and keeps
    token-major for the two-consumer form, which was slower with it on the H200."""
    if dispatch.gluon_sm90 is None:
        pytest.skip("this Triton has no Gluon")
    launch_options = dispatch.gluon_sm90.launch_options
    assert launch_options(64, 64, False)["GROUP_MAJOR"] == 1 and launch_options(8, 64, True)["GROUP_MAJOR"] == 0
    group = aot.gluon_variant(loops=True, asm=("sass",))
    token = {**group, "constexprs": {**group["constexprs"], "GROUP_MAJOR": 0}}
    g, t = aot.report([group, token])
    assert "error" not in g and "error" not in t, (g, t)

    def accesses(sass):
        return {op: len(re.findall(op + r"\s", sass)) for op in (r"LDGSTS\S*\.128", r"LDS\.128", r"LDSM\S*")}

    assert accesses(g["sass"]) == accesses(t["sass"]), (accesses(g["sass"]), accesses(t["sass"]))
    assert accesses(g["sass"])[r"LDGSTS\S*\.128"] >= 16
    (lg,), (lt,) = g["loops"], t["loops"]
    assert lg["tensor_core"] == lt["tensor_core"] and abs(lg["instructions"] / lt["instructions"] - 1) < 0.05, (lg, lt)


@pytest.mark.slow
@pytest.mark.parametrize("isa", [80, 89])
def test_an_older_architectures_code_assembles_for_hopper_as_it_is(isa):
    """What ``isa=80`` / ``isa=89`` plans run on a Hopper card (:mod:`mla.kernels.cross_arch`): the
    PTX Triton writes for sm_80 or sm_89, assembled for sm_90a. Its token-tile loop keeps that
    architecture's tensor-core instruction (``mma.sync``, HMMA in SASS), not Hopper's wgmma."""
    import os
    import subprocess
    import tempfile

    from mla.kernels import cross_arch

    cfgs = aot.shipped_tl_dot_configs(isa)
    got = aot.report([aot.config_variant(isa, c, asm=("ptx",)) for c in cfgs])
    for c, r in zip(cfgs, got):
        assert "error" not in r, r
        assert cross_arch.ptx_target(r["ptx"]) == f"sm_{isa}"
        cubin = cross_arch.assemble(r["ptx"], 90)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            nvdisasm = os.path.join(os.path.dirname(cross_arch._ptxas(90)), "nvdisasm")
            sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
        loops = aot.sass_loops(sass)
        assert loops, c
        assert "HGMMA" not in sass and "HMMA" in sass, c


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_portable_gluon_kernel_keeps_tiles_in_flight_on_every_architecture():
    """The portable Gluon kernel's forms (:func:`mla.configs.portable_generic`) compile for every
    architecture inside its shared memory; the token-tile loop runs on the tensor cores
    (``mma.sync``: HMMA), keeps ``stages - 1`` tiles' copies in flight across its wait
    (``cp.async.wait_group`` as ``DEPBAR.LE SB0, stages - 1``), and spills nothing in it on any
    architecture, the 64-head forms' 128 accumulator registers a thread included."""
    variants, forms = [], []
    for arch in aot.ARCHS:
        for cfg in sorted(set(configs.portable_generic(arch).values()), key=lambda c: c.block_h):
            variants.append(aot.portable_variant(arch, cfg, asm=("ptx",)))
            forms.append((arch, cfg))
    for (arch, cfg), r in zip(forms, aot.report(variants)):
        assert "error" not in r, (arch, cfg, r)
        assert r["fits"] and r["shared"] <= configs.portable_shared_bytes(cfg) <= aot.SMEM_LIMIT[arch], (arch, cfg, r)
        _regs, _spill, sass = aot._ptxas_usage(r["ptx"], arch, want_sass=True)
        loops = aot.sass_loops(sass)
        assert len(loops) == 1 and loops[0]["tensor_core"] > 0, (arch, cfg, loops)
        assert "HGMMA" not in sass and f"DEPBAR.LE SB0, 0x{cfg.stages - 1}" in sass, (arch, cfg)
        assert loops[0]["spill_loads"] == loops[0]["spill_stores"] == 0, (arch, cfg, loops)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(dispatch.gluon_cluster is None,
                    reason=f"the cluster form needs Triton 3.9's Gluon; this is {triton.__version__}")
def test_the_cluster_form_compiles_for_sm90a_and_exchanges_each_tile_once():
    """The Gluon kernel's 128-head 2-CTA cluster form (mla.kernels.gluon_sm90.cluster) fits sm_90's
    shared memory, spills nothing in its token-tile loop, and exchanges each tile as designed: per
    tile and thread 16 st.async of 16 bytes (its half tile, 32 tokens x 512 fp16 over 256
    threads, into both CTAs: 2 x 32 KB / 256 = 256 bytes), one cluster barrier, no loads from the
    peer's shared memory; a transaction barrier of 64 KB a CTA; S and P.V as in the 64-head form
    (32 + 4 wgmma a warp)."""
    r = aot.report([aot.cluster_variant(asm=("ptx",), loops=True)])[0]
    assert "error" not in r, r
    assert r["fits"] and r["shared"] <= aot.SMEM_LIMIT[90], r
    (loop,) = r["loops"]
    assert loop["spill_loads"] == loop["spill_stores"] == 0, loop
    assert loop["tensor_core"] == 32 + 4, loop
    assert loop["cluster_stores"] == 2 * 32 * 512 * 2 // 256 // 16 and loop["cluster_barriers"] == 1, loop
    ptx = r["ptx"]
    assert "ld.shared::cluster" not in ptx
    assert re.findall(r"expect_tx\.shared::cta\.b64\s+_,\s*\[[^]]+\],\s*(\d+)", ptx) == [str(64 * 512 * 2)]
