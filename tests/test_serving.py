"""mla in a serving stack, on the CPU: plans, out= buffers, the cache writer, the torch custom ops
and torch.compile, and FlashMLA's own call (mla.flash_mla)."""
import functools
import inspect
import json
import pathlib

import pytest
import torch
from triton.compiler import CompiledKernel

import mla
import mla.flash_mla as flash_mla
from mla import api, bench, dispatch, layout
from mla.validate import check_against_reference, make_case, run_case

from conftest import DEVICE as DEV, pool_views


@pytest.fixture(params=[512, 576], ids=["MODEL1", "V3.2"])
def case(request):
    return make_case(b=2, s_q=2, h_q=5, topk=40, page=16, extra_topk=24, extra_page=8, lengths=True, seed=5,
                     device=DEV, d_qk=request.param)


def _other_layout_cache(case):
    """A cache of the layout that q's head dim does not name."""
    width = 576 if case["q"].shape[-1] == 512 else 512
    return layout.quantize_kv(torch.zeros(4, 16, width, dtype=torch.bfloat16, device=DEV))


# --- plan once, call cheaply --------------------------------------------------------------------


def test_a_planned_call_equals_an_unplanned_one_and_fills_out_buffers(case):
    plan = mla.plan(**case)
    assert plan.impl == "mma" and plan.launch.programs >= 1
    want = mla.sparse_decode(**case)
    out = torch.full_like(want[0], float("nan"))
    lse = torch.full_like(want[1], float("nan"))
    got = mla.sparse_decode(**case, plan=plan, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    out_ok, lse_ok = run_case(functools.partial(mla.sparse_decode, plan=plan), case)
    assert out_ok.ok and lse_ok.ok, (out_ok, lse_ok)


@pytest.mark.parametrize("change,arg", [
    (lambda c: dict(c, q=c["q"][:1], indices=c["indices"][:1]), "q"),
    (lambda c: dict(c, indices=c["indices"][..., :30]), "indices"),
    (lambda c: dict(c, attn_sink=None), "attn_sink"),
    (lambda c: dict(c, softmax_scale=0.1), "softmax_scale"),
    (lambda c: dict(c, k_cache=layout.quantize_kv(torch.zeros(4, 32, c["q"].shape[-1], dtype=torch.bfloat16,
                                                               device=DEV))), "k_cache"),
    (lambda c: dict(c, topk_length=None), "topk_length"),
    (lambda c: dict(c, extra_indices=c["extra_indices"].long()), "extra_indices"),
])
def test_a_call_that_does_not_match_its_plan_names_the_argument(case, change, arg):
    plan = mla.plan(**case)
    with pytest.raises(ValueError, match=f"^{arg}: does not match the plan"):
        mla.sparse_decode(**change(case), plan=plan)


def test_bad_plans_and_buffers_are_refused(case):
    plan = mla.plan(**case)
    with pytest.raises(ValueError, match="^plan:"):
        mla.sparse_decode(**case, plan="a plan")
    with pytest.raises(ValueError, match="^impl: the plan is for impl='mma'"):
        mla.sparse_decode(**case, plan=plan, impl="simt")
    out, lse = mla.sparse_decode(**case)
    with pytest.raises(ValueError, match="^out:"):
        mla.sparse_decode(**case, out=out.float())
    with pytest.raises(ValueError, match="^out:"):
        mla.sparse_decode(**case, out=out.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="^lse:"):
        mla.sparse_decode(**case, lse=lse[:, :, :1])
    with pytest.raises(ValueError, match="^out:"):
        mla.sparse_decode(**case, out="out")


def test_a_plan_checks_its_inputs_once(case):
    with pytest.raises(ValueError, match="^q:"):
        mla.plan(**dict(case, q=case["q"].float()))
    with pytest.raises(ValueError, match="^attn_sink:"):
        mla.plan(**dict(case, attn_sink=case["attn_sink"][:2]))


def test_unplanned_calls_reuse_a_cached_plan(case):
    api._PLANS.clear()
    for _ in range(3):
        mla.sparse_decode(**case)
    assert len(api._PLANS) == 1
    mla.sparse_decode(**dict(case, attn_sink=None))
    assert len(api._PLANS) == 2


def test_a_plan_owns_its_split_workspace_and_a_cached_plan_none(case):
    """book/serving.md: a plan from mla.plan owns its split workspace (its calls run in order on
    one stream); the cached plan of an unplanned call owns none, so every such call gets a fresh
    one (it may serve calls on any stream)."""
    plan = mla.plan(**case, programs=3)
    assert plan.launch.combine and all(isinstance(t, torch.Tensor) for t in plan.workspace)
    api._PLANS.clear()
    mla.sparse_decode(**case)
    (cached,) = api._PLANS.values()
    assert cached.workspace == (None, None, None)
    made = []
    real = dispatch.workspace

    def spy(*args):
        made.append(real(*args))
        return made[-1]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dispatch, "workspace", spy)
        for _ in range(2):
            mla.sparse_decode(**case)
        mla.sparse_decode(**case, plan=plan)
    assert len(made) == 2 and made[0][2].data_ptr() != plan.workspace[2].data_ptr()


def _views_case(n_views, seed, b=2, h_q=8, topk=24, page=16, blocks=2):
    """q, indices (some -1) and a sink, and ``n_views`` caches ``[blocks, page, 1, 584]``, views of
    one pool at different offsets, each with its own latents."""
    g = torch.Generator().manual_seed(seed)
    views = [v.unsqueeze(-2) for v in pool_views([blocks] * n_views, page, DEV, g)]
    idx = torch.randint(-1, blocks * page, (b, 1, topk), generator=g, dtype=torch.int32)
    return views, dict(q=torch.randn(b, 1, h_q, 512, generator=g).bfloat16().to(DEV), indices=idx.to(DEV),
                       attn_sink=torch.randn(h_q, generator=g).to(DEV))


def _assert_matches_reference(out, lse, **call):
    out_ok, lse_ok = check_against_reference(out, lse, *mla.sparse_decode_reference(**call, out_dtype=torch.float64))
    assert out_ok.ok and lse_ok.ok, (str(out_ok), str(lse_ok))


def test_one_plan_serves_views_of_a_pool_at_any_offset_and_checks_each_fits_its_storage():
    """A plan holds no address: one made for a pool's first view serves a view at another offset
    (of the same shape and strides), reading that view. What the offset decided before, that a
    view fits its storage, each call checks: a storage shrunk after the plan was made is a
    ValueError naming the cache, not a read past its end."""
    (first, other), kw = _views_case(2, seed=3)
    plan = mla.plan(kw["q"], first, kw["indices"], attn_sink=kw["attn_sink"])
    assert plan.fits(kw["q"], other, kw["indices"], attn_sink=kw["attn_sink"])
    out, lse = mla.sparse_decode(kw["q"], other, kw["indices"], attn_sink=kw["attn_sink"], plan=plan)
    _assert_matches_reference(out, lse, k_cache=other, **kw)
    assert not torch.equal(out, mla.sparse_decode(kw["q"], first, kw["indices"], attn_sink=kw["attn_sink"])[0])
    other.untyped_storage().resize_(other.storage_offset() + layout.span_bytes(other) - 1)
    with pytest.raises(ValueError, match="^k_cache: the tensor's pages reach past the end of its storage"):
        mla.sparse_decode(kw["q"], other, kw["indices"], attn_sink=kw["attn_sink"], plan=plan)
    (main,), kw = _views_case(1, seed=4)
    (extra,), _ = _views_case(1, seed=5)                 # a pool of its own
    plan = mla.plan(kw["q"], main, kw["indices"], extra_k_cache=extra, extra_indices=kw["indices"])
    extra.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="^extra_k_cache: the tensor's pages reach past"):
        mla.sparse_decode(kw["q"], main, kw["indices"], extra_k_cache=extra, extra_indices=kw["indices"], plan=plan)


def test_plans_for_every_impl(case):
    for impl in ("mma", "simt", "reference"):
        plan = mla.plan(**case, impl=impl)
        assert plan.impl == impl and (plan.launch is not None) == (impl == "mma")
        out_ok, lse_ok = run_case(functools.partial(mla.sparse_decode, plan=plan), case)
        assert out_ok.ok and lse_ok.ok, (impl, out_ok, lse_ok)
    assert mla.plan(**case).fits(**case) and not mla.plan(**case).fits(**dict(case, attn_sink=None))


def test_the_host_cost_benchmark_prints_both_figures():
    from mla import bench

    rows = bench.host_cost(bench.spec_shapes()[:1], calls=20, reps=1)
    assert rows[0]["us with a plan"] > 0 and rows[0]["us without a plan"] > 0
    text = bench.host_table(rows)
    assert "with a plan" in text and "without a plan" in text


# --- the cache writer -----------------------------------------------------------------------


def _latents(n, seed=0, width=512):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, width, generator=g)
            * torch.exp2(torch.randint(-6, 6, (n, 1), generator=g).float())).bfloat16().to(DEV)


#: the two layouts, by the width of their latents
WIDTHS = pytest.mark.parametrize("width", [512, 576], ids=["MODEL1", "V3.2"])


def _layout(width):
    return layout.MODEL1 if width == 512 else layout.V32


def test_the_launch_rule_predicts_the_kernels_a_batch_sweep_compiled_on_the_h200():
    """The compiles of b = 1..256 that serving.json measured on the H200 are the ones the launch rule
    predicts on the CPU: each decode (form, combines) pair once, each combine form once a process."""
    measured = json.loads((pathlib.Path(__file__).parents[1] / "results/h200/serving.json").read_text())
    measured = measured["compiles"]["measured"]
    assert bench.predicted_compiles(bench.predicted_variants(list(measured))) == measured


def test_a_combine_form_is_counted_once_per_process():
    variants = {"A": [("heads", ""), ("heads", "by share"), ("tokens", "by query row")],
                "B": [("heads", "by share"), ("tokens", "by query row")], "C": [("two", "per split")]}
    assert bench.predicted_compiles(variants) == {"A": 3 + 2, "B": 2, "C": 1 + 1}


@WIDTHS
@pytest.mark.parametrize("page", [1, 7, 61, 64])
def test_write_kv_writes_the_bytes_quantize_kv_writes(page, width):
    nb = 3
    kv = _latents(nb * page, seed=page, width=width)
    cache = layout.empty_cache(nb, page, device=DEV, fill=0, layout=_layout(width))
    mla.write_kv(kv, cache, torch.randperm(nb * page).int().sort().values.to(DEV))
    want = mla.quantize_kv(kv.view(nb, page, width))
    assert torch.equal(layout.cache_bytes(cache), layout.cache_bytes(want))


def _slot_bytes(cache, slots):
    """Every byte offset (from the cache's first page) of these slots' tokens: MODEL1's data and
    scale rows (576 bytes at i*576, 8 at P*576 + i*8), V3.2's 656 bytes at i*656."""
    p, ps = cache.shape[1], cache.stride(0)
    blk, off = slots // p, slots % p
    if cache.shape[-1] == 656:
        return ((blk * ps + off * 656)[:, None] + torch.arange(656)).flatten()
    data = (blk * ps + off * 576)[:, None] + torch.arange(576)
    scale = (blk * ps + p * 576 + off * 8)[:, None] + torch.arange(8)
    return torch.cat([data.flatten(), scale.flatten()])


@WIDTHS
def test_write_kv_touches_only_its_slots_in_a_pooled_view_and_skips_invalid_slots(width):
    """A cache that is a view into a larger pool (pages 2..5 of 8, page size 13), a row per slot
    of a shuffled subset, some slots invalid: the valid slots hold quantize_kv's bytes for their
    rows, and every other byte of the pool is what it was."""
    pool = layout.empty_cache(8, 13, device=DEV, fill=0xAB, layout=_layout(width))
    cache = pool[2:6]
    n_tokens = 4 * 13
    slots = torch.tensor([5, 0, 51, -1, 17, n_tokens, 2 ** 31 - 1, 33, -(2 ** 31), 12], dtype=torch.int64, device=DEV)
    kv = _latents(len(slots), seed=1, width=width)
    before = layout.cache_bytes(pool).clone().cpu()
    mla.write_kv(kv, cache, slots)
    after = layout.cache_bytes(pool).cpu()
    slots = slots.cpu()
    valid = (slots >= 0) & (slots < n_tokens)
    base = 2 * pool.stride(0)                         # the view's first byte in the pool
    written = base + _slot_bytes(cache, slots[valid])
    changed = torch.zeros(after.numel(), dtype=torch.bool)
    changed[written] = True
    assert torch.equal(after[~changed], before[~changed])
    for row, slot in zip(kv[valid.to(kv.device)], slots[valid].tolist()):
        want = layout.cache_bytes(mla.quantize_kv(row.view(1, 1, width))).cpu()     # one token: P = 1
        got = after[base + _slot_bytes(cache, torch.tensor([slot]))]
        assert torch.equal(got, want), slot


def test_write_kv_takes_int32_slots_three_dim_rows_and_nothing():
    cache = layout.empty_cache(2, 8, device=DEV, fill=0)
    kv = _latents(16, seed=2)
    mla.write_kv(kv.view(16, 1, 512), cache, torch.arange(16, dtype=torch.int32, device=DEV))
    assert torch.equal(layout.cache_bytes(cache), layout.cache_bytes(mla.quantize_kv(kv.view(2, 8, 512))))
    before = layout.cache_bytes(cache).clone()
    mla.write_kv(kv[:0], cache, torch.zeros(0, dtype=torch.int32, device=DEV))
    assert torch.equal(layout.cache_bytes(cache), before)


@pytest.mark.parametrize("kw,arg", [
    (dict(kv=torch.zeros(4, 512)), "kv"),
    (dict(kv=torch.zeros(4, 448, dtype=torch.bfloat16)), "kv"),
    (dict(kv="rows"), "kv"),
    (dict(k_cache=torch.zeros(2, 8, 1, 576, dtype=torch.uint8)), "k_cache"),
    (dict(k_cache=layout.empty_cache(2, 8, fill=0, layout=layout.V32)), "k_cache"),      # 512-wide rows
    (dict(kv=torch.zeros(4, 576, dtype=torch.bfloat16)), "k_cache"),                     # a MODEL1 cache
    (dict(slot_mapping=torch.zeros(4, dtype=torch.float32)), "slot_mapping"),
    (dict(slot_mapping=torch.zeros(3, dtype=torch.int32)), "slot_mapping"),
    (dict(slot_mapping=torch.zeros(4, 1, dtype=torch.int32)), "slot_mapping"),
    (dict(slot_mapping=torch.zeros(4, dtype=torch.int32, device="meta")), "slot_mapping"),
])
def test_write_kv_refuses_bad_arguments_by_name(kw, arg):
    args = dict(kv=torch.zeros(4, 512, dtype=torch.bfloat16), k_cache=layout.empty_cache(2, 8, fill=0),
                slot_mapping=torch.zeros(4, dtype=torch.int32))
    args.update(kw)
    with pytest.raises(ValueError, match=f"^{arg}:"):
        mla.write_kv(**args)


# --- torch ops and torch.compile -------------------------------------------------------------


@WIDTHS
def test_the_custom_ops_are_registered_and_their_fakes_fit(width):
    case = make_case(b=1, s_q=1, h_q=4, topk=8, page=8, seed=1, device=DEV, d_qk=width)
    torch.library.opcheck(torch.ops.mla.sparse_decode.default,
                          (case["q"], case["k_cache"].view(torch.uint8), case["indices"]),
                          dict(attn_sink=case["attn_sink"]),
                          test_utils=("test_schema", "test_faketensor"))
    kv = _latents(4, seed=3, width=width)
    torch.library.opcheck(torch.ops.mla.write_kv.default,
                          (kv, layout.empty_cache(2, 8, device=DEV, fill=0, layout=_layout(width)).view(torch.uint8),
                           torch.arange(4, dtype=torch.int32, device=DEV)),
                          test_utils=("test_schema", "test_faketensor"))


@WIDTHS
def test_a_compiled_step_writes_and_decodes_without_a_graph_break(width):
    """One decode step as a serving loop runs it: write the step's new tokens, then attend. With
    fullgraph=True a graph break is an error; aot_eager runs the traced graph on the CPU."""
    nb, page = 4, 16
    cache = layout.empty_cache(nb, page, device=DEV, fill=0, layout=_layout(width))
    kv = _latents(nb * page, seed=4, width=width)
    slots = torch.arange(nb * page, dtype=torch.int64, device=DEV)
    q = torch.randn(2, 1, 4, width).bfloat16().to(DEV)
    idx = torch.randint(0, nb * page, (2, 1, 24), dtype=torch.int32).to(DEV)
    sink = torch.randn(4).to(DEV)

    def step(q, k_cache, indices, kv, slots, sink):
        mla.write_kv(kv, k_cache, slots)
        return mla.sparse_decode(q, k_cache, indices, attn_sink=sink)

    torch._dynamo.reset()
    out, lse = torch.compile(step, fullgraph=True, backend="aot_eager")(q, cache, idx, kv, slots, sink)
    ref = mla.quantize_kv(kv.view(nb, page, width))
    assert torch.equal(layout.cache_bytes(cache), layout.cache_bytes(ref))
    want = mla.sparse_decode(q, ref, idx, attn_sink=sink)
    assert out.shape == (2, 1, 4, 512) and torch.equal(out, want[0]) and torch.equal(lse, want[1])


# --- FlashMLA's own call ---------------------------------------------------------------------


def test_one_metadata_object_serves_60_layers_whose_caches_are_views_of_one_pool(plans_made, monkeypatch):
    """Issue #53: vLLM's ~60 V4 layers of a type share one metadata object a step, and every
    layer's cache is a view of one allocation at its own offset. Through mla.flash_mla that is one
    plan (its signature holds no address) and one split workspace, the plan's, reused by every
    call; each layer reads its own view (every call through the kernel; a few layers' outputs
    against the reference)."""
    views, kw = _views_case(60, seed=6)
    workspaces = []
    real = dispatch.workspace
    monkeypatch.setattr(dispatch, "workspace", lambda *a: workspaces.append(real(*a)) or workspaces[-1])
    meta, _ = flash_mla.get_mla_metadata()
    outs = [flash_mla.flash_mla_with_kvcache(kw["q"], view, None, None, 512, meta, is_fp8_kvcache=True,
                                             indices=kw["indices"], attn_sink=kw["attn_sink"]) for view in views]
    assert len(plans_made) == 1 and meta.plan is plans_made[0] and len(workspaces) == 1
    assert meta.plan.workspace[2] is workspaces[0][2]
    for layer in (0, 29, 59):
        _assert_matches_reference(*outs[layer], k_cache=views[layer], **kw)
    assert not torch.equal(outs[0][0], outs[59][0])


def _flashmla_arguments(case) -> dict:
    """A make_case case as FlashMLA's keyword arguments (but the metadata and the ignored ones)."""
    return dict(q=case["q"], k_cache=case["k_cache"], head_dim_v=512, is_fp8_kvcache=True, indices=case["indices"],
                attn_sink=case["attn_sink"], topk_length=case["topk_length"], extra_k_cache=case["extra_k_cache"],
                extra_indices_in_kvcache=case["extra_indices"], extra_topk_length=case["extra_topk_length"])


def test_flashmla_writes_out_in_place_and_checks_it_by_name(case):
    """vLLM's out=: the buffer, written in place and returned, holds what a call without it
    returns; one of the wrong dtype, shape or layout, or no tensor, is a ValueError naming out."""
    call = dict(_flashmla_arguments(case), block_table=None, cache_seqlens=None)
    meta, _ = flash_mla.get_mla_metadata()
    want = flash_mla.flash_mla_with_kvcache(**call, tile_scheduler_metadata=meta)
    out = torch.full_like(want[0], float("nan"))
    got = flash_mla.flash_mla_with_kvcache(**call, tile_scheduler_metadata=meta, out=out)
    assert got[0] is out and torch.equal(out, want[0]) and torch.equal(got[1], want[1])
    for bad in (out.float(), out[:, :1], out.transpose(0, 1).contiguous().transpose(0, 1), "out"):
        with pytest.raises(ValueError, match="^out:"):
            flash_mla.flash_mla_with_kvcache(**call, tile_scheduler_metadata=meta, out=bad)


def test_flashmla_ignores_a_block_table_and_sequence_lengths_beside_indices(case):
    """vLLM's sparse backend passes a dummy block table (``torch.empty``) and cache lengths with
    its indices; FlashMLA's sparse decode ignores them, and so does mla.flash_mla."""
    call = _flashmla_arguments(case)
    want = flash_mla.flash_mla_with_kvcache(**call, block_table=None, cache_seqlens=None,
                                            tile_scheduler_metadata=flash_mla.get_mla_metadata()[0])
    got = flash_mla.flash_mla_with_kvcache(**call, block_table=torch.empty(8, 1, dtype=torch.int32, device=DEV)[:2],
                                           cache_seqlens=torch.full((8,), 4096, dtype=torch.int32, device=DEV)[:2],
                                           tile_scheduler_metadata=flash_mla.get_mla_metadata()[0])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("with_out", [False, True])
def test_a_compiled_function_calling_flash_mla_traces_without_a_graph_break(with_out):
    """torch.compile(fullgraph=True) of a function that calls mla.flash_mla.flash_mla_with_kvcache
    (the metadata object made outside it, as a server makes it per step), with and without out=:
    it traces (the call is the custom op there) and returns, and writes, what the eager call does."""
    case = make_case(b=2, s_q=1, h_q=4, topk=16, page=16, lengths=True, seed=8, device=DEV)
    meta, _ = flash_mla.get_mla_metadata()
    out = torch.full_like(case["q"], float("nan"))
    given = {"out": out} if with_out else {}

    def attend(q, k_cache, indices, sink, lengths):
        return flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, softmax_scale=0.05,
                                                is_fp8_kvcache=True, indices=indices, attn_sink=sink,
                                                topk_length=lengths, **given)
    torch._dynamo.reset()
    got = torch.compile(attend, fullgraph=True, backend="aot_eager")(
        case["q"], case["k_cache"], case["indices"], case["attn_sink"], case["topk_length"])
    want = mla.sparse_decode(**case, softmax_scale=0.05)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if with_out:
        assert torch.equal(out, want[0])


def test_flashmla_metadata_mismatches_are_value_errors(case):
    meta, none = flash_mla.get_mla_metadata(torch.zeros(2), 64, 1)       # the old interface's arguments
    assert none is None
    flash_mla.flash_mla_with_kvcache(case["q"], case["k_cache"], None, None, 512, meta, is_fp8_kvcache=True,
                                     indices=case["indices"])
    with pytest.raises(ValueError, match="^indices: inconsistent with tile_scheduler_metadata: topk"):
        flash_mla.flash_mla_with_kvcache(case["q"], case["k_cache"], None, None, 512, meta, is_fp8_kvcache=True,
                                         indices=case["indices"][..., :8])
    with pytest.raises(ValueError, match="^tile_scheduler_metadata:"):
        flash_mla.flash_mla_with_kvcache(case["q"], case["k_cache"], None, None, 512, None, is_fp8_kvcache=True,
                                         indices=case["indices"])


@pytest.mark.parametrize("kw,arg", [
    (dict(indices=None), "indices"),
    (dict(is_fp8_kvcache=False), "is_fp8_kvcache"),
    (dict(causal=True), "causal"),
    (dict(num_splits=4), "num_splits"),
    (dict(head_dim_v=448), "head_dim_v"),
    (dict(block_table=[[0, 1], [2, 3]]), "block_table"),         # ignored with indices, but not a tensor
    (dict(cache_seqlens=64), "cache_seqlens"),
    (dict(q=torch.zeros(2, 2, 5, 448, dtype=torch.bfloat16)), "q"),           # neither 512 nor 576
    (_other_layout_cache, "k_cache"),                                          # the layout q does not name
])
def test_flashmla_paths_mla_does_not_cover_are_refused_by_name(case, kw, arg):
    args = dict(q=case["q"], k_cache=case["k_cache"], block_table=None, cache_seqlens=None, head_dim_v=512,
                tile_scheduler_metadata=flash_mla.get_mla_metadata()[0], is_fp8_kvcache=True, indices=case["indices"])
    args.update(dict(k_cache=kw(case)) if callable(kw) else kw)
    with pytest.raises(ValueError, match=f"^{arg}:"):
        flash_mla.flash_mla_with_kvcache(**args)


# ---------------------------------------------------------------------------------------------
# dispatch.BoundLaunch: the compiled kernel launched directly after its first call
# ---------------------------------------------------------------------------------------------


class _Compiled(CompiledKernel):
    """A compiled kernel that records its launches (no GPU)."""

    module = None                   # CompiledKernel.__del__ unloads a module when it has one

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        assert len(grid) == 3, "a compiled kernel's launcher indexes grid[0], grid[1] and grid[2]"
        return lambda *args: self.launches.append((grid, args))


class _Kernel:
    """A kernel like Triton's: ``.fn`` has the signature, ``kernel[grid](*args, **kw)`` records
    the call and returns what ``returns`` gives (a compiled kernel, or None as the interpreter does)."""

    def __init__(self, returns):
        def fn(x, y, n, A, B=7, C=3):
            pass
        self.fn, self.calls, self.returns = fn, [], returns

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((grid, args, kw))
            return self.returns
        return launch


def test_a_bound_launch_goes_through_triton_once_then_launches_the_compiled_kernel():
    compiled = _Compiled()
    kernel = _Kernel(compiled)
    bound = dispatch.BoundLaunch((4, 2), {"A": 1, "C": 5, "num_warps": 8}, [None, None, 12], (0, 1))
    x, y = torch.zeros(8), torch.zeros(8)
    for _ in range(3):
        bound(kernel, (x, y))
    assert kernel.calls == [((4, 2), (x, y, 12), {"A": 1, "C": 5, "num_warps": 8})]
    # tensors as their addresses, the constexprs in signature order, defaults filled in, the
    # compile option left out
    assert compiled.launches == [((4, 2, 1), (x.data_ptr(), y.data_ptr(), 12, 1, 7, 5))] * 2


def test_a_bound_launch_takes_tritons_path_for_misaligned_pointers_other_kernels_and_the_interpreter():
    compiled = _Compiled()
    kernel = _Kernel(compiled)
    bound = dispatch.BoundLaunch((1,), {"A": 1}, [None, None, 1], (0, 1))
    x = torch.zeros(16)
    odd = torch.zeros(16, dtype=torch.uint8)[1:]          # 1 byte past an aligned address
    bound(kernel, (odd, x))
    bound(kernel, (odd, x))
    assert len(kernel.calls) == 2 and not compiled.launches       # never kept, never used
    bound(kernel, (x, x))
    bound(kernel, (odd, x))
    assert len(kernel.calls) == 4 and not compiled.launches       # misaligned: Triton specializes anew
    other = _Kernel(_Compiled())                                  # a stub swapped in for the kernel
    bound(other, (x, x))
    assert len(other.calls) == 1 and not compiled.launches
    interpreted = _Kernel(None)
    bound = dispatch.BoundLaunch((1,), {"A": 1}, [None, None, 1], (0, 1))
    for _ in range(2):
        bound(interpreted, (x, x))
    assert len(interpreted.calls) == 2


class _CLauncher:
    """A compiled kernel's C launcher, as Triton 3.6 keeps it (``CompiledKernel._run``)."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(args)


class _CLauncher39(_CLauncher):
    """The C launcher as Triton 3.9 keeps it: the arguments' annotations and signature, then the
    arguments as one tuple."""

    arg_annotations, kernel_signature, gsan_enabled = ("notes",), b"sig", False


class _CompiledWithLauncher(_Compiled):
    function, packed_metadata = 0xF00, (8, 1, 4096)

    def __init__(self, launcher=_CLauncher):
        super().__init__()
        self._run = launcher()


def _launched_args(call):
    """The kernel arguments of a C launcher call (either shape) after its 13 or 15 leading values."""
    if len(call) == 16 and isinstance(call[15], tuple):
        assert call[7:15] == ((8, 1, 4096), None, None, None, None, None, ("notes",), b"sig")
        return call[15]
    assert call[7:13] == (None, None, (8, 1, 4096), None, None, None)
    return call[13:]


@pytest.mark.parametrize("launcher", [_CLauncher, _CLauncher39], ids=["triton 3.6", "triton 3.9"])
def test_a_bound_launch_calls_the_c_launcher_below_tritons_wrapper(launcher, monkeypatch):
    """On a GPU the direct launch goes straight into the compiled kernel's C launcher: the grid,
    the current stream, the function handle, its launch flags and metadata, no scratch and no
    hooks, then the arguments, one by one (Triton 3.3 to 3.8) or as a tuple after their
    annotations and signature (3.9) (on the CPU, with a stand-in launcher and stream)."""
    compiled = _CompiledWithLauncher(launcher)
    kernel = _Kernel(compiled)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77 + device, raising=False)
    bound = dispatch.BoundLaunch((4, 2), {"A": 1}, [None, None, 12], (0, 1), device=torch.device("cuda", 3))
    x, y = torch.zeros(8), torch.zeros(8)
    for _ in range(3):
        bound(kernel, (x, y))
    assert len(kernel.calls) == 1 and not compiled.launches
    args = (x.data_ptr(), y.data_ptr(), 12, 1, 7, 3)
    if launcher is _CLauncher:
        want = (4, 2, 1, 80, 0xF00, False, True, None, None, (8, 1, 4096), None, None, None, *args)
    else:
        want = (4, 2, 1, 80, 0xF00, False, True, (8, 1, 4096), None, None, None, None, None, ("notes",), b"sig", args)
    assert compiled._run.calls == [want] * 2


class _Recording(_Kernel):
    """A stand-in with a real kernel's signature."""

    def __init__(self, real, returns):
        super().__init__(returns)
        self.fn = real.fn


@pytest.mark.parametrize("kernel", ["tl_dot", "gluon"])
@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("path", ["compiled kernel", "C launcher", "C launcher 3.9"])
def test_a_launchers_bound_launches_pass_every_parameter_of_the_real_kernels(kernel, programs, path, monkeypatch):
    """Through a Launcher, the direct launch passes the values Triton's path bound: each of the
    kernel's parameters in order, the constexprs by name (the decodes and the combine), through
    the compiled kernel (the CPU) or its C launcher (a GPU: the written-out call of
    dispatch._direct_launch, the combine's addresses picked from the decode's)."""
    if kernel == "gluon" and dispatch.gluon_sm90 is None:
        pytest.skip("this Triton has no Gluon")
    c = make_case(b=2, s_q=1, h_q=8, topk=40, page=16, extra_topk=24, extra_page=8, sink=True, seed=3)
    if kernel == "gluon":
        module, name, cfg, align = dispatch.gluon_sm90.kernel, "gluon_decode_kernel", mla.configs.GluonConfig(), 16
    else:
        module, name, cfg, align = dispatch.tl_dot, "tl_dot_decode_kernel", mla.configs.TlDotConfig(), 0
    stands = {}
    for mod, attr in ((module, name), (dispatch.combine, "combine_kernel")):
        stands[attr] = _Recording(getattr(mod, attr), _Compiled() if path == "compiled kernel"
                                  else _CompiledWithLauncher(_CLauncher39 if path.endswith("3.9") else _CLauncher))
        monkeypatch.setattr(mod, attr, stands[attr])
    launch = dispatch.Launch(cfg, programs, share=0, combine=programs > 1, align=align)
    lr = dispatch.Launcher(launch, c["q"], c["k_cache"], c["indices"], c["attn_sink"], None, c["extra_k_cache"],
                           c["extra_indices"], None, None)
    if path.startswith("C launcher"):             # as on a GPU: the launches' device, its current stream
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
        lr._decode._device = lr._combine._device = 0
    out, lse = torch.empty_like(c["q"]), torch.empty(2, 8, 1)
    args = (c["q"], c["k_cache"], c["indices"], c["attn_sink"], None, c["extra_k_cache"], c["extra_indices"], None,
            out, lse, *dispatch.workspace(launch, 2, 1, 8, "cpu"))
    lr(*args)
    lr(*args)
    for attr, stand in stands.items():
        if attr == "combine_kernel" and programs == 1:
            assert not stand.calls and not stand.returns.launches
            continue
        (grid, given, kw), = stand.calls
        if path == "compiled kernel":
            (_, direct), = stand.returns.launches
        else:
            (call,) = stand.returns._run.calls            # grid, stream, function, flags, metadata, hooks
            assert call[:4] == (*grid, *(1,) * (3 - len(grid)), 77) and not stand.returns.launches
            direct = _launched_args(call)
        params = list(inspect.signature(stand.fn).parameters.values())
        assert len(direct) == len(params)
        bound = dict(zip([p.name for p in params], direct))
        for p, g in zip(params, given):           # every argument as Triton's path had it (tensors as addresses)
            assert bound[p.name] == (g.data_ptr() if isinstance(g, torch.Tensor) else g), p.name
        for p in params[len(given):]:
            assert bound[p.name] == kw.get(p.name, p.default), p.name
        assert set(kw) - set(bound) <= {"num_warps", "num_stages", "num_ctas", "maxnreg"}


@pytest.mark.parametrize("kernel", ["tl_dot", "gluon"])
def test_a_cache_off_16_bytes_fails_a_gluon_launch_and_takes_tritons_path_otherwise(kernel, monkeypatch):
    """The Gluon kernel's copies need caches at multiples of 16 bytes: a Launcher for it raises a
    ValueError naming the cache; a tl.dot one launches through Triton's path, which specializes
    on the address."""
    if kernel == "gluon" and dispatch.gluon_sm90 is None:
        pytest.skip("this Triton has no Gluon")
    c = make_case(b=1, s_q=1, h_q=8, topk=16, page=16, seed=4)
    if kernel == "gluon":
        module, name, cfg, align = dispatch.gluon_sm90.kernel, "gluon_decode_kernel", mla.configs.GluonConfig(), 16
    else:
        module, name, cfg, align = dispatch.tl_dot, "tl_dot_decode_kernel", mla.configs.TlDotConfig(), 0
    stand = _Recording(getattr(module, name), _Compiled())
    monkeypatch.setattr(module, name, stand)
    cache = c["k_cache"].view(torch.uint8)
    buf = torch.empty(cache.numel() + 8, dtype=torch.uint8)
    shifted = buf[8 if buf.data_ptr() % 16 == 0 else 0:][:cache.numel()].view(cache.shape)
    shifted.copy_(cache)
    assert shifted.data_ptr() % 16 == 8
    launch = dispatch.Launch(cfg, 1, share=0, combine=False, align=align)
    lr = dispatch.Launcher(launch, c["q"], shifted, c["indices"])
    args = (c["q"], shifted, c["indices"], None, None, None, None, None, torch.empty_like(c["q"]),
            torch.empty(1, 8, 1), *dispatch.workspace(launch, 1, 1, 8, "cpu"))
    if kernel == "gluon":
        with pytest.raises(ValueError, match="k_cache.*multiple of 16 bytes"):
            lr(*args)
        assert not stand.calls
    else:
        lr(*args)
        lr(*args)
        assert len(stand.calls) == 2 and not stand.returns.launches


def test_a_combine_bound_to_the_decodes_addresses_takes_tritons_path_when_the_decode_does(monkeypatch):
    """The combine's direct launch picks its addresses from the decode's: where the decode has
    none (a misaligned cache, so Triton's path), the combine takes Triton's path too, and with
    the decode's addresses it passes its own tensors' addresses."""
    c = make_case(b=2, s_q=1, h_q=8, topk=40, page=16, seed=5)
    stands = {}
    for mod, attr in ((dispatch.tl_dot, "tl_dot_decode_kernel"), (dispatch.combine, "combine_kernel")):
        stands[attr] = _Recording(getattr(mod, attr), _Compiled())
        monkeypatch.setattr(mod, attr, stands[attr])
    launch = dispatch.Launch(mla.configs.TlDotConfig(), 3, share=0, combine=True)
    cache = c["k_cache"].view(torch.uint8)
    buf = torch.empty(cache.numel() + 8, dtype=torch.uint8)
    shifted = buf[8 if buf.data_ptr() % 16 == 0 else 0:][:cache.numel()].view(cache.shape)
    shifted.copy_(cache)
    out, lse = torch.empty_like(c["q"]), torch.empty(2, 8, 1)
    ws = dispatch.workspace(launch, 2, 1, 8, "cpu")
    for k_cache, direct in ((shifted, 0), (c["k_cache"], 2)):
        lr = dispatch.Launcher(launch, c["q"], k_cache, c["indices"])
        for stand in stands.values():
            stand.calls.clear(), stand.returns.launches.clear()
        for _ in range(3):
            lr(c["q"], k_cache, c["indices"], None, None, None, None, None, out, lse, *ws)
        combine_ = stands["combine_kernel"]
        assert len(combine_.calls) == 3 - direct and len(combine_.returns.launches) == direct
        for _, args in combine_.returns.launches:
            assert list(args[:6]) == [t.data_ptr() for t in (*ws, out, lse, lse)]   # no sink: lse stands in
