"""The sparse prefill (FlashMLA's ``flash_mla_sparse_fwd``) on the CPU interpreter: the float64
reference against numbers worked out by hand, the Triton kernel against the reference at
FlashMLA's kinds of cases scaled down (with FlashMLA's tolerances), the argument checks, the grid,
and vLLM's DeepSeek-V4 call."""
import functools
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import mla
import mla.flash_mla as flash_mla
from mla import configs, dispatch
from mla.configs import PrefillConfig
from mla.kernels import prefill
from mla.reference import sparse_prefill_reference
from mla.validate import compare, make_prefill_case, run_prefill_case
from mla.validate.compare import PREFILL_OUT_ABS, PREFILL_OUT_COS, PREFILL_OUT_REL

# ---------------------------------------------------------------------------------------------
# The reference, by hand
# ---------------------------------------------------------------------------------------------


def _kv_rows(d_qk, rows):
    """kv [len(rows), 1, d_qk] float64: row r is ``a`` in column 0, ``b`` in column 1 and, at
    d_qk 576, ``c`` in column 512 (a column only Q.K^T sees)."""
    kv = torch.zeros(len(rows), 1, d_qk, dtype=torch.float64)
    for i, (a, b, c) in enumerate(rows):
        kv[i, 0, 0], kv[i, 0, 1] = a, b
        if d_qk == 576:
            kv[i, 0, 512] = c
    return kv


@pytest.mark.parametrize("d_qk", [512, 576])
def test_reference_by_hand(d_qk):
    # one query token, one head, q = (1, 2, ..., 3 in column 512); rows 0 and 2 are valid, the
    # other two positions name -1 and s_kv = 3 (invalid). Scores, scale 0.5:
    #   row 0: (1*1 + 2*0 + 3*c0) / 2,  row 2: (1*0 + 2*1 + 3*c2) / 2
    c0, c2 = (1.0, -1.0) if d_qk == 576 else (0.0, 0.0)
    kv = _kv_rows(d_qk, [(1.0, 0.0, c0), (5.0, 5.0, 5.0), (0.0, 1.0, c2)])
    q = torch.zeros(1, 1, d_qk, dtype=torch.float64)
    q[0, 0, 0], q[0, 0, 1] = 1.0, 2.0
    if d_qk == 576:
        q[0, 0, 512] = 3.0
    idx = torch.tensor([[[0, -1, 2, 3]]], dtype=torch.int32)
    s0, s2 = (1 + 3 * c0) / 2, (2 + 3 * c2) / 2
    lse = math.log(math.exp(s0) + math.exp(s2))
    p0, p2 = math.exp(s0 - lse), math.exp(s2 - lse)
    out, ml, got_lse = sparse_prefill_reference(q, kv, idx, 0.5, out_dtype=torch.float64)
    assert got_lse.item() == pytest.approx(lse, abs=1e-6) and ml.item() == pytest.approx(max(s0, s2), abs=1e-7)
    # V is the first 512 columns: (p0 * 1, p2 * 1) in columns 0 and 1, zeros elsewhere
    assert out.shape == (1, 1, 512)
    assert out[0, 0, 0].item() == pytest.approx(p0) and out[0, 0, 1].item() == pytest.approx(p2)
    assert out[0, 0, 2:].abs().max().item() == 0.0
    # the sink scales out by 1 / (1 + exp(sink - lse)) and leaves lse and max_logits alone
    sink = torch.tensor([0.25], dtype=torch.float32)
    out_s, ml_s, lse_s = sparse_prefill_reference(q, kv, idx, 0.5, attn_sink=sink, out_dtype=torch.float64)
    f = 1 / (1 + math.exp(0.25 - lse))
    assert out_s[0, 0, 0].item() == pytest.approx(p0 * f) and out_s[0, 0, 1].item() == pytest.approx(p2 * f)
    assert (ml_s.item(), lse_s.item()) == (ml.item(), got_lse.item())
    # +inf: zeros; -inf: no effect
    out_inf = sparse_prefill_reference(q, kv, idx, 0.5, attn_sink=torch.tensor([math.inf]), out_dtype=torch.float64)[0]
    out_ninf = sparse_prefill_reference(q, kv, idx, 0.5, attn_sink=torch.tensor([-math.inf]),
                                        out_dtype=torch.float64)[0]
    assert out_inf.abs().max().item() == 0.0 and torch.equal(out_ninf, out)
    # topk_length 1 keeps position 0 only: out is row 0's V, lse and max_logits its score
    out_1, ml_1, lse_1 = sparse_prefill_reference(q, kv, idx, 0.5, topk_length=torch.tensor([1], dtype=torch.int32),
                                                  out_dtype=torch.float64)
    assert out_1[0, 0, 0].item() == pytest.approx(1.0) and out_1[0, 0, 1].item() == 0.0
    assert lse_1.item() == pytest.approx(s0) and ml_1.item() == pytest.approx(s0)


def test_reference_of_a_token_with_no_valid_position():
    # FlashMLA's ref.py: out 0, max_logits -inf, lse +inf, whatever the sink (finite, +-inf)
    q = torch.ones(2, 3, 512, dtype=torch.bfloat16)
    kv = torch.ones(4, 1, 512, dtype=torch.bfloat16)
    idx = torch.tensor([[[-1, 4, 2 ** 31 - 1]], [[0, 1, 2]]], dtype=torch.int32)
    length = torch.tensor([3, 0], dtype=torch.int32)          # the second token's positions are all cut
    out, ml, lse = sparse_prefill_reference(q, kv, idx, 0.1, attn_sink=torch.tensor([0.0, math.inf, -math.inf]),
                                            topk_length=length)
    assert out.abs().max().item() == 0.0
    assert torch.isneginf(ml).all() and torch.isposinf(lse).all()


# ---------------------------------------------------------------------------------------------
# The kernel against the reference, at FlashMLA's kinds of cases (tests/test_flash_mla_sparse_prefill.py)
# ---------------------------------------------------------------------------------------------

#: scaled down from FlashMLA's lists: regular shapes, irregular ones, top-k past s_kv (the rest of
#: the positions invalid), the features (sink, topk_length), tokens with no valid position, tiles
#: with none (s_kv 32, top-k 512), and head counts FlashMLA does not take
CASES = {
    "regular 128/128 s_q 1": dict(s_q=1, s_kv=128, topk=128, h_q=128),
    "regular 256/256": dict(s_q=3, s_kv=256, topk=256, h_q=64),
    "irregular 592/128": dict(s_q=5, s_kv=592, topk=128, h_q=64),
    "irregular 1521/192": dict(s_q=3, s_kv=1521, topk=192, h_q=128),
    "OOB top-k 95/128": dict(s_q=4, s_kv=95, topk=128, h_q=64),
    "features 153/256": dict(s_q=3, s_kv=153, topk=256, h_q=128, sink=True, lengths=True),
    "features 1592/96": dict(s_q=6, s_kv=1592, topk=96, h_q=64, sink=True, lengths=True, invalid_frac=0.3),
    "all invalid": dict(s_q=4, s_kv=128, topk=128, h_q=64, sink=True, lengths=True, empty_frac=0.5),
    "empty tiles 32/512": dict(s_q=2, s_kv=32, topk=512, h_q=64, sink=True, lengths=True),
    "h_q 1": dict(s_q=3, s_kv=100, topk=70, h_q=1, sink=True, lengths=True),
    "h_q 20, N(0, 1) data": dict(s_q=3, s_kv=300, topk=130, h_q=20, sink=True, value_scale=1.0),
    "h_q 100, contiguous": dict(s_q=2, s_kv=200, topk=64, h_q=100, sink=True, strided=False),
}


@pytest.mark.parametrize("d_qk", [512, 576])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_reference(name, d_qk):
    kw = dict(sink=False, **CASES[name]) if "sink" not in CASES[name] else CASES[name]
    case = make_prefill_case(**kw, d_qk=d_qk, seed=len(name) + d_qk)
    for r in run_prefill_case(flash_mla.flash_mla_sparse_fwd, case, CASES[name].get("value_scale", 0.1)):
        assert r.ok, str(r)


def test_unit_variance_data_widens_only_the_logits_absolute_bound():
    """On N(0, 1) data a logit's float32 rounding is about 100 times FlashMLA's data's (values
    about 0.1): an H100 left 4.2e-5 on a max_logit of 0.77 at d_qk 576, past FlashMLA's bound of
    1e-6 or 3.1e-5 relative, inside 100 times it. The relative bound and out's stay as they are."""
    ref = torch.tensor([0.77, 30.0], dtype=torch.float64)
    got = (ref + torch.tensor([4.2e-5, 0.0], dtype=torch.float64)).float()
    out = torch.ones(2, 512, dtype=torch.float64)
    args = (out.bfloat16(), got, got, out, ref, ref)
    assert [r.ok for r in mla.validate.check_prefill_against_reference(*args)] == [True, False, False]
    assert [r.ok for r in mla.validate.check_prefill_against_reference(*args, logit_scale=100.0)] == [True, True, True]
    far = (ref * (1 + 1e-3)).float()             # relative error 1e-3 on a large logit fails either way
    assert not mla.validate.check_prefill_against_reference(out.bfloat16(), far, far, out, ref, ref,
                                                       logit_scale=100.0)[1].ok


@pytest.mark.parametrize("arch", sorted(configs.PREFILL))
def test_the_gpu_configs_tiles_under_the_interpreter(arch):
    """Each architecture's tiles (the interpreter's own are 128 x 128): several head blocks per
    token (100 heads: 2 or 4 blocks, the last one part empty) and several token tiles (top-k
    200)."""
    case = make_prefill_case(s_q=2, s_kv=300, topk=200, h_q=100, d_qk=576, lengths=True, seed=7)
    for r in run_prefill_case(functools.partial(mla.sparse_prefill, config=configs.PREFILL[arch]), case):
        assert r.ok, str(r)


def test_the_reference_impl_passes_the_same_checks():
    case = make_prefill_case(s_q=3, s_kv=95, topk=128, h_q=16, d_qk=576, lengths=True, seed=3)
    for r in run_prefill_case(lambda **kw: mla.sparse_prefill(**kw, impl="reference"), case):
        assert r.ok, str(r)


def test_the_checks_catch_a_wrong_answer():
    # the harness is not vacuous: out 0.8% too large everywhere (inside the elementwise bounds,
    # outside the cosine one) and lse off by 1e-4 of itself (past 2.01/65536) fail
    case = make_prefill_case(s_q=2, s_kv=64, topk=64, h_q=16, seed=4)

    def off(**kw):
        out, ml, lse = mla.sparse_prefill(**kw)
        return out * (1 + 2 ** -7), ml, lse * (1 + 1e-4)
    out_ok, ml_ok, lse_ok = run_prefill_case(off, case)
    assert not out_ok.ok and ml_ok.ok and not lse_ok.ok


def test_nan_in_rows_that_are_not_read_does_not_leak():
    """Rows that no valid position names are NaN, and so are the rows that the positions past a
    token's topk_length name (valid indices; FlashMLA's kernel may read those, ours must not):
    the answer is finite and the same, bit for bit, as with those rows zero."""
    g = torch.Generator().manual_seed(5)
    s_q, s_kv, topk, h_q = 3, 200, 128, 32
    q = (torch.randn(s_q, h_q, 576, generator=g) / 10).bfloat16()
    kv = (torch.randn(s_kv, 1, 576, generator=g) / 10).bfloat16()
    idx = torch.stack([torch.randperm(s_kv, generator=g)[:topk] for _ in range(s_q)]).view(s_q, 1, topk).int()
    idx[0, 0, 5] = -1
    length = torch.tensor([100, 64, 1], dtype=torch.int32)
    read = torch.zeros(s_kv, dtype=torch.bool)
    for s in range(s_q):
        row = idx[s, 0, :length[s]]
        read[row[row >= 0].long()] = True
    assert (~read).sum() > s_kv // 3
    zeroed, poisoned = kv.clone(), kv.clone()
    zeroed[~read], poisoned[~read] = 0.0, float("nan")
    sink = torch.full((h_q,), 0.5)
    a = mla.sparse_prefill(q, zeroed, idx, 0.3, attn_sink=sink, topk_length=length)
    b = mla.sparse_prefill(q, poisoned, idx, 0.3, attn_sink=sink, topk_length=length)
    assert all(torch.isfinite(t).all() for t in b)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def _good(d_qk=512, s_q=2, h_q=4, s_kv=8, topk=4):
    return dict(q=torch.zeros(s_q, h_q, d_qk, dtype=torch.bfloat16), kv=torch.zeros(s_kv, 1, d_qk, dtype=torch.bfloat16),
                indices=torch.zeros(s_q, 1, topk, dtype=torch.int32), sm_scale=0.5,
                attn_sink=torch.zeros(h_q), topk_length=torch.zeros(s_q, dtype=torch.int32))


BAD = {
    "q dtype": ("q", lambda a: a.update(q=a["q"].half()), "dtype"),
    "q rank": ("q", lambda a: a.update(q=a["q"][None]), "rank 3"),
    "q head dim": ("q", lambda a: a.update(q=torch.zeros(2, 4, 256, dtype=torch.bfloat16)), "d_qk"),
    "q too many heads": ("q", lambda a: a.update(q=torch.zeros(2, 129, 512, dtype=torch.bfloat16),
                                                  attn_sink=None), "h_q <= 128"),
    "q last dim strided": ("q", lambda a: a.update(q=torch.zeros(2, 4, 1024, dtype=torch.bfloat16)[..., ::2]),
                           "contiguous"),
    "kv dtype": ("kv", lambda a: a.update(kv=a["kv"].float()), "dtype"),
    "kv head dim mismatch": ("kv", lambda a: a.update(kv=torch.zeros(8, 1, 576, dtype=torch.bfloat16)), "mismatch"),
    "h_q not a multiple of h_kv": ("kv", lambda a: a.update(kv=torch.zeros(8, 3, 512, dtype=torch.bfloat16)),
                                   "multiple"),
    "h_kv 2": ("kv", lambda a: a.update(kv=torch.zeros(8, 2, 512, dtype=torch.bfloat16)), "h_kv = 1"),
    "kv on another device": ("kv", lambda a: a.update(kv=a["kv"].to("meta")), "device"),
    "indices dtype": ("indices", lambda a: a.update(indices=a["indices"].long()), "int32"),
    "indices rank": ("indices", lambda a: a.update(indices=a["indices"][:, 0]), "rank 3"),
    "indices s_q mismatch": ("indices", lambda a: a.update(indices=torch.zeros(3, 1, 4, dtype=torch.int32)), "s_q"),
    "indices h_kv mismatch": ("indices", lambda a: a.update(indices=torch.zeros(2, 2, 4, dtype=torch.int32)), "h_kv"),
    "sm_scale a tensor": ("sm_scale", lambda a: a.update(sm_scale=torch.tensor(0.5)), "float"),
    "sm_scale nan": ("sm_scale", lambda a: a.update(sm_scale=math.nan), "finite"),
    "d_v 256": ("d_v", lambda a: a.update(d_v=256), "512"),
    "sink shape": ("attn_sink", lambda a: a.update(attn_sink=torch.zeros(5)), "h_q"),
    "sink dtype": ("attn_sink", lambda a: a.update(attn_sink=torch.zeros(4, dtype=torch.bfloat16)), "float32"),
    "length shape": ("topk_length", lambda a: a.update(topk_length=torch.zeros(3, dtype=torch.int32)), "s_q"),
    "length dtype": ("topk_length", lambda a: a.update(topk_length=torch.zeros(2)), "int32"),
    "length on another device": ("topk_length", lambda a: a.update(topk_length=a["topk_length"].to("meta")), "device"),
    "out shape": ("out", lambda a: a.update(out=torch.zeros(2, 4, 576, dtype=torch.bfloat16)), "shape"),
    "out dtype": ("out", lambda a: a.update(out=torch.zeros(2, 4, 512)), "bfloat16"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_a_value_error_naming_the_argument(name):
    arg, change, words = BAD[name]
    a = _good()
    change(a)
    with pytest.raises(ValueError, match=rf"^{arg}: .*{words}"):
        flash_mla.flash_mla_sparse_fwd(**a)


def test_flash_mla_sparse_fwd_has_flashmlas_signature():
    # FlashMLA's flash_mla/flash_mla_interface.py, then the out= that vLLM's copy adds
    params = inspect.signature(flash_mla.flash_mla_sparse_fwd).parameters
    assert [(p.name, p.default) for p in params.values()] == [
        ("q", inspect.Parameter.empty), ("kv", inspect.Parameter.empty), ("indices", inspect.Parameter.empty),
        ("sm_scale", inspect.Parameter.empty), ("d_v", 512), ("attn_sink", None), ("topk_length", None), ("out", None)]


# ---------------------------------------------------------------------------------------------
# The launch
# ---------------------------------------------------------------------------------------------


def test_query_tokens_go_on_grid_axis_0():
    """FlashMLA's 70000-token case: s_q on axis 0 (up to 2**31 - 1), not on axis 1 or 2 (65535
    at most); the dispatch launches exactly that grid."""
    grid, kw = prefill.launch_params(70000, 128, 576, block_h=64, block_n=64, num_warps=8, num_stages=2, dot=None)
    assert grid == (70000, 2) and kw["D_QK"] == 576 and kw["BLOCK_H"] == 64
    seen = []

    class Stub:
        def __getitem__(self, grid):
            seen.append(grid)
            return lambda *args, **kw: None

    real = prefill.sparse_prefill_kernel
    prefill.sparse_prefill_kernel = Stub()
    try:
        mla.sparse_prefill(torch.zeros(70000, 1, 512, dtype=torch.bfloat16), torch.zeros(1, 1, 512, dtype=torch.bfloat16),
                           torch.zeros(70000, 1, 1, dtype=torch.int32), 0.5)
    finally:
        prefill.sparse_prefill_kernel = real
    assert seen == [(70000, 1)]


def test_the_configs_per_architecture():
    # heads as M, 64 on Hopper (FlashMLA's B_H), fewer where the compile says so (tests/test_aot.py)
    assert configs.prefill_config(90) == PrefillConfig(64, 64, 8, 2, "float16")
    assert configs.prefill_config(86) == configs.prefill_config(89) == PrefillConfig(32, 32)
    assert configs.prefill_config(90).for_heads(20).block_h == 32
    assert configs.prefill_config(90).for_heads(1).block_h == 16
    assert dispatch.prefill_config(torch.device("cpu"), 128) == configs.PREFILL_INTERPRETER
    assert dispatch.prefill_config(torch.device("cpu"), 100).block_h == 128
    with pytest.raises(ValueError, match="dot"):
        PrefillConfig(dot="float32")


def test_a_config_is_for_the_kernel_only():
    a = _good()
    with pytest.raises(ValueError, match="^config: "):
        mla.sparse_prefill(**a, impl="reference", config=PrefillConfig())
    with pytest.raises(ValueError, match="^config: "):
        mla.sparse_prefill(**a, config=configs.TlDotConfig())


# ---------------------------------------------------------------------------------------------
# vLLM's call
# ---------------------------------------------------------------------------------------------


def test_vllms_deepseek_v4_prefill_call():
    """The call of ``DeepseekV4MLAAttention._forward_prefill`` in vLLM's
    ``vllm/model_executor/layers/deepseek_v4_attention.py`` (vllm-project/vllm at
    b92a330e057db9b8c2895ba862de2a03589adce8), made as it is made there: all keywords; ``q`` a
    slice of the step's query rows after the decode tokens, its heads padded to 64 with zeros;
    ``kv`` the bf16 gather workspace ``[PREFILL_CHUNK_SIZE, M, 512]`` viewed as ``[-1, 1, 512]``;
    ``indices`` the combined top-k and window indices ``[n, topk]`` unsqueezed to ``[n, 1,
    topk]``; the layer's scale and its sink (padded with -inf); ``topk_length`` the combined
    lengths; ``out`` the matching slice of the padded output buffer, written in place and
    returned first."""
    g = torch.Generator().manual_seed(6)
    n_local_heads, padded_heads, head_dim, chunk, M = 48, 64, 512, 4, 96
    num_decode_tokens, num_tokens, query_start, query_end, topk = 2, 9, 1, 6, 80
    q_all = (torch.randn(num_tokens, n_local_heads, head_dim, generator=g) / 10).bfloat16()
    q_all = F.pad(q_all, (0, 0, 0, padded_heads - n_local_heads), value=0.0)
    o_padded = torch.full((num_tokens, padded_heads, head_dim), 7.0, dtype=torch.bfloat16)
    q, output = q_all[num_decode_tokens:], o_padded[num_decode_tokens:]
    kv = (torch.randn(chunk, M, head_dim, generator=g) / 10).bfloat16()
    n = query_end - query_start
    combined_indices = torch.randint(-1, chunk * M, (n, topk), generator=g, dtype=torch.int32)
    combined_lens = torch.randint(1, topk + 1, (n,), generator=g, dtype=torch.int32)
    attn_sink = F.pad(torch.randn(n_local_heads, generator=g), (0, padded_heads - n_local_heads), value=-math.inf)
    scale = head_dim ** -0.5

    output_chunk, _, _ = flash_mla.flash_mla_sparse_fwd(
        q=q[query_start:query_end],
        kv=kv.view(-1, 1, q.shape[-1]),
        indices=combined_indices.unsqueeze(1),
        sm_scale=scale,
        attn_sink=attn_sink,
        topk_length=combined_lens,
        out=output[query_start:query_end],
    )
    assert output_chunk.data_ptr() == output[query_start:query_end].data_ptr()
    start, end = num_decode_tokens + query_start, num_decode_tokens + query_end
    assert (o_padded[:start] == 7.0).all() and (o_padded[end:] == 7.0).all()     # nothing else written
    ref_out, ref_max, ref_lse = sparse_prefill_reference(q[query_start:query_end], kv.view(-1, 1, head_dim),
                                                         combined_indices.unsqueeze(1), scale, attn_sink=attn_sink,
                                                         topk_length=combined_lens, out_dtype=torch.float64)
    ok = compare("out", o_padded[start:end].float(), ref_out, PREFILL_OUT_ABS, PREFILL_OUT_REL, PREFILL_OUT_COS)
    assert ok.ok, str(ok)
