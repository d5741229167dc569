"""Argument checks: every bad input of the SPEC raises ValueError naming the argument."""
import pytest
import torch

import mla
import mla.kernels
from mla import layout

B, S_Q, H_Q, TOPK, NB, P = 2, 1, 4, 3, 2, 4


def good(**over):
    """Valid arguments for sparse_decode, with ``over`` replacing some."""
    kw = dict(
        q=torch.zeros(B, S_Q, H_Q, 512, dtype=torch.bfloat16),
        k_cache=mla.quantize_kv(torch.zeros(NB, P, 512, dtype=torch.bfloat16)),
        indices=torch.zeros(B, S_Q, TOPK, dtype=torch.int32),
    )
    kw.update(over)
    return kw


def call(**over):
    kw = good(**over)
    q, k, i = kw.pop("q"), kw.pop("k_cache"), kw.pop("indices")
    kw.setdefault("impl", "reference")
    return mla.sparse_decode(q, k, i, **kw)


def extra_cache(p=3):
    return mla.quantize_kv(torch.zeros(NB, p, 512, dtype=torch.bfloat16))


def extra_idx():
    return torch.zeros(B, S_Q, 5, dtype=torch.int32)


def test_good_arguments_pass():
    out, lse = call(attn_sink=torch.zeros(H_Q), topk_length=torch.ones(B, dtype=torch.int32),
                    extra_k_cache=extra_cache(), extra_indices=extra_idx(),
                    extra_topk_length=torch.ones(B, dtype=torch.int32), softmax_scale=0.1)
    assert tuple(out.shape) == (B, S_Q, H_Q, 512) and tuple(lse.shape) == (B, H_Q, S_Q)
    call(softmax_scale=1)          # a Python int is a number too
    call(k_cache=good()["k_cache"].view(torch.uint8))


@pytest.mark.parametrize("b, s_q, h_q", [(1, 1, 1), (2, 1, 4), (1, 3, 1), (3, 2, 128)])
def test_a_call_makes_fresh_contiguous_outputs_of_its_shapes(b, s_q, h_q):
    """Without ``out`` and ``lse`` a call allocates them like its plan's expanded stand-ins: each
    call's are new tensors, contiguous, of the contract's shapes and dtypes (q's strides are not
    copied, whatever q's layout)."""
    q = torch.zeros(b, h_q, s_q, 512, dtype=torch.bfloat16).transpose(1, 2)      # strided q
    kw = dict(q=q, indices=torch.zeros(b, s_q, TOPK, dtype=torch.int32))
    (out, lse), (out2, lse2) = call(**kw), call(**kw)
    assert out.shape == (b, s_q, h_q, 512) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert out.stride() == torch.empty(b, s_q, h_q, 512).stride()
    assert lse.shape == (b, h_q, s_q) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert out.data_ptr() != out2.data_ptr() and lse.data_ptr() != lse2.data_ptr()


def _strided_cache(stride0, nb=NB, p=P, extra=0):
    buf = torch.zeros((nb - 1) * stride0 + p * 584 + extra, dtype=torch.uint8)
    return buf.as_strided((nb, p, 1, 584), (stride0, 584, 584, 1))


def test_unpadded_page_stride_is_accepted():
    # stride(0) = P*584 = 2336 (no padding) is large enough: kernels take the stride from the tensor
    call(k_cache=_strided_cache(P * 584))


Q_BAD = {
    "dtype": torch.zeros(B, S_Q, H_Q, 512, dtype=torch.float16),
    "fp32": torch.zeros(B, S_Q, H_Q, 512, dtype=torch.float32),
    "rank3": torch.zeros(B, H_Q, 512, dtype=torch.bfloat16),
    "rank5": torch.zeros(B, S_Q, H_Q, 1, 512, dtype=torch.bfloat16),
    "head_dim_448": torch.zeros(B, S_Q, H_Q, 448, dtype=torch.bfloat16),
    "h_q_129": torch.zeros(B, S_Q, 129, 512, dtype=torch.bfloat16),
    "h_q_0": torch.zeros(B, S_Q, 0, 512, dtype=torch.bfloat16),
    "not_a_tensor": [[0.0] * 512],
}


@pytest.mark.parametrize("case", list(Q_BAD))
def test_q(case):
    with pytest.raises(ValueError, match="^q:"):
        call(q=Q_BAD[case])


def v32_cache(p=P):
    return mla.quantize_kv(torch.zeros(NB, p, 576, dtype=torch.bfloat16))


def v32(**over):
    """Valid V3.2 arguments: q 576 wide, a 656-byte cache."""
    return dict(dict(q=torch.zeros(B, S_Q, H_Q, 576, dtype=torch.bfloat16), k_cache=v32_cache()), **over)


def test_good_v32_arguments_pass():
    out, lse = call(**v32(attn_sink=torch.zeros(H_Q), topk_length=torch.ones(B, dtype=torch.int32),
                          extra_k_cache=v32_cache(3), extra_indices=extra_idx(),
                          extra_topk_length=torch.ones(B, dtype=torch.int32)))
    assert tuple(out.shape) == (B, S_Q, H_Q, 512) and tuple(lse.shape) == (B, H_Q, S_Q)   # V is 512 wide
    call(**v32(k_cache=v32_cache().view(torch.uint8)))


@pytest.mark.parametrize("kw, arg", [
    (dict(q=torch.zeros(B, S_Q, H_Q, 576, dtype=torch.bfloat16)), "k_cache"),           # a MODEL1 cache
    (dict(k_cache=v32_cache()), "k_cache"),                                             # a 512-wide q
    (v32(extra_k_cache=extra_cache(), extra_indices=extra_idx()), "extra_k_cache"),    # a MODEL1 extra cache
    (dict(extra_k_cache=v32_cache(), extra_indices=extra_idx()), "extra_k_cache"),
])
def test_a_cache_of_the_other_layout_than_qs_head_dim_names_is_refused(kw, arg):
    """q's head dim names the layout (512 MODEL1, 576 V3.2), as in FlashMLA; a cache of the
    other layout is the argument named."""
    with pytest.raises(ValueError, match=f"^{arg}: .*-byte tokens are the .* layout"):
        call(**kw)


def test_q_h_q_128_is_accepted():
    call(q=torch.zeros(B, S_Q, 128, 512, dtype=torch.bfloat16))
    call(q=torch.zeros(B, S_Q, 1, 512, dtype=torch.bfloat16))


def _short_storage_cache():
    # 2 pages of stride 2880 span 2880 + 2336 = 5216 bytes; shrink the storage to 5215 after the
    # view is made (torch refuses to make such a view directly).
    t = torch.zeros(2880 + 2336, dtype=torch.uint8).as_strided((NB, P, 1, 584), (2880, 584, 584, 1))
    t.untyped_storage().resize_(2880 + 2335)
    return t


def _cache_bad():
    k = good()["k_cache"]
    return {
        "dtype_bf16": torch.zeros(NB, P, 1, 584, dtype=torch.bfloat16),
        "dtype_int8": k.view(torch.int8),
        "rank3": torch.zeros(NB, P, 584, dtype=torch.uint8),
        "rank5": torch.zeros(NB, P, 1, 1, 584, dtype=torch.uint8),
        "two_heads": torch.zeros(NB, P, 2, 584, dtype=torch.uint8),
        "576_bytes": torch.zeros(NB, P, 1, 576, dtype=torch.uint8),
        "656_bytes": torch.zeros(NB, P, 1, 656, dtype=torch.uint8),
        "zero_blocks": torch.zeros(0, P, 1, 584, dtype=torch.uint8),
        # page stride 2335 < P*584 = 2336
        "stride_too_small": _strided_cache(P * 584 - 1),
        # page stride 1152 (V3.2-ish / a P=2 stride) for a P=4 cache
        "stride_of_smaller_page": _strided_cache(layout.page_stride(2)),
        # the pages reach past the end of storage: 2 pages of stride 2880 need 2880 + 2336 bytes
        "storage_too_short": _short_storage_cache(),
        "last_dim_not_contiguous": torch.zeros(NB, P, 1, 2 * 584, dtype=torch.uint8)[..., ::2],
        "not_a_tensor": "cache",
    }


@pytest.mark.parametrize("case", list(_cache_bad()))
def test_k_cache(case):
    with pytest.raises(ValueError, match="^k_cache:"):
        call(k_cache=_cache_bad()[case])


def test_k_cache_page_stride_message():
    with pytest.raises(ValueError, match="^k_cache: page stride too small"):
        call(k_cache=_strided_cache(P * 584 - 1))


IND_BAD = {
    "int64": torch.zeros(B, S_Q, TOPK, dtype=torch.int64),
    "float": torch.zeros(B, S_Q, TOPK, dtype=torch.float32),
    "uint32": torch.zeros(B, S_Q, TOPK, dtype=torch.uint32),
    "rank2": torch.zeros(B, TOPK, dtype=torch.int32),
    "rank4": torch.zeros(B, S_Q, 1, TOPK, dtype=torch.int32),
    "batch_mismatch": torch.zeros(B + 1, S_Q, TOPK, dtype=torch.int32),
    "s_q_mismatch": torch.zeros(B, S_Q + 1, TOPK, dtype=torch.int32),
    "topk_0": torch.zeros(B, S_Q, 0, dtype=torch.int32),
    "not_a_tensor": [[[0]]],
}


@pytest.mark.parametrize("case", list(IND_BAD))
def test_indices(case):
    with pytest.raises(ValueError, match="^indices:"):
        call(indices=IND_BAD[case])


@pytest.mark.parametrize("case", list(IND_BAD))
def test_extra_indices(case):
    with pytest.raises(ValueError, match="^extra_indices:"):
        call(extra_k_cache=extra_cache(), extra_indices=IND_BAD[case])


@pytest.mark.parametrize("case", list(_cache_bad()))
def test_extra_k_cache(case):
    with pytest.raises(ValueError, match="^extra_k_cache:"):
        call(extra_k_cache=_cache_bad()[case], extra_indices=extra_idx())


SINK_BAD = {
    "bf16": torch.zeros(H_Q, dtype=torch.bfloat16),
    "float64": torch.zeros(H_Q, dtype=torch.float64),
    "too_short": torch.zeros(H_Q - 1),
    "too_long": torch.zeros(H_Q + 1),
    "rank2": torch.zeros(1, H_Q),
    "scalar": torch.zeros(()),
    "python_list": [0.0] * H_Q,
}


@pytest.mark.parametrize("case", list(SINK_BAD))
def test_attn_sink(case):
    with pytest.raises(ValueError, match="^attn_sink:"):
        call(attn_sink=SINK_BAD[case])


LEN_BAD = {
    "int64": torch.zeros(B, dtype=torch.int64),
    "float": torch.zeros(B),
    "wrong_b": torch.zeros(B + 1, dtype=torch.int32),
    "rank2": torch.zeros(B, 1, dtype=torch.int32),
    "scalar": torch.zeros((), dtype=torch.int32),
    "python_int": 3,
}


@pytest.mark.parametrize("case", list(LEN_BAD))
def test_topk_length(case):
    with pytest.raises(ValueError, match="^topk_length:"):
        call(topk_length=LEN_BAD[case])


@pytest.mark.parametrize("case", list(LEN_BAD))
def test_extra_topk_length(case):
    with pytest.raises(ValueError, match="^extra_topk_length:"):
        call(extra_k_cache=extra_cache(), extra_indices=extra_idx(), extra_topk_length=LEN_BAD[case])


def test_extra_k_cache_without_extra_indices():
    with pytest.raises(ValueError, match="^extra_indices:"):
        call(extra_k_cache=extra_cache())


def test_extra_indices_without_extra_k_cache():
    with pytest.raises(ValueError, match="^extra_k_cache:"):
        call(extra_indices=extra_idx())


def test_extra_topk_length_without_extra_cache():
    with pytest.raises(ValueError, match="^extra_topk_length:"):
        call(extra_topk_length=torch.ones(B, dtype=torch.int32))


@pytest.mark.parametrize("impl", ["MMA", "triton", "", None, "flashmla"])
def test_bad_impl(impl):
    with pytest.raises(ValueError, match="^impl:"):
        call(impl=impl)


@pytest.mark.parametrize("scale", [torch.tensor(0.1), "0.1", object(), [0.1], 1j, True,
                                   float("nan"), float("inf"), 0.0, -0.1])
def test_softmax_scale_type(scale):
    with pytest.raises(ValueError, match="^softmax_scale:"):
        call(softmax_scale=scale)


# Device mismatch: the "meta" device makes tensors with no data, enough for the checks (which
# run before any computation), so the mismatch can be tested on a CPU-only machine.
META = torch.device("meta")


@pytest.mark.parametrize("arg", ["k_cache", "indices", "attn_sink", "topk_length",
                                 "extra_k_cache", "extra_indices", "extra_topk_length"])
def test_device_mismatch(arg):
    kw = dict(attn_sink=torch.zeros(H_Q), topk_length=torch.ones(B, dtype=torch.int32),
              extra_k_cache=extra_cache(), extra_indices=extra_idx(),
              extra_topk_length=torch.ones(B, dtype=torch.int32))
    kw = good(**kw)
    kw[arg] = kw[arg].to(META)
    with pytest.raises(ValueError, match=f"^{arg}: device mismatch"):
        call(**kw)


def test_device_mismatch_q_elsewhere():
    # q on meta, everything else on the CPU: the first other tensor checked is named.
    with pytest.raises(ValueError, match="^k_cache: device mismatch"):
        call(q=good()["q"].to(META))


# --------------------------------------------------------------------------------------------
# quantize_kv / dequantize_kv input checks
# --------------------------------------------------------------------------------------------

KV_BAD = {
    "float32": torch.zeros(NB, P, 512),
    "float16": torch.zeros(NB, P, 512, dtype=torch.float16),
    "rank2": torch.zeros(P, 512, dtype=torch.bfloat16),
    "rank5": torch.zeros(NB, P, 1, 1, 512, dtype=torch.bfloat16),
    "two_heads": torch.zeros(NB, P, 2, 512, dtype=torch.bfloat16),
    "640_wide": torch.zeros(NB, P, 640, dtype=torch.bfloat16),        # neither 512 (MODEL1) nor 576 (V3.2)
    "inf": torch.zeros(NB, P, 512, dtype=torch.bfloat16).index_fill_(2, torch.tensor([3]), float("inf")),
    "-inf_rope": torch.zeros(NB, P, 512, dtype=torch.bfloat16).index_fill_(2, torch.tensor([500]), -float("inf")),
    "nan": torch.zeros(NB, P, 512, dtype=torch.bfloat16).index_fill_(2, torch.tensor([0]), float("nan")),
}


@pytest.mark.parametrize("case", list(KV_BAD))
def test_quantize_kv_rejects(case):
    with pytest.raises(ValueError, match="^kv:"):
        mla.quantize_kv(KV_BAD[case])


def test_quantize_kv_rejects_non_tensor():
    with pytest.raises(ValueError, match="^kv"):
        mla.quantize_kv([[0.0] * 512])


@pytest.mark.parametrize("case", ["dtype_bf16", "rank3", "576_bytes", "stride_too_small"])
def test_dequantize_kv_rejects(case):
    with pytest.raises(ValueError, match="^k_cache:"):
        mla.dequantize_kv(_cache_bad()[case])


# --------------------------------------------------------------------------------------------
# impl dispatch
# --------------------------------------------------------------------------------------------

def test_check_inputs_is_public_and_silent_on_good_input():
    kw = good()
    assert mla.check_inputs(kw["q"], kw["k_cache"], kw["indices"]) is None
