"""SIMT and tensor-core kernels against the float64 reference (CPU interpreter here; the GPU too),
and the launch rule on given facts."""
import dataclasses
import functools
import zlib

import pytest
import torch
import triton
import triton.language as tl

import mla
from mla import dispatch
from mla.configs import GLUON_FORMS, GluonConfig, PortableConfig, TlDotConfig
from mla.kernels.common import e4m3_to_f32, ue8m0_to_f32
from mla.validate import make_case, run_case

CASES = {
    "plain": dict(b=2, s_q=1, h_q=4, topk=40, page=16),
    "extra+lengths+empty": dict(b=2, s_q=2, h_q=3, topk=33, page=61, extra_topk=20, extra_page=13, lengths=True,
                                empty_query=True),
    "h1 topk1 P1": dict(b=2, s_q=1, h_q=1, topk=1, page=1, num_blocks=3),
    "h20 odd": dict(b=1, s_q=3, h_q=20, topk=17, page=7, sink=False),
    # DeepSeek-V3.2's cache (q 576 wide, 656-byte tokens)
    "V3.2 plain": dict(b=2, s_q=1, h_q=4, topk=40, page=16, d_qk=576),
    "V3.2 extra+lengths+empty": dict(b=2, s_q=2, h_q=3, topk=33, page=61, extra_topk=20, extra_page=13,
                                     lengths=True, empty_query=True, d_qk=576),
    "V3.2 h1 topk1 P1": dict(b=2, s_q=1, h_q=1, topk=1, page=1, num_blocks=3, d_qk=576),
    "V3.2 h20 odd strided": dict(b=2, s_q=3, h_q=20, topk=17, page=7, sink=False, strided=True, d_qk=576),
}


@pytest.mark.parametrize("impl", ["simt", "mma"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(impl, name, device):
    case = make_case(**CASES[name], device=device, seed=zlib.crc32(name.encode()) % 1000)
    fn = functools.partial(mla.sparse_decode, impl=impl)
    out_ok, lse_ok = run_case(fn, case)
    assert out_ok.ok, str(out_ok)
    assert lse_ok.ok, str(lse_ok)


def forced(config=None, programs=None):
    """``sparse_decode`` with the launch forced: a plan per call with this config and this many
    shares of the work list."""
    def fn(**kw):
        return mla.sparse_decode(**kw, plan=mla.plan(**kw, impl="mma", config=config, programs=programs))
    return fn


@pytest.mark.parametrize("d_qk", [512, 576], ids=["MODEL1", "V3.2"])
@pytest.mark.parametrize("programs", [1, 2, 5])
def test_mma_split_k_combine_matches_reference(programs, d_qk, device):
    case = make_case(b=1, s_q=1, h_q=5, topk=70, page=16, extra_topk=30, extra_page=8, device=device, seed=7,
                     d_qk=d_qk)
    out_ok, lse_ok = run_case(forced(programs=programs), case)
    assert out_ok.ok and lse_ok.ok, f"{out_ok} | {lse_ok}"


def test_mma_combine_merges_many_pieces(device):
    """The combine over 19 pieces a query: three queries of 19 tiles (the interpreter's 16-token
    tiles) on 57 programs, one tile each. Query 0's first 16 pieces hold one valid token each and
    the last 3 all of theirs, so the largest LSEs come last; the first 16 pieces of query 1 have
    no valid token; query 2 has none at all. (This case caught an online merge that forgot to
    rescale what earlier splits had merged.)"""
    case = make_case(b=3, s_q=1, h_q=3, topk=300, page=16, invalid_frac=0.0, device=device, seed=17)
    case["indices"][0, 0, :256][torch.arange(256) % 16 != 0] = -1
    case["indices"][1, 0, :256] = -1
    case["indices"][2, 0, :] = -1
    out_ok, lse_ok = run_case(forced(programs=57), case)
    assert out_ok.ok and lse_ok.ok, f"{out_ok} | {lse_ok}"


def _tl_config(h_q, device, **fields):
    return dataclasses.replace(dispatch.tl_dot_config(torch.device(device), h_q), **fields)


@pytest.mark.parametrize("d_qk", [512, 576], ids=["MODEL1", "V3.2"])
@pytest.mark.parametrize("dv_halves", [1, 2])
def test_mma_output_halves_match_reference(dv_halves, d_qk, device):
    """dv_halves=2 (two programs per head block, 256 output columns each), with and without
    split queries, on a case with both caches, lengths and an empty query."""
    case = make_case(b=2, s_q=2, h_q=20, topk=45, page=13, extra_topk=19, extra_page=7, lengths=True,
                     empty_query=True, device=device, seed=11, d_qk=d_qk)
    cfg = _tl_config(20, device, dv_halves=dv_halves, **({"num_warps": 4} if dv_halves == 2 else {}))
    for programs in (1, 3):
        out_ok, lse_ok = run_case(forced(cfg, programs), case)
        assert out_ok.ok and lse_ok.ok, f"programs={programs}: {out_ok} | {lse_ok}"


def test_mma_with_another_tile_size_matches_reference(device):
    """Another token tile over both caches, with lengths and an empty query, on one program and on
    three (a share's tile range runs from the main cache's last tile into the extra's)."""
    case = make_case(b=2, s_q=1, h_q=6, topk=37, page=11, extra_topk=29, extra_page=5, lengths=True,
                     empty_query=True, device=device, seed=13)
    cfg = _tl_config(6, device, block_n=32)
    for programs in (1, 3):
        out_ok, lse_ok = run_case(forced(cfg, programs), case)
        assert out_ok.ok and lse_ok.ok, f"programs={programs}: {out_ok} | {lse_ok}"


def test_configs_refuse_what_they_do_not_have():
    with pytest.raises(ValueError, match="dv_halves"):
        TlDotConfig(dv_halves=3)
    with pytest.raises(ValueError, match="form must be one of"):
        GluonConfig("tokens as M, 32 x 64")


def test_the_gluon_kernel_is_refused_off_hopper_with_a_clear_error():
    case = make_case(b=1, s_q=1, h_q=4, topk=8, page=8, device="cpu", seed=1)
    with pytest.raises(ValueError, match="sm_90"):
        mla.plan(**case, impl="mma", config=GluonConfig())
    with pytest.raises(ValueError, match="programs"):
        mla.plan(**case, impl="mma", programs=0)
    with pytest.raises(ValueError, match="config"):
        mla.plan(**case, impl="simt", config=TlDotConfig())


def test_another_architectures_code_is_refused_where_it_cannot_run_with_a_clear_error():
    """``isa`` plans run sm_80/sm_89 code on a newer GPU: never under the interpreter, never an
    architecture whose PTX cannot be assembled for an older one, never another kernel or impl."""
    case = make_case(b=1, s_q=1, h_q=4, topk=8, page=8, device="cpu", seed=1)
    with pytest.raises(ValueError, match="isa: another architecture's code runs on a CUDA GPU only"):
        mla.plan(**case, impl="mma", isa=80)
    with pytest.raises(ValueError, match=r"isa: expected one of \(80, 86, 89\)"):
        mla.plan(**case, impl="mma", isa=120)
    with pytest.raises(ValueError, match="isa"):
        mla.plan(**case, impl="reference", isa=80)
    with pytest.raises(ValueError, match="portable Gluon kernel runs on a CUDA GPU"):
        mla.plan(**case, impl="mma", config=PortableConfig())


def test_the_portable_kernels_forms_fit_each_architectures_shared_memory_and_registers():
    """:func:`mla.configs.portable_generic`: per head bucket the largest head block whose
    program fits the architecture's shared memory (the estimate, which the ahead-of-time test
    holds above what the compiler allocates); 64 heads on sm_80, sm_90 and sm_100."""
    from mla import configs

    for arch in (80, 86, 89, 90, 100, 120):
        table = configs.portable_generic(arch)
        for h, cfg in table.items():
            assert configs.portable_shared_bytes(cfg) <= configs.smem_limit(arch) and cfg.block_h <= h
            bigger = [c for c in configs.PORTABLE_FORMS if cfg.block_h < c.block_h <= h]
            assert all(configs.portable_shared_bytes(c) > configs.smem_limit(arch) for c in bigger), (arch, h)
    assert configs.portable_generic(90)[64] == configs.portable_generic(100)[64] == PortableConfig(64, 64, 2)
    assert configs.portable_generic(80)[64] == PortableConfig(64, 32, 3)        # 163 KB
    assert configs.portable_generic(80)[32] == PortableConfig(32, 32, 3)
    assert configs.portable_generic(120)[64] == PortableConfig(16, 32, 2)       # 99 KB
    assert configs.smem_limit(86) == configs.smem_limit(89) == 99 * 1024
    with pytest.raises(ValueError, match="block_h"):
        PortableConfig(block_h=8)


def test_gluon_forms_name_their_heads_and_tiles():
    assert [(GluonConfig(f).block_h, GluonConfig(f).block_n, GluonConfig(f).two_consumers) for f in GLUON_FORMS] == [
        (64, 64, False), (16, 64, False), (8, 128, False), (8, 64, True)]
    assert GluonConfig().label == "Gluon, heads as M"
    assert GluonConfig("tokens as M, 8 x 128").label == "Gluon, tokens as M, 8 x 128"
    assert TlDotConfig(dv_halves=2).label == "tl.dot, split P.V" and TlDotConfig().label == "tl.dot"
    assert TlDotConfig(block_h=64).for_heads(8).block_h == 16 and TlDotConfig(block_h=64).for_heads(20).block_h == 32


def test_the_gluon_kernel_copies_rows_as_wide_as_the_caches_alignment_allows():
    """The ring's cp.async copies are 16 bytes when every cache's page stride is a multiple of
    16 (the padded MODEL1 stride always is; a contiguous cache's, P x 584 bytes, at an even P),
    8 when of 8 (a contiguous cache at an odd P, as `.to(device)` of a padded one gives); a base
    address that is not a multiple of 16 (a view that starts mid-allocation) is not copied at
    all: the launch rule then runs the tl.dot kernel."""
    if dispatch.gluon_sm90 is None:
        pytest.skip("this Triton has no Gluon")
    from mla import layout
    from mla.kernels.common import cache_args

    row_align = dispatch.gluon_sm90.row_align

    def cache(P, offset=0):    # a contiguous cache of 2 pages: stride P x 584
        raw = torch.zeros(2 * P * 584 + 64, dtype=torch.uint8)
        base = (-raw.data_ptr()) % 16 + offset
        return cache_args(raw[base:base + 2 * P * 584].view(2, P, 584))

    def arg(P, offset=0):
        view, stride, _, _ = cache(P, offset)
        return view, stride

    assert row_align(arg(64)) == 16
    padded = layout.quantize_kv(torch.zeros(3, 61, 512, dtype=torch.bfloat16))
    view, stride, _, _ = cache_args(padded)
    assert stride == layout.page_stride(61) and row_align((view, stride)) == 16   # padded, any P
    assert cache_args(padded.to("meta"))[1] == 61 * 584        # .to() drops the padding: an odd stride
    assert row_align(arg(64), arg(256)) == 16
    assert row_align(arg(64), arg(61)) == 8        # 61 x 584: a multiple of 8, not of 16
    assert row_align(arg(61)) == 8
    assert row_align(arg(64, offset=8)) == 0       # a cache view 8 bytes off
    assert row_align(arg(64), arg(61, offset=4)) == 0


def test_the_launch_rule_picks_the_gluon_form_by_heads_and_grid_on_a_hopper_gpu():
    """The launch rule on given facts: on an sm_90 GPU (132 SMs) whose table allows the Gluon
    kernel, every call runs it: heads as M for h_q > 16 on a grid that fills the GPU, tokens as M
    for h_q <= 16 or a small grid (at h_q <= 8, 8 heads x 128 tokens with b * s_q >= 66, else two
    consumers of 8 heads x 64 tokens). Without Gluon (another GPU), the tl.dot kernel, with split
    P.V on a small grid."""
    tl64 = TlDotConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    tl16 = TlDotConfig(block_h=16, block_n=64, num_warps=8)
    hop, t16 = GluonConfig("heads as M"), GluonConfig("tokens as M, 16 x 64")
    t8, pair = GluonConfig("tokens as M, 8 x 128"), GluonConfig("tokens as M, two consumers")

    def pick(b, s_q, h_q, total, gluon=True):
        return dispatch.choose_config((tl16 if h_q <= 16 else tl64).for_heads(h_q), gluon, b, s_q, h_q, total, 132)

    assert pick(1, 1, 64, 2048) == t16              # DSA b 1: 32 one-tile programs
    assert pick(2, 1, 64, 2048) == t16              # 64 <= 132 / 2
    assert pick(3, 1, 64, 2048) == hop              # 96: fills enough
    assert pick(8, 1, 64, 2048) == hop              # DSA b 8: 256 programs
    assert pick(1, 1, 64, 640) == t16               # V4-CSA b 1
    assert pick(32, 1, 64, 640) == hop              # V4-CSA b 32
    assert pick(1, 1, 8, 640) == pair               # V4-TP8 b 1
    assert pick(32, 1, 8, 640) == pair              # V4-TP8 b 32
    assert pick(65, 1, 8, 640) == pair
    assert pick(32, 1, 16, 640) == t16              # 9 to 16 heads: one 16-head block
    assert pick(66, 1, 8, 640) == t8
    assert pick(33, 2, 8, 640) == t8                # s_q counts like b
    assert pick(128, 1, 8, 640) == t8               # V4-TP8 b 128
    assert pick(128, 1, 9, 640) == t16
    assert pick(128, 1, 1, 640) == t8
    assert pick(32, 1, 17, 640) == hop              # heads padded to 64 inside
    assert pick(8, 1, 128, 640) == hop              # 8 x 2 head blocks x 10 tiles
    assert pick(2, 1, 128, 640) == t16              # 40 programs: small
    assert pick(1, 1, 64, 2048, gluon=False) == dispatch.fill_small_grid(tl64, 1, 1, 64, 2048, 132)
    assert pick(1, 1, 64, 2048, gluon=False).dv_halves == 2
    assert pick(8, 1, 64, 2048, gluon=False) == tl64
    assert pick(128, 1, 8, 640, gluon=False) == tl16.for_heads(8)
    assert pick(2, 1, 128, 640, gluon=False).kernel == "tl_dot"


def test_fill_small_grid_splits_head_blocks_only_when_the_grid_is_small():
    h64 = TlDotConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    # DSA (topk 2048 = 32 tiles): 32 or 64 programs at b 1 or 2 fill under half of 132 SMs
    for b in (1, 2):
        got = dispatch.fill_small_grid(h64, b, 1, 64, 2048, 132)
        assert (got.dv_halves, got.num_warps, got.num_stages) == (2, 8, 1), (b, got)
    for b in (3, 8, 128):
        assert dispatch.fill_small_grid(h64, b, 1, 64, 2048, 132) == h64
    # V4-CSA (640 tokens = 10 tiles) up to b = 6; s_q counts like b
    assert dispatch.fill_small_grid(h64, 6, 1, 64, 640, 132).dv_halves == 2
    assert dispatch.fill_small_grid(h64, 7, 1, 64, 640, 132) == h64
    assert dispatch.fill_small_grid(h64, 3, 2, 64, 640, 132).dv_halves == 2
    assert dispatch.fill_small_grid(h64, 4, 2, 64, 640, 132) == h64
    # head blocks below 64 are left alone (measured: no gain at V4-TP8)
    h16 = TlDotConfig(block_h=16, block_n=64, num_warps=8)
    assert dispatch.fill_small_grid(h16, 1, 1, 8, 640, 132) == h16


def test_a_kernel_that_ignores_the_mask_is_caught(device):
    """The harness is not vacuous: dropping the validity mask (all indices treated as in range
    and clamped) changes the answer and is reported."""
    case = make_case(b=1, s_q=1, h_q=2, topk=24, page=8, device=device, seed=3, invalid_frac=0.3)

    def broken(**kw):
        n = kw["k_cache"].shape[0] * kw["k_cache"].shape[1]
        kw = dict(kw, indices=kw["indices"].clamp(0, n - 1))
        return mla.sparse_decode(**kw, impl="simt")

    out_ok, lse_ok = run_case(broken, case)
    assert not (out_ok.ok and lse_ok.ok)


@triton.jit
def _decode_bytes(src, dst_e4m3, dst_ue8m0, N: tl.constexpr):
    i = tl.arange(0, N)
    b = tl.load(src + i)
    tl.store(dst_e4m3 + i, e4m3_to_f32(b))
    tl.store(dst_ue8m0 + i, ue8m0_to_f32(b))


def test_integer_e4m3_decode_matches_torch_on_all_256_bytes(device):
    """The sm_80 path decodes e4m3 with integer operations; check it on every byte value."""
    src = torch.arange(256, dtype=torch.uint8, device=device)
    e4m3 = torch.empty(256, dtype=torch.float32, device=device)
    ue = torch.empty(256, dtype=torch.float32, device=device)
    _decode_bytes[(1,)](src, e4m3, ue, N=256)
    want = src.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(e4m3), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(e4m3[ok], want[ok])
    # UE8M0: 2**(byte-127) for every byte with a normal float32 exponent (1..254)
    e = torch.arange(1, 255, device=device)
    assert torch.equal(ue[1:255], torch.exp2(e.float() - 127))
