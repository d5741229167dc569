"""SIMT and MMA kernels against the float64 reference (CPU interpreter here; the GPU too)."""
import dataclasses
import functools
import zlib

import pytest
import torch
import triton
import triton.language as tl

import mla
from mla.kernels.common import e4m3_to_f32, ue8m0_to_f32
from mla.kernels.mma import MMAConfig, fill_small_grid, mma_sparse_decode
from mla.validate import make_case, run_case

CASES = {
    "plain": dict(b=2, s_q=1, h_q=4, topk=40, page=16),
    "extra+lengths+empty": dict(b=2, s_q=2, h_q=3, topk=33, page=61, extra_topk=20, extra_page=13, lengths=True,
                                empty_query=True),
    "h1 topk1 P1": dict(b=2, s_q=1, h_q=1, topk=1, page=1, num_blocks=3),
    "h20 odd": dict(b=1, s_q=3, h_q=20, topk=17, page=7, sink=False),
}


@pytest.mark.parametrize("impl", ["simt", "mma"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(impl, name, device):
    case = make_case(**CASES[name], device=device, seed=zlib.crc32(name.encode()) % 1000)
    fn = functools.partial(mla.sparse_decode, impl=impl)
    out_ok, lse_ok = run_case(fn, case)
    assert out_ok.ok, str(out_ok)
    assert lse_ok.ok, str(lse_ok)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_mma_split_k_combine_matches_reference(splits, device):
    case = make_case(b=1, s_q=1, h_q=5, topk=70, page=16, extra_topk=30, extra_page=8, device=device, seed=7)
    fn = functools.partial(mma_sparse_decode, splits=splits)
    out_ok, lse_ok = run_case(fn, case)
    assert out_ok.ok and lse_ok.ok, f"{out_ok} | {lse_ok}"


def test_mma_combine_merges_many_splits(device):
    """The combine over 19 splits. On the interpreter's 16-token tiles: batch 0's first 16 splits
    hold one valid token each and the last 3 all of theirs, so the largest LSEs come last; the
    first 16 splits of batch 1 have no valid token; batch 2's query has none at all. (This case
    caught an online merge that forgot to rescale what earlier splits had merged.)"""
    case = make_case(b=3, s_q=1, h_q=3, topk=300, page=16, invalid_frac=0.0, device=device, seed=17)
    case["indices"][0, 0, :256][torch.arange(256) % 16 != 0] = -1
    case["indices"][1, 0, :256] = -1
    case["indices"][2, 0, :] = -1
    out_ok, lse_ok = run_case(functools.partial(mma_sparse_decode, splits=19), case)
    assert out_ok.ok and lse_ok.ok, f"{out_ok} | {lse_ok}"


@pytest.mark.parametrize("partial_fp16", [False, True])
@pytest.mark.parametrize("dv_halves", [1, 2])
def test_mma_output_halves_and_partial_types_match_reference(dv_halves, partial_fp16, device):
    """dv_halves=2 (two programs per head block, 256 output columns each) and the partial
    output type, with and without splits, on a case with both caches, lengths and an empty query."""
    case = make_case(b=2, s_q=2, h_q=20, topk=45, page=13, extra_topk=19, extra_page=7, lengths=True,
                     empty_query=True, device=device, seed=11)
    base = mla.kernels.mma.default_config(20, torch.device(device))
    cfg = dataclasses.replace(base, dv_halves=dv_halves, partial_fp16=partial_fp16,
                              num_warps=4 if dv_halves == 2 else base.num_warps)
    for splits in (1, 3):
        out_ok, lse_ok = run_case(functools.partial(mma_sparse_decode, config=cfg, splits=splits), case)
        assert out_ok.ok and lse_ok.ok, f"splits={splits}: {out_ok} | {lse_ok}"


@pytest.mark.parametrize("variant", [dict(prefetch=True), dict(tokens_as_m=True), dict(dot="bf16"), dict(block_n=32)])
def test_mma_config_variants_match_reference(variant, device):
    """The non-default code paths (the hand-prefetched loop, tokens as M, bf16 operands, another
    tile size) over both caches, with lengths and an empty query, unsplit and in three splits
    (the middle one's tile range runs from the main cache's last tile into the extra cache's)."""
    case = make_case(b=2, s_q=1, h_q=6, topk=37, page=11, extra_topk=29, extra_page=5, lengths=True,
                     empty_query=True, device=device, seed=13)
    cfg = dataclasses.replace(mla.kernels.mma.default_config(6, torch.device(device)), **variant)
    for splits in (1, 3):
        out_ok, lse_ok = run_case(functools.partial(mma_sparse_decode, config=cfg, splits=splits), case)
        assert out_ok.ok and lse_ok.ok, f"{variant} splits={splits}: {out_ok} | {lse_ok}"


def test_mma_rejects_a_bad_dv_halves():
    case = make_case(b=1, s_q=1, h_q=4, topk=8, page=8, device="cpu", seed=1)
    with pytest.raises(ValueError, match="dv_halves"):
        mma_sparse_decode(**case, config=MMAConfig(block_h=16, block_n=16, num_warps=4, dv_halves=3))


@pytest.mark.parametrize("maxnreg", [-1, 8, 256])
def test_mma_rejects_a_bad_register_cap(maxnreg):
    case = make_case(b=1, s_q=1, h_q=4, topk=8, page=8, device="cpu", seed=1)
    with pytest.raises(ValueError, match="maxnreg"):
        mma_sparse_decode(**case, config=MMAConfig(block_h=16, block_n=16, num_warps=4, maxnreg=maxnreg))


def test_the_gluon_kernel_is_refused_off_hopper_with_a_clear_error():
    case = make_case(b=1, s_q=1, h_q=4, topk=8, page=8, device="cpu", seed=1)
    with pytest.raises(ValueError, match="sm_90"):
        mma_sparse_decode(**case, config=MMAConfig(kernel="wgmma"))
    with pytest.raises(ValueError, match="kernel must be"):
        mma_sparse_decode(**case, config=MMAConfig(kernel="cuda"))


@pytest.mark.parametrize("field", [dict(block_n=128), dict(block_n=32), dict(num_warps=4), dict(dot="bf16"),
                                   dict(prefetch=True),
                                   dict(dv_halves=2), dict(fp8="int"), dict(num_stages=2), dict(duo=True),
                                   dict(duo=True, tokens_as_m=True, block_n=128)])
def test_the_gluon_kernel_refuses_settings_it_does_not_have(field, monkeypatch):
    """Fields of MMAConfig that only the tl.dot kernel has are refused, not silently ignored (the
    check runs before the device check, so it is reachable on the CPU)."""
    from mla.kernels import mma as mma_mod

    monkeypatch.setattr(mma_mod._runtime, "INTERPRET", False)
    case = make_case(b=1, s_q=1, h_q=4, topk=8, page=8, device="cpu", seed=1)
    with pytest.raises(ValueError, match="the wgmma kernel takes"):
        mma_sparse_decode(**case, config=MMAConfig(kernel="wgmma", **field))


def test_the_gluon_kernel_takes_128_token_tiles_with_tokens_as_m_only(monkeypatch):
    """block_n 128 is the tokens-as-M variant's (8 heads, two ring tiles a tile); it passes the
    field check there and reaches the device check, and is refused with heads as M."""
    from mla.kernels import mma as mma_mod

    monkeypatch.setattr(mma_mod._runtime, "INTERPRET", False)
    case = make_case(b=1, s_q=1, h_q=4, topk=8, page=8, device="cpu", seed=1)
    with pytest.raises(ValueError, match="sm_90"):
        mma_sparse_decode(**case, config=MMAConfig(kernel="wgmma", tokens_as_m=True, block_n=128))
    with pytest.raises(ValueError, match="sm_90"):
        mma_sparse_decode(**case, config=MMAConfig(kernel="wgmma", tokens_as_m=True))
    with pytest.raises(ValueError, match="the wgmma kernel takes"):
        mma_sparse_decode(**case, config=MMAConfig(kernel="wgmma", tokens_as_m=True, block_n=32))
    assert MMAConfig(kernel="wgmma", tokens_as_m=True, block_n=128).for_heads(4).block_h == 8
    assert MMAConfig(kernel="wgmma", tokens_as_m=True).for_heads(128).block_h == 16
    assert MMAConfig(kernel="wgmma").for_heads(8).block_h == 64
    # two consumers: 8-head blocks for any h_q (16 heads take 235 KB of shared memory)
    assert MMAConfig(kernel="wgmma", tokens_as_m=True, duo=True).for_heads(128).block_h == 8


def test_the_gluon_kernel_copies_rows_as_wide_as_the_caches_alignment_allows():
    """The ring's cp.async copies are 16 bytes when every cache's page stride is a multiple of
    16 (the padded MODEL1 stride always is; a contiguous cache's, P x 584 bytes, at an even P),
    8 when of 8 (a contiguous cache at an odd P, as `.to(device)` of a padded one gives); a base
    address that is not a multiple of 16 (a view that starts mid-allocation) is not copied at
    all: the launch rule then runs the tl.dot kernel."""
    pytest.importorskip("triton.experimental.gluon")
    from mla import layout
    from mla.kernels import wgmma
    from mla.kernels.mma import cache_args

    def cache(P, offset=0):    # a contiguous cache of 2 pages: stride P x 584
        raw = torch.zeros(2 * P * 584 + 64, dtype=torch.uint8)
        base = (-raw.data_ptr()) % 16 + offset
        return cache_args(raw[base:base + 2 * P * 584].view(2, P, 584))

    def arg(P, offset=0):
        view, stride, _, _ = cache(P, offset)
        return view, stride

    assert wgmma.row_align(arg(64)) == 16
    padded = layout.quantize_kv(torch.zeros(3, 61, 512, dtype=torch.bfloat16))
    view, stride, _, _ = cache_args(padded)
    assert stride == layout.page_stride(61) and wgmma.row_align((view, stride)) == 16   # padded, any P
    assert cache_args(padded.to("meta"))[1] == 61 * 584        # .to() drops the padding: an odd stride
    assert wgmma.row_align(arg(64), arg(256)) == 16
    assert wgmma.row_align(arg(64), arg(61)) == 8        # 61 x 584: a multiple of 8, not of 16
    assert wgmma.row_align(arg(61)) == 8
    assert wgmma.row_align(arg(64, offset=8)) == 0       # a cache view 8 bytes off
    assert wgmma.row_align(arg(64), arg(61, offset=4)) == 0


def test_launch_config_picks_the_gluon_variant_by_heads_and_grid_on_a_hopper_gpu(monkeypatch):
    """The launch rule, with the GPU facts stubbed: on an sm_90 GPU (132 SMs) whose config file
    names a Gluon config, every call runs the Gluon kernel: heads as M for h_q > 16 on a grid
    that fills the GPU, tokens as M for h_q <= 16 or a small grid (at h_q <= 8, 8 heads x 128
    tokens with b * s_q >= 66, else two consumers of 8 heads x 64 tokens). No Gluon config
    (another GPU) means the tl.dot kernel, with split P.V on a small grid."""
    from mla import configs
    from mla.kernels import mma as mma_mod

    tl64 = MMAConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    tl16 = MMAConfig(block_h=16, block_n=64, num_warps=8)
    hop = MMAConfig(kernel="wgmma")
    t16 = MMAConfig(kernel="wgmma", tokens_as_m=True, block_h=16)
    t8 = MMAConfig(kernel="wgmma", tokens_as_m=True, block_h=8, block_n=128)
    duo = MMAConfig(kernel="wgmma", tokens_as_m=True, block_h=8, duo=True)
    monkeypatch.setattr(mma_mod._runtime, "INTERPRET", False)
    monkeypatch.setattr(mma_mod, "default_config", lambda h_q, dev: (tl16 if h_q <= 16 else tl64).for_heads(h_q))
    monkeypatch.setattr(mma_mod, "sm_count", lambda dev: 132)
    monkeypatch.setattr(configs, "hopper", lambda dev: hop)
    cuda = torch.device("cuda", 0)
    assert mma_mod.launch_config(1, 1, 64, 2048, cuda) == t16              # DSA b 1: 32 one-tile programs
    assert mma_mod.launch_config(2, 1, 64, 2048, cuda) == t16              # 64 <= 132 / 2
    assert mma_mod.launch_config(3, 1, 64, 2048, cuda) == hop              # 96: fills enough
    assert mma_mod.launch_config(8, 1, 64, 2048, cuda) == hop              # DSA b 8: 256 programs
    assert mma_mod.launch_config(1, 1, 64, 640, cuda) == t16               # V4-CSA b 1
    assert mma_mod.launch_config(32, 1, 64, 640, cuda) == hop              # V4-CSA b 32
    assert mma_mod.launch_config(1, 1, 8, 640, cuda) == duo                # V4-TP8 b 1
    assert mma_mod.launch_config(32, 1, 8, 640, cuda) == duo               # V4-TP8 b 32
    assert mma_mod.launch_config(65, 1, 8, 640, cuda) == duo
    assert mma_mod.launch_config(32, 1, 16, 640, cuda) == t16              # 9 to 16 heads: one 16-head block
    assert mma_mod.launch_config(66, 1, 8, 640, cuda) == t8
    assert mma_mod.launch_config(33, 2, 8, 640, cuda) == t8                # s_q counts like b
    assert mma_mod.launch_config(128, 1, 8, 640, cuda) == t8               # V4-TP8 b 128
    assert mma_mod.launch_config(128, 1, 9, 640, cuda) == t16
    assert mma_mod.launch_config(128, 1, 1, 640, cuda) == t8
    assert mma_mod.launch_config(32, 1, 17, 640, cuda) == hop              # heads padded to 64 inside
    assert mma_mod.launch_config(8, 1, 128, 640, cuda) == hop              # 8 x 2 head blocks x 10 tiles
    assert mma_mod.launch_config(2, 1, 128, 640, cuda) == t16              # 40 programs: small
    monkeypatch.setattr(configs, "hopper", lambda dev: None)
    assert mma_mod.launch_config(1, 1, 64, 2048, cuda) == fill_small_grid(tl64, 1, 1, 64, 2048, 132)
    assert mma_mod.launch_config(1, 1, 64, 2048, cuda).dv_halves == 2
    assert mma_mod.launch_config(8, 1, 64, 2048, cuda) == tl64
    assert mma_mod.launch_config(128, 1, 8, 640, cuda) == tl16
    assert mma_mod.launch_config(2, 1, 128, 640, cuda).kernel == "tl"


def test_config_labels_name_the_kernel_and_variant():
    assert MMAConfig(kernel="wgmma").label == "Gluon, heads as M"
    assert MMAConfig(kernel="wgmma", tokens_as_m=True).for_heads(8).label == "Gluon, tokens as M (16 heads x 64 tokens)"
    assert (MMAConfig(kernel="wgmma", tokens_as_m=True, block_n=128).for_heads(8).label
            == "Gluon, tokens as M (8 heads x 128 tokens)")
    assert (MMAConfig(kernel="wgmma", tokens_as_m=True, duo=True).for_heads(64).label
            == "Gluon, tokens as M (8 heads x 64 tokens, two consumers)")
    assert MMAConfig(dv_halves=2).label == "tl.dot, split P.V" and MMAConfig().label == "tl.dot"


def test_fill_small_grid_splits_head_blocks_only_when_the_grid_is_small():
    h64 = MMAConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    # DSA (topk 2048 = 32 tiles): 32 or 64 programs at b 1 or 2 fill under half of 132 SMs
    for b in (1, 2):
        got = fill_small_grid(h64, b, 1, 64, 2048, 132)
        assert (got.dv_halves, got.num_warps, got.num_stages) == (2, 4, 1), (b, got)
    for b in (3, 8, 128):
        assert fill_small_grid(h64, b, 1, 64, 2048, 132) == h64
    # V4-CSA (640 tokens = 10 tiles) up to b = 6; s_q counts like b
    assert fill_small_grid(h64, 6, 1, 64, 640, 132).dv_halves == 2
    assert fill_small_grid(h64, 7, 1, 64, 640, 132) == h64
    assert fill_small_grid(h64, 3, 2, 64, 640, 132).dv_halves == 2
    assert fill_small_grid(h64, 4, 2, 64, 640, 132) == h64
    # head blocks below 64 are left alone (measured: no gain at V4-TP8), as are other variants
    h16 = MMAConfig(block_h=16, block_n=64, num_warps=8)
    assert fill_small_grid(h16, 1, 1, 8, 640, 132) == h16
    tam = MMAConfig(tokens_as_m=True)
    assert fill_small_grid(tam, 1, 1, 64, 640, 132) == tam


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
