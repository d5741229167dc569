"""GPU-only checks (skipped on the CPU). Run them on a GPU before calling a kernel done:
``pytest -m gpu``."""
import dataclasses
import functools

import pytest
import torch

import mla
import mla.flash_mla as mla_flash_mla
from mla.bench import spec_shapes
from mla.configs import GLUON_FORMS, ClusterConfig, GluonConfig
from mla.validate import make_case, run_case

from test_callsites import (Recorder, check_calls, sglang_metadata, sglang_step, sglang_step_inputs, vllm_metadata,
                            vllm_step, vllm_step_inputs)

pytestmark = pytest.mark.gpu

SHAPES = {
    "DSA b4": dict(b=4, s_q=1, h_q=64, topk=2048, page=64),
    "DSA s_q2": dict(b=2, s_q=2, h_q=64, topk=2048, page=64, lengths=True),
    "V4-CSA b8": dict(b=8, s_q=1, h_q=64, topk=128, page=256, extra_topk=512, extra_page=64),
    "V4-TP8 b8": dict(b=8, s_q=1, h_q=8, topk=128, page=256, extra_topk=512, extra_page=64, lengths=True),
    "odd P61 h20": dict(b=3, s_q=3, h_q=20, topk=100, page=61, extra_topk=77, extra_page=13, lengths=True),
    "h128": dict(b=2, s_q=1, h_q=128, topk=300, page=64, empty_query=True),
    # DeepSeek-V3.2's cache (the Gluon kernel heads as M on Hopper, the tl.dot kernel elsewhere)
    "V3.2 b4 h64": dict(b=4, s_q=1, h_q=64, topk=2048, page=64, d_qk=576),
    "V3.2 s_q2 h128 lengths extra": dict(b=3, s_q=2, h_q=128, topk=2048, page=64, extra_topk=128, extra_page=2,
                                         lengths=True, d_qk=576),
    "V3.2 odd P61 h20": dict(b=3, s_q=3, h_q=20, topk=100, page=61, empty_query=True, d_qk=576),
}
#: the shapes of MODEL1's cache, the one the portable Gluon kernel reads (mla.dispatch.PORTABLE_LAYOUTS)
MODEL1_SHAPES = [n for n, s in SHAPES.items() if s.get("d_qk", 512) == 512]
#: (shape, form) of the Gluon kernel: every form on MODEL1's cache, heads as M on V3.2's
#: (mla.dispatch.GLUON_LAYOUTS)
GLUON_CASES = [(n, f) for n, s in SHAPES.items() for f in GLUON_FORMS if n in MODEL1_SHAPES or f == "heads as M"]


@pytest.mark.parametrize("impl", ["simt", "mma"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_kernels_on_gpu(impl, name):
    case = make_case(**SHAPES[name], device="cuda", seed=len(name))
    out_ok, lse_ok = run_case(functools.partial(mla.sparse_decode, impl=impl), case)
    assert out_ok.ok, str(out_ok)
    assert lse_ok.ok, str(lse_ok)


@pytest.mark.parametrize("isa", [80, 89])
@pytest.mark.parametrize("name", list(SHAPES))
def test_an_older_architectures_code_runs_here_and_matches_the_reference(isa, name):
    """The portable kernel as an A100 (sm_80) and an L40 (sm_89) compile it, assembled for this
    GPU (mla.kernels.cross_arch), with those architectures' generic tables."""
    if torch.cuda.get_device_capability() <= (isa // 10, isa % 10):
        pytest.skip(f"sm_{isa} code runs on a newer GPU")
    case = make_case(**SHAPES[name], device="cuda", seed=len(name))

    def fn(**kw):
        plan = mla.plan(**kw, isa=isa)
        assert plan.launch.isa == isa and plan.launch.config.kernel == "tl_dot"
        return mla.sparse_decode(**kw, plan=plan)
    out_ok, lse_ok = run_case(fn, case)
    assert out_ok.ok, str(out_ok)
    assert lse_ok.ok, str(lse_ok)


@pytest.mark.parametrize("isa", [0, 80, 89])
@pytest.mark.parametrize("programs", [None, 7])
@pytest.mark.parametrize("name", MODEL1_SHAPES)
def test_the_portable_gluon_kernel_matches_the_reference(isa, programs, name):
    """The portable Gluon kernel (mla.kernels.gluon_portable) in the form each architecture's
    shared memory takes, as this GPU compiles it (isa 0) and as an A100 and an L40 do, on the
    launch rule's schedule and on 7 programs (shares that end mid-query)."""
    from mla import dispatch

    if isa and torch.cuda.get_device_capability() <= (isa // 10, isa % 10):
        pytest.skip(f"sm_{isa} code runs on a newer GPU")
    case = make_case(**SHAPES[name], device="cuda", seed=len(name))
    arch = isa or 10 * torch.cuda.get_device_capability()[0]

    def fn(**kw):
        cfg = dispatch.gluon_portable_config(arch, kw["q"].shape[2])
        plan = mla.plan(**kw, config=cfg, programs=programs, isa=isa)
        assert plan.launch.config.kernel == "gluon_portable" and plan.launch.isa == isa
        return mla.sparse_decode(**kw, plan=plan)
    out_ok, lse_ok = run_case(fn, case)
    assert out_ok.ok, str(out_ok)
    assert lse_ok.ok, str(lse_ok)


@pytest.mark.parametrize("programs", [None, 1, 7])
@pytest.mark.parametrize("name,variant", GLUON_CASES)
def test_gluon_kernel_on_gpu(name, programs, variant):
    """The sm_90 Gluon kernel's four forms (mla.configs.GLUON_FORMS), each forced on every
    MODEL1 shape (the launch rule picks heads as M for h_q > 16 on grids that fill the GPU, tokens
    as M for h_q <= 16), and its heads-as-M form on every V3.2 shape, on the rule's schedule and on
    1 and 7 persistent programs (7: shares that end mid-query; for the two-consumer form, splits of
    each query)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm_90")
    case = make_case(**SHAPES[name], device="cuda", seed=len(name))

    def fn(**kw):
        return mla.sparse_decode(**kw, plan=mla.plan(**kw, config=GluonConfig(variant), programs=programs))
    out_ok, lse_ok = run_case(fn, case)
    assert out_ok.ok, str(out_ok)
    assert lse_ok.ok, str(lse_ok)


#: the cluster form's own shapes beside SHAPES' MODEL1 ones: 128 heads with s_q 2, both caches and lengths
CLUSTER_SHAPES = {**{n: SHAPES[n] for n in MODEL1_SHAPES},
                  "h128 s_q2 lengths extra": dict(b=3, s_q=2, h_q=128, topk=2048, page=64, extra_topk=128,
                                                  extra_page=2, lengths=True)}


@pytest.mark.parametrize("programs", [None, 1, 7])
@pytest.mark.parametrize("name", list(CLUSTER_SHAPES))
def test_the_cluster_form_matches_the_reference(name, programs):
    """The Gluon kernel's 2-CTA cluster form (mla.kernels.gluon_sm90.cluster) forced on every MODEL1
    shape (fewer than 128 heads leave heads of CTA 1, or all of them, masked), on the rule's
    schedule and on 1 and 7 persistent clusters (7: shares that end mid-query)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm_90")
    if mla.dispatch.gluon_cluster is None:
        pytest.skip("this Triton does not build the cluster form (3.9 does: TRITON_PACK, scripts/device_final.sh)")
    case = make_case(**CLUSTER_SHAPES[name], device="cuda", seed=len(name))

    def fn(**kw):
        plan = mla.plan(**kw, config=ClusterConfig(), programs=programs)
        assert plan.launch.config.kernel == "gluon_cluster"
        return mla.sparse_decode(**kw, plan=plan)
    out_ok, lse_ok = run_case(fn, case)
    assert out_ok.ok, str(out_ok)
    assert lse_ok.ok, str(lse_ok)


@pytest.mark.parametrize("extra,b,h_q", [(False, 16, 64), (True, 16, 64), (True, 128, 8), (False, 1, 64)])
def test_mma_is_captured_in_a_cuda_graph_and_replayed_over_new_indices(extra, b, h_q):
    # on an H200 the launch rule picks the Gluon kernel for each: b 16 x 8 or 10 tiles = 128 or
    # 160 programs, heads as M; 8 heads at b 128, 8 x 128-token tiles; b 1, tokens as M
    shape = dict(topk=128, page=256, extra_topk=512, extra_page=64) if extra else dict(topk=512, page=64)
    case = make_case(b=b, s_q=1, h_q=h_q, num_blocks=256, device="cuda", seed=1, invalid_frac=0.0, **shape)
    res = mla.validate.graph_replay_check(case, replays=3)
    assert res["ok"], res


def test_serving_calls_use_the_shipped_config_on_an_h200():
    if "H200" not in torch.cuda.get_device_name():
        pytest.skip("the shipped table is for the H200")
    from mla import configs

    assert configs.source() == "h200.json"


def test_the_writer_writes_quantize_kvs_bytes_on_the_gpu_and_in_a_cuda_graph():
    """The writer on the GPU (its FP8 rounding and scale exponent in integer arithmetic) against
    quantize_kv, eagerly and replayed from a CUDA graph over new rows and slots."""
    from mla import layout

    nb, page = 64, 61
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = layout.empty_cache(nb, page, device="cuda", fill=0)
    kv = torch.randn(nb * page, 512, device="cuda", generator=g).bfloat16()
    slots = torch.randperm(nb * page, device="cuda", generator=g)
    mla.write_kv(kv, cache, slots)
    want = mla.quantize_kv(torch.empty_like(kv).index_copy_(0, slots, kv).view(nb, page, 512))
    assert torch.equal(layout.cache_bytes(cache), layout.cache_bytes(want))
    rows = torch.randn(256, 512, device="cuda", generator=g).bfloat16()
    where = torch.randperm(nb * page, device="cuda", generator=g)[:256]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mla.write_kv(rows, cache, where)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla.write_kv(rows, cache, where)
    rows.copy_(torch.randn(256, 512, device="cuda", generator=g).bfloat16())
    where.copy_(torch.randperm(nb * page, device="cuda", generator=g)[:256])
    graph.replay()
    torch.cuda.synchronize()
    got = layout.gather_tokens(cache, where)
    assert torch.equal(got, layout.gather_tokens(mla.quantize_kv(rows.view(256, 1, 512)), torch.arange(256,
                                                                                                       device="cuda")))


def test_a_planned_call_is_captured_in_a_cuda_graph_and_replayed_over_new_indices():
    case = make_case(b=8, s_q=1, h_q=64, topk=128, page=256, extra_topk=512, extra_page=64, num_blocks=64,
                     device="cuda", seed=2, invalid_frac=0.05)
    plan = mla.plan(**case)
    out = torch.empty(8, 1, 64, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(8, 64, 1, dtype=torch.float32, device="cuda")
    mla.sparse_decode(**case, plan=plan, out=out, lse=lse)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla.sparse_decode(**case, plan=plan, out=out, lse=lse)
    g = torch.Generator(device="cuda").manual_seed(3)
    for key, n in (("indices", 64 * 256), ("extra_indices", case["extra_k_cache"].shape[0] * 64)):
        case[key].copy_(torch.randint(0, n, case[key].shape, device="cuda", dtype=torch.int32, generator=g))
    graph.replay()
    torch.cuda.synchronize()
    out_ok, lse_ok = mla.validate.check_against_reference(out, lse, *mla.sparse_decode_reference(
        **case, out_dtype=torch.float64))
    assert out_ok.ok and lse_ok.ok, (str(out_ok), str(lse_ok))


@pytest.mark.parametrize("name", ["DSA b4", "V4-CSA b8", "V3.2 b4 h64"])
def test_flashmlas_call_on_mla_equals_sparse_decode(name):
    case = make_case(**SHAPES[name], device="cuda", seed=9)
    meta, _ = mla_flash_mla.get_mla_metadata()
    out, lse = mla_flash_mla.flash_mla_with_kvcache(
        case["q"], case["k_cache"], None, None, 512, meta, None, None, False, True, case["indices"],
        case.get("attn_sink"), case.get("extra_k_cache"), case.get("extra_indices"), case.get("topk_length"),
        case.get("extra_topk_length"))
    want = mla.sparse_decode(**case)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


SERVERS = {
    # SGLang at TP 8: 8 heads, its SWA window of 128 and C4 top-k of 512, two SWA-only and two C4 layers
    "sglang": (sglang_step_inputs, sglang_metadata, sglang_step,
               dict(seq_lens=(5, 130, 900, 4000), heads=8, window=128, c4_topk=512, ratios=(0, 4, 4, 0), swa_pages=16,
                    c4_pages=16)),
    # vLLM at TP 8: 8 heads padded to 64, the same window and top-k, every cache a view of one allocation
    "vllm": (vllm_step_inputs, vllm_metadata, vllm_step,
             dict(seq_lens=(5, 130, 900, 4000), heads=8, padded_heads=64, window=128, topk=512, ratios=(4, 1, 4, 1),
                  swa_blocks=8, c4_blocks=16)),
}


def copy_indices(step: dict, fresh: dict) -> None:
    """The next step's indices and lengths (every int32 tensor of a step and of its layers) into
    this step's tensors, in place, as a server refreshes its captured ones before a replay."""
    for dst, src in ((step, fresh), *zip(step["layers"], fresh["layers"])):
        for key, t in dst.items():
            if isinstance(t, torch.Tensor) and t.dtype == torch.int32:
                t.copy_(src[key])


@pytest.mark.parametrize("server", list(SERVERS))
def test_a_servers_decode_step_on_mla_flash_mla_is_captured_in_a_cuda_graph_and_replayed(server, plans_made):
    """A decode step as SGLang and vLLM run it (tests/test_callsites.py makes their calls), in a
    CUDA graph: a warm-up step outside the capture (it compiles the kernels), then the metadata
    objects made afresh before the capture (SGLang remakes them after its warm-up, vLLM builds
    them for the capture) and shared by the layers, whose first calls plan inside the capture;
    vLLM's out= buffers. The next step's indices and lengths are copied into the captured index
    tensors, the graph replayed, and every call's outputs checked against the reference on the
    new indices; one plan per metadata object."""
    make_inputs, make_metadata, run_step, sizes = SERVERS[server]
    step = make_inputs("cuda", seed=0, **sizes)
    recorder = Recorder()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_step(recorder, step, make_metadata(recorder))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    recorder.calls.clear()
    del plans_made[:]
    metadata = make_metadata(recorder)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_step(recorder, step, metadata)
    assert len(recorder.calls) == len(step["layers"]) and len(plans_made) == len(metadata) == 2
    copy_indices(step, make_inputs("cuda", seed=1, **sizes))
    graph.replay()
    torch.cuda.synchronize()
    check_calls(recorder)


BENCH_SHAPES = {f"{s.name} b{s.b}": s for s in spec_shapes()}


def bench_case(s, seed):
    """make_case at a benchmark shape (valid indices only, as the benchmark draws them)."""
    extra = dict(extra_topk=s.extra_topk, extra_page=s.extra_page) if s.extra_topk else {}
    return make_case(b=s.b, s_q=s.s_q, h_q=s.h_q, topk=s.topk, page=s.page, device="cuda", seed=seed,
                     invalid_frac=0.0, **extra)


def flashmla_call(module, case):
    """FlashMLA's sparse-decode call through ``module`` (mla.flash_mla or FlashMLA's flash_mla)."""
    meta, _ = module.get_mla_metadata()
    return module.flash_mla_with_kvcache(case["q"], case["k_cache"], None, None, 512, meta, is_fp8_kvcache=True,
                                         indices=case["indices"], attn_sink=case["attn_sink"],
                                         extra_k_cache=case.get("extra_k_cache"),
                                         extra_indices_in_kvcache=case.get("extra_indices"))


@pytest.mark.parametrize("name", list(BENCH_SHAPES))
def test_flashmlas_call_on_mla_equals_sparse_decode_at_the_benchmark_shapes(name):
    case = bench_case(BENCH_SHAPES[name], seed=11)
    out, lse = flashmla_call(mla_flash_mla, case)
    want_out, want_lse = mla.sparse_decode(**case)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("name", [n for n, s in BENCH_SHAPES.items() if s.h_q == 64])
def test_flashmla_itself_and_mla_flash_mla_agree_with_the_reference_at_the_benchmark_shapes(name):
    """Where DeepSeek's FlashMLA extension imports (built on the device, not a dependency), its
    call and the same call on mla.flash_mla return the same shapes and dtypes, and both pass the
    contract's check against the float64 reference."""
    flashmla = pytest.importorskip("flash_mla", reason="DeepSeek's FlashMLA extension is not built here")
    case = bench_case(BENCH_SHAPES[name], seed=12)
    ref = mla.sparse_decode_reference(**case, out_dtype=torch.float64)
    for module in (flashmla, mla_flash_mla):
        out, lse = flashmla_call(module, case)
        assert out.shape == case["q"].shape and out.dtype == torch.bfloat16, module.__name__
        assert lse.shape == (case["q"].shape[0], case["q"].shape[2], case["q"].shape[1]), module.__name__
        out_ok, lse_ok = mla.validate.check_against_reference(out, lse, *ref)
        assert out_ok.ok and lse_ok.ok, (module.__name__, str(out_ok), str(lse_ok))


@pytest.mark.parametrize("b,s_q,h_q", [(4, 1, 64), (8, 2, 128), (64, 2, 64)])
def test_flashmla_itself_and_mla_flash_mla_agree_with_the_reference_on_v32(b, s_q, h_q):
    """DeepSeek-V3.2's cache at FlashMLA's V3.2 shapes (top-k 2048 at P 64, a sink), where
    FlashMLA's extension imports: its call and mla.flash_mla's return the 512-wide output and
    both pass the contract's check against the float64 reference. Invalid indices are -1 only
    and neither lengths nor an extra cache are given: FlashMLA's sm_90 V3.2 kernel takes no
    other (it ignores topk_length and refuses an extra cache)."""
    flashmla = pytest.importorskip("flash_mla", reason="DeepSeek's FlashMLA extension is not built here")
    case = make_case(b=b, s_q=s_q, h_q=h_q, topk=2048, page=64, invalid_frac=0.0, device="cuda", seed=13, d_qk=576)
    case["indices"][0, 0, ::7] = -1
    ref = mla.sparse_decode_reference(**case, out_dtype=torch.float64)
    for module in (flashmla, mla_flash_mla):
        out, lse = flashmla_call(module, case)
        assert out.shape == (b, s_q, h_q, 512) and out.dtype == torch.bfloat16, module.__name__
        assert lse.shape == (b, h_q, s_q), module.__name__
        out_ok, lse_ok = mla.validate.check_against_reference(out, lse, *ref)
        assert out_ok.ok and lse_ok.ok, (module.__name__, str(out_ok), str(lse_ok))


def test_a_call_on_strided_inputs_reads_them_in_place():
    """FlashMLA's strided q and indices (s_q outermost in memory) go to the kernels as they are:
    the torch profiler sees only the decode and the combine (no copy kernel), and the result is
    the contiguous call's, bit for bit."""
    case = make_case(b=4, s_q=2, h_q=64, topk=128, page=256, extra_topk=512, extra_page=64, lengths=True,
                     strided=True, device="cuda", seed=3)
    assert not case["q"].is_contiguous() and not case["indices"].is_contiguous()
    meta, _ = mla_flash_mla.get_mla_metadata()

    def call():
        return mla_flash_mla.flash_mla_with_kvcache(
            case["q"], case["k_cache"], None, None, 512, meta, is_fp8_kvcache=True, indices=case["indices"],
            attn_sink=case["attn_sink"], extra_k_cache=case["extra_k_cache"],
            extra_indices_in_kvcache=case["extra_indices"], topk_length=case["topk_length"],
            extra_topk_length=case["extra_topk_length"])
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, lse = call()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels and all("decode_kernel" in k or "combine_kernel" in k for k in kernels), kernels
    dense = {k: (v.contiguous() if torch.is_tensor(v) else v) for k, v in case.items()}
    want_out, want_lse = mla.sparse_decode(**dense)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


# ---------------------------------------------------------------------------------------------
# The sparse prefill (FlashMLA's flash_mla_sparse_fwd)
# ---------------------------------------------------------------------------------------------

#: FlashMLA's prefill cases at their own sizes (tests/test_flash_mla_sparse_prefill.py): an
#: irregular one with both features, one with top-k past s_kv, tokens with no valid position,
#: tiles with none, and one at its performance cases' s_q
PREFILL_SHAPES = {
    "features 1840/256 s_q 213": dict(s_q=213, s_kv=1840, topk=256, h_q=128, sink=True, lengths=True),
    "OOB 114/384 s_q 62": dict(s_q=62, s_kv=114, topk=384, h_q=64, sink=True, lengths=True),
    "all invalid 4321/4096": dict(s_q=64, s_kv=4321, topk=4096, h_q=128, sink=True, lengths=True, empty_frac=0.5),
    "empty tiles 64/8192": dict(s_q=32, s_kv=64, topk=8192, h_q=64, sink=True, lengths=True),
    "V3.2-like s_q 1024": dict(s_q=1024, s_kv=8192, topk=2048, h_q=128, sink=True),
    "h_q 40, N(0, 1)": dict(s_q=100, s_kv=3000, topk=640, h_q=40, sink=True, lengths=True, value_scale=1.0),
}


@pytest.mark.parametrize("d_qk", [512, 576])
@pytest.mark.parametrize("name", list(PREFILL_SHAPES))
def test_prefill_on_gpu(name, d_qk):
    case = mla.validate.make_prefill_case(**PREFILL_SHAPES[name], d_qk=d_qk, device="cuda", seed=len(name))
    for r in mla.validate.run_prefill_case(mla_flash_mla.flash_mla_sparse_fwd, case,
                                           PREFILL_SHAPES[name].get("value_scale", 0.1)):
        assert r.ok, str(r)


@pytest.mark.parametrize("name", ["features 1840/256 s_q 213", "OOB 114/384 s_q 62"])
def test_prefill_with_bf16_operands_on_flashmlas_data(name):
    """PrefillConfig(dot="bfloat16"), FlashMLA's rounding of P, passes on FlashMLA's kind of data
    (values about 0.1; on unit-variance data it would not: experiments/prefill_p_rounding.py)."""
    cfg = dataclasses.replace(mla.dispatch.prefill_config(torch.device("cuda"), 128), dot="bfloat16")
    case = mla.validate.make_prefill_case(**PREFILL_SHAPES[name], d_qk=576, device="cuda", seed=5)
    for r in mla.validate.run_prefill_case(functools.partial(mla.sparse_prefill, config=cfg), case):
        assert r.ok, str(r)


def test_prefill_with_70000_query_tokens():
    """FlashMLA's corner case: s_q 70000 does not fit grid axis 1 or 2 (65535); mla puts it on
    axis 0. The first and last 256 tokens are checked against the reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    s_q, s_kv, topk, h_q = 70000, 256, 256, 128
    q = (torch.randn(s_q, h_q, 512, device="cuda", generator=g) / 10).bfloat16()
    kv = (torch.randn(s_kv, 1, 512, device="cuda", generator=g) / 10).bfloat16()
    idx = torch.rand(s_q, s_kv, device="cuda", generator=g).argsort(-1)[:, None, :topk].int()
    sink = torch.randn(h_q, device="cuda", generator=g)
    length = torch.randint(0, topk + 1, (s_q,), device="cuda", generator=g, dtype=torch.int32)
    out, ml, lse = mla_flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.5, attn_sink=sink, topk_length=length)
    for rows in (slice(0, 256), slice(s_q - 256, s_q)):
        ref = mla.sparse_prefill_reference(q[rows], kv, idx[rows], 0.5, attn_sink=sink, topk_length=length[rows],
                                           out_dtype=torch.float64)
        for r in mla.validate.check_prefill_against_reference(out[rows], ml[rows], lse[rows], *ref):
            assert r.ok, str(r)


def test_prefill_is_captured_in_a_cuda_graph_and_replayed_over_new_indices():
    case = mla.validate.make_prefill_case(s_q=64, s_kv=2048, topk=512, h_q=64, d_qk=576, lengths=True, device="cuda",
                                          seed=2)
    out = torch.empty(64, 64, 512, dtype=torch.bfloat16, device="cuda")
    mla.sparse_prefill(**case, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, ml, lse = mla.sparse_prefill(**case, out=out)
    case["indices"].copy_(torch.rand(64, 2048, device="cuda").argsort(-1)[:, None, :512].int())
    graph.replay()
    torch.cuda.synchronize()
    ref = mla.sparse_prefill_reference(case["q"], case["kv"], case["indices"], case["sm_scale"],
                                       attn_sink=case["attn_sink"], topk_length=case["topk_length"],
                                       out_dtype=torch.float64)
    for r in mla.validate.check_prefill_against_reference(out, ml, lse, *ref):
        assert r.ok, str(r)


@pytest.mark.parametrize("d_qk", [512, 576])
def test_flashmlas_prefill_itself_and_mla_agree_with_the_reference(d_qk):
    """Where DeepSeek's FlashMLA extension imports (on sm_90 and sm_100), its
    flash_mla_sparse_fwd and mla's pass the same checks on the same inputs."""
    flashmla = pytest.importorskip("flash_mla", reason="DeepSeek's FlashMLA extension is not built here")
    case = mla.validate.make_prefill_case(s_q=213, s_kv=1521, topk=512, h_q=128, d_qk=d_qk, sink=True, lengths=True,
                                          device="cuda", seed=4)
    for fn in (flashmla.flash_mla_sparse_fwd, mla_flash_mla.flash_mla_sparse_fwd):
        for r in mla.validate.run_prefill_case(fn, case):
            assert r.ok, (fn.__module__, str(r))
