"""The SPEC's decode semantics, on tiny cases whose answers are worked out by hand.

Caches are built with ``mla.quantize_kv`` from bf16 values that FP8 represents exactly (each
case asserts that), and every byte that no valid index refers to -- other tokens, stride
padding -- is overwritten with 0x7F (fp8 NaN), so a leak would show up as NaN.

Most cases use softmax_scale = ln 3 with q.k in {0, 1}: scores ln 3 and 0 give softmax
weights 3/4 and 1/4 and lse = ln(3 + 1) = ln 4.
"""
import math

import pytest
import torch

import mla
from mla import layout
from mla.layout import MODEL1, V32

LN3, LN4, LN12 = math.log(3.0), math.log(4.0), math.log(12.0)
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


def _ref32(*args, **kw):
    return mla.sparse_decode(*args, impl="reference", **kw)


def _ref64(*args, **kw):
    return mla.sparse_decode_reference(*args, **kw)


IMPLS = pytest.mark.parametrize("decode", [_ref32, _ref64], ids=["sparse_decode-reference", "reference-f64"])
#: both layouts: the cases below put their values in nope columns, which either layout has
LAYOUTS = pytest.mark.parametrize("lay", [MODEL1, V32], ids=["MODEL1", "V3.2"])


def vec(width=512, **dims):
    """A bf16 vector of ``width`` (512: MODEL1's, 576: V3.2's) with the given ``d<i>=value``
    entries, zeros elsewhere."""
    v = torch.zeros(width, dtype=torch.bfloat16)
    for k, x in dims.items():
        v[int(k[1:])] = x
    return v


def make_cache(num_blocks, page, tokens):
    """A cache holding ``tokens`` {index: bf16 [512] or [576]: the width names the layout};
    every other byte is 0x7F (fp8 NaN). A token's bytes: MODEL1's 576-byte data row and 8-byte
    scale row, V3.2's 656 bytes together."""
    width = next(iter(tokens.values())).shape[0]
    lay = layout.layout_for_head_dim(width)
    kv = torch.zeros(num_blocks, page, width, dtype=torch.bfloat16)
    for g, v in tokens.items():
        kv[g // page, g % page] = v
    cache = mla.quantize_kv(kv)
    ps = layout.page_stride(page, lay)
    raw = torch.as_strided(cache.view(torch.uint8), (num_blocks * ps,), (1,), 0)
    rows = [("nope", 576), ("scales", 8)] if lay is MODEL1 else [("nope", 656)]
    keep = []
    for g in tokens:
        off = layout.token_offsets(page, g % page, lay)
        base = (g // page) * ps
        for part, n in rows:
            keep.append((base + off[part], raw[base + off[part]: base + off[part] + n].clone()))
    raw.fill_(0x7F)
    for at, b in keep:
        raw[at: at + b.numel()] = b
    # the construction is exact: the cache holds exactly these values
    deq = layout.gather_tokens(cache, torch.tensor(list(tokens)))
    assert torch.equal(deq, torch.stack(list(tokens.values()))), "values not exact in FP8"
    return cache


def q_of(*heads_per_token, b=1):
    """q [b, s_q, h_q, 512] from vectors: heads_per_token[s][h]."""
    q = torch.stack([torch.stack(list(hs)) for hs in heads_per_token])       # [s_q, h_q, 512]
    return q[None].expand(b, *q.shape).contiguous()


def idx(rows):
    return torch.tensor(rows, dtype=torch.int32)


def close(got, want, atol=1e-3):
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


def lse_close(got, want):
    torch.testing.assert_close(got, torch.as_tensor(want, dtype=torch.float32).expand_as(got),
                               atol=1e-6, rtol=1e-6)


# Two tokens reused below. A: 1.0 at dim 0. B: 1.0 at dim 1. q = e0 scores A at q.k = 1 and B at 0.
A, B = vec(d0=1.0), vec(d1=1.0)
E0 = vec(d0=1.0)
E1 = vec(d1=1.0)


def tokens_of(lay):
    """A, B, E0, E1 of the layout's width."""
    return tuple(vec(lay.d_qk, **{f"d{i}": 1.0}) for i in (0, 1, 0, 1))


def out_vec(**dims):
    """An output row (512 wide in both layouts)."""
    return vec(512, **dims)


@IMPLS
def test_one_valid_token(decode):
    # k: tile 0 {1, 2} (amax 2 -> scale 2**-7: 128, 256 exact), -3 in tile 1, rope 0.5 at dim 448.
    k = vec(d0=1.0, d1=2.0, d100=-3.0, d448=0.5)
    cache = make_cache(2, 3, {4: k})
    q = q_of([vec(d0=2.0, d1=1.0, d448=4.0)])   # q.k = 2*1 + 1*2 + 4*0.5 = 6 (rope dims count)
    out, lse = decode(q, cache, idx([[[4, -1]]]))
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (1, 1, 1, 512)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (1, 1, 1)
    assert torch.equal(out[0, 0, 0], k)            # one token: weight exactly 1, V = the latent
    lse_close(lse, 6.0 * 512 ** -0.5)              # default scale 512**-0.5; no max-subtraction
    out2, lse2 = decode(q, cache, idx([[[4, -1]]]), softmax_scale=512 ** -0.5)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    _, lse3 = decode(q, cache, idx([[[4, -1]]]), softmax_scale=0.5)
    lse_close(lse3, 3.0)                           # 6 * 0.5


@IMPLS
def test_v32_one_valid_token(decode):
    # V3.2: k is 576 wide; tile 0 (dims 0..127) {1, 2} (scale 2**-7), -3 at dim 200 (tile 1),
    # rope 0.5 at dim 512 and 2.0 at dim 575. V is the first 512 columns: the rope is in the
    # scores, not in the output.
    k = vec(576, d0=1.0, d1=2.0, d200=-3.0, d512=0.5, d575=2.0)
    cache = make_cache(2, 3, {4: k})
    assert tuple(cache.shape) == (2, 3, 1, 656)
    q = q_of([vec(576, d0=2.0, d1=1.0, d512=4.0, d575=-0.5)])   # q.k = 2 + 2 + 4*0.5 - 0.5*2 = 5
    out, lse = decode(q, cache, idx([[[4, -1]]]))
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (1, 1, 1, 512)
    assert torch.equal(out[0, 0, 0], out_vec(d0=1.0, d1=2.0, d200=-3.0))
    lse_close(lse, 5.0 * 576 ** -0.5)              # default scale d_qk**-0.5, as FlashMLA's
    _, lse2 = decode(q, cache, idx([[[4, -1]]]), softmax_scale=0.5)
    lse_close(lse2, 2.5)


@LAYOUTS
@IMPLS
def test_two_tokens_softmax_by_hand(decode, lay):
    A, B, E0, _ = tokens_of(lay)
    cache = make_cache(2, 3, {2: A, 4: B})
    out, lse = decode(q_of([E0]), cache, idx([[[2, 4]]]), softmax_scale=LN3)
    # scores ln3 (A), 0 (B): weights 3/4, 1/4; lse = ln 4.
    close(out[0, 0, 0], out_vec(d0=0.75, d1=0.25))
    lse_close(lse, LN4)
    # order of the indices does not matter
    out_r, lse_r = decode(q_of([E0]), cache, idx([[[4, 2]]]), softmax_scale=LN3)
    close(out_r, out)
    lse_close(lse_r, LN4)


@LAYOUTS
@IMPLS
def test_sink(decode, lay):
    A, B, E0, _ = tokens_of(lay)
    cache = make_cache(2, 3, {2: A, 4: B})
    q = q_of([E0, E0, E0, E0])                     # 4 heads, same query; lse = ln 4 for each
    sink = torch.tensor([math.inf, -math.inf, LN12, 0.0], dtype=torch.float32)
    out, lse = decode(q, cache, idx([[[2, 4]]]), softmax_scale=LN3, attn_sink=sink)
    base = out_vec(d0=0.75, d1=0.25)
    assert torch.equal(out[0, 0, 0], torch.zeros(512, dtype=torch.bfloat16))   # +inf: zeros
    close(out[0, 0, 1], base)                                                  # -inf: no effect
    close(out[0, 0, 2], base / 4)            # 1/(1 + exp(ln12 - ln4)) = 1/(1+3) -> 0.1875, 0.0625
    close(out[0, 0, 3], base * 0.8)          # 1/(1 + exp(0 - ln4)) = 1/(1 + 1/4) = 4/5
    lse_close(lse, LN4)                      # lse never includes the sink
    assert bool(torch.isfinite(out.float()).all())


@LAYOUTS
@IMPLS
def test_query_with_no_valid_token(decode, lay):
    A, B, E0, _ = tokens_of(lay)
    cache = make_cache(2, 3, {2: A, 4: B})
    q = q_of([E0, E0], b=2)
    sink = torch.tensor([LN12, math.inf], dtype=torch.float32)
    out, lse = decode(q, cache, idx([[[2, 4]], [[-1, 6]]]), softmax_scale=LN3, attn_sink=sink)
    assert torch.equal(out[1], torch.zeros(1, 2, 512, dtype=torch.bfloat16))
    assert torch.equal(lse[1], torch.full((2, 1), math.inf))
    close(out[0, 0, 0], out_vec(d0=0.1875, d1=0.0625))
    assert torch.equal(out[0, 0, 1], torch.zeros(512, dtype=torch.bfloat16))
    lse_close(lse[0], LN4)


@LAYOUTS
@IMPLS
def test_invalid_indices_of_every_kind_are_ignored(decode, lay):
    A, B, E0, _ = tokens_of(lay)
    nb, p = 2, 3                                   # 6 tokens: valid indices are 0..5
    cache = make_cache(nb, p, {2: A, 4: B})        # token 0 (where a clamp would land) is NaN
    rows = [[[INT32_MIN, 2, -1, INT32_MAX, 6, 4, -7, 2 ** 30]]]   # 6 = num_blocks*P
    out, lse = decode(q_of([E0]), cache, idx(rows), softmax_scale=LN3)
    close(out[0, 0, 0], out_vec(d0=0.75, d1=0.25))
    lse_close(lse, LN4)
    # only invalid indices: an empty query
    out, lse = decode(q_of([E0]), cache, idx([[[-1, INT32_MIN, INT32_MAX, 6]]]), softmax_scale=LN3)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, math.inf))


@LAYOUTS
@IMPLS
def test_poisoned_token_is_nan_when_referenced(decode, lay):
    # The poison is real: a valid index to a 0x7F token gives NaN. (So the tests above could fail.)
    A, B, E0, _ = tokens_of(lay)
    cache = make_cache(2, 3, {2: A, 4: B})
    out, _ = decode(q_of([E0]), cache, idx([[[2, 4, 5]]]), softmax_scale=LN3)
    assert bool(torch.isnan(out.float()).any())


@LAYOUTS
@IMPLS
def test_topk_length(decode, lay):
    A, B, E0, _ = tokens_of(lay)
    cache = make_cache(2, 3, {2: A, 4: B})        # token 5 is NaN bytes, at position 2 below
    q = q_of([E0], b=3)
    rows = [[[2, 4, 5]]] * 3
    length = torch.tensor([2, 1, 0], dtype=torch.int32)
    out, lse = decode(q, cache, idx(rows), softmax_scale=LN3, topk_length=length)
    close(out[0, 0, 0], out_vec(d0=0.75, d1=0.25))    # A and B
    lse_close(lse[0], LN4)
    assert torch.equal(out[1, 0, 0], A[:512])      # A only: score ln 3, weight 1
    lse_close(lse[1], LN3)
    assert torch.equal(out[2], torch.zeros_like(out[2]))   # topk_length 0: empty
    assert torch.equal(lse[2], torch.full_like(lse[2], math.inf))


@LAYOUTS
@IMPLS
def test_extra_cache_shares_the_softmax(decode, lay):
    A, B, E0, _ = tokens_of(lay)
    main = make_cache(2, 3, {4: A})                # P = 3
    extra = make_cache(3, 5, {7: B})               # its own P = 5 (token 7 = block 1, offset 2)
    q = q_of([E0])
    out, lse = decode(q, main, idx([[[4, -1]]]), softmax_scale=LN3,
                      extra_k_cache=extra, extra_indices=idx([[[-1, 7, 100]]]))
    close(out[0, 0, 0], out_vec(d0=0.75, d1=0.25))    # one softmax over A and B
    lse_close(lse, LN4)
    # equal to one cache holding both token sets
    both = make_cache(2, 4, {1: A, 6: B})
    out1, lse1 = decode(q, both, idx([[[1, 6]]]), softmax_scale=LN3)
    assert torch.equal(out, out1)
    torch.testing.assert_close(lse, lse1, atol=1e-6, rtol=1e-6)


@LAYOUTS
@IMPLS
def test_extra_topk_length(decode, lay):
    A, B, E0, _ = tokens_of(lay)
    main = make_cache(2, 3, {4: A})
    extra = make_cache(3, 5, {7: B})               # token 8 of the extra cache is NaN bytes
    q = q_of([E0], b=2)
    ind = idx([[[4]], [[4]]])
    ext = idx([[[7, 8]], [[7, 8]]])
    out, lse = decode(q, main, ind, softmax_scale=LN3, extra_k_cache=extra, extra_indices=ext,
                      extra_topk_length=torch.tensor([1, 0], dtype=torch.int32))
    close(out[0, 0, 0], out_vec(d0=0.75, d1=0.25))    # A + B
    lse_close(lse[0], LN4)
    assert torch.equal(out[1, 0, 0], A[:512])      # A only
    lse_close(lse[1], LN3)
    # topk_length applies to the main cache only
    out, lse = decode(q, main, ind, softmax_scale=LN3, topk_length=torch.tensor([0, 1], dtype=torch.int32),
                      extra_k_cache=extra, extra_indices=ext,
                      extra_topk_length=torch.tensor([1, 1], dtype=torch.int32))
    assert torch.equal(out[0, 0, 0], B[:512])      # B only: score 0, weight 1
    lse_close(lse[0], 0.0)
    close(out[1, 0, 0], out_vec(d0=0.75, d1=0.25))
    lse_close(lse[1], LN4)


@LAYOUTS
@IMPLS
def test_s_q_greater_than_one_and_lse_layout(decode, lay):
    A, B, E0, E1 = tokens_of(lay)
    cache = make_cache(2, 3, {2: A, 4: B})
    q = q_of([E0, E1], [E0, E1])                  # s_q = 2, h_q = 2: head 0 = e0, head 1 = e1
    out, lse = decode(q, cache, idx([[[2, 4], [4, -1]]]), softmax_scale=LN3)
    assert tuple(out.shape) == (1, 2, 2, 512) and tuple(lse.shape) == (1, 2, 2)   # lse [b, h_q, s_q]
    close(out[0, 0, 0], out_vec(d0=0.75, d1=0.25))    # s 0, h 0: A ln3, B 0
    close(out[0, 0, 1], out_vec(d0=0.25, d1=0.75))    # s 0, h 1: A 0, B ln3
    assert torch.equal(out[0, 1, 0], B[:512])      # s 1: B only
    assert torch.equal(out[0, 1, 1], B[:512])
    want = torch.tensor([[LN4, 0.0],               # lse[0, h=0, s]: ln 4, then B's score 0
                         [LN4, LN3]], dtype=torch.float32)   # h=1: ln 4, then B's score ln 3
    lse_close(lse[0], want)


@LAYOUTS
@IMPLS
def test_nan_bytes_never_leak(decode, lay):
    # Larger shape: 4 pages of 8, only 3 tokens written, all the rest NaN; b=2, s_q=2, h_q=3.
    w, rope = lay.d_qk, lay.d_nope            # the rope's first column: 448 (MODEL1), 512 (V3.2)
    toks = {3: vec(w, d0=1.0, d5=-2.0), 17: vec(w, d1=0.5, **{f"d{rope + 1}": 1.0}), 30: vec(w, d2=4.0, d300=0.25)}
    cache = make_cache(4, 8, toks)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 3, w, generator=g).to(torch.bfloat16)
    rows = [[[3, 17, -1, 32], [30, INT32_MAX, 3, -5]], [[17, 30, 3, 64], [INT32_MIN, 1 << 20, 30, 17]]]
    out, lse = decode(q, cache, idx(rows), attn_sink=torch.tensor([0.0, 1.0, -1.0]))
    assert bool(torch.isfinite(out.float()).all()) and bool(torch.isfinite(lse).all())
    # ... and it equals the same decode on a clean cache
    clean = mla.quantize_kv(torch.stack([toks.get(i, torch.zeros(w, dtype=torch.bfloat16))
                                         for i in range(32)]).view(4, 8, w))
    out_c, lse_c = decode(q, clean, idx(rows), attn_sink=torch.tensor([0.0, 1.0, -1.0]))
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


@LAYOUTS
def test_uint8_cache_is_accepted(lay):
    A, B, E0, _ = tokens_of(lay)
    cache = make_cache(2, 3, {2: A, 4: B})
    a = _ref32(q_of([E0]), cache, idx([[[2, 4]]]), softmax_scale=LN3)
    b = _ref32(q_of([E0]), cache.view(torch.uint8), idx([[[2, 4]]]), softmax_scale=LN3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@LAYOUTS
def test_float32_reference_matches_float64_on_random_input(lay):
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(3, 8, lay.d_qk, generator=g).to(torch.bfloat16)
    cache = mla.quantize_kv(kv)
    q = torch.randn(2, 1, 4, lay.d_qk, generator=g).to(torch.bfloat16)
    ind = torch.randint(-2, 26, (2, 1, 9), generator=g, dtype=torch.int32)
    sink = torch.randn(4, generator=g)
    o32, l32 = _ref32(q, cache, ind, attn_sink=sink)
    o64, l64 = _ref64(q, cache, ind, attn_sink=sink)
    # SPEC tolerances: out |err| < 1e-3 or rel < 2.01/128; lse |err| < 1e-6 or rel < 8.01/65536
    err = (o32.float() - o64.float()).abs()
    assert bool(((err < 1e-3) | (err <= 2.01 / 128 * o64.float().abs())).all())
    lerr = (l32 - l64).abs()
    assert bool(((lerr < 1e-6) | (lerr <= 8.01 / 65536 * l64.abs())).all())


def _fp8_exact_latents(nb, p, width, g):
    """Latents that the FP8 layouts hold exactly: +-m * 2**e, m in {1, 1.25, 1.5, 1.75} and
    e in [-3, 0], so every tile's scale is 2**-8 or 2**-9 and every scaled value a normal e4m3
    with two fraction bits."""
    m = torch.tensor([1.0, 1.25, 1.5, 1.75])[torch.randint(0, 4, (nb, p, width), generator=g)]
    e = torch.randint(-3, 1, (nb, p, width), generator=g).float()
    sign = torch.where(torch.rand(nb, p, width, generator=g) < 0.5, -1.0, 1.0)
    return (sign * m * torch.exp2(e)).bfloat16()


@LAYOUTS
def test_the_reference_equals_a_float64_loop_over_each_query(lay):
    """The float64 reference against a plain per-(batch, token, head) loop over the valid tokens,
    from the latents themselves (which the layout holds exactly): scores over K's d_qk columns,
    one softmax over both caches, V the first 512 columns, the sink, lse without it."""
    g = torch.Generator().manual_seed(2)
    w = lay.d_qk
    kv, ekv = _fp8_exact_latents(3, 5, w, g), _fp8_exact_latents(2, 3, w, g)
    cache, extra = mla.quantize_kv(kv), mla.quantize_kv(ekv)
    assert torch.equal(mla.dequantize_kv(cache), kv) and torch.equal(mla.dequantize_kv(extra), ekv)
    b, s_q, h_q = 2, 2, 3
    q = (torch.randn(b, s_q, h_q, w, generator=g) / 4).bfloat16()
    ind = torch.randint(-3, 17, (b, s_q, 6), generator=g, dtype=torch.int32)
    eind = torch.randint(-1, 7, (b, s_q, 4), generator=g, dtype=torch.int32)
    length, elength = torch.tensor([4, 6], dtype=torch.int32), torch.tensor([4, 1], dtype=torch.int32)
    sink = torch.tensor([0.5, -math.inf, 2.0])
    scale = 0.3
    out, lse = mla.sparse_decode_reference(q, cache, ind, scale, sink, length, extra, eind, elength,
                                           out_dtype=torch.float64)
    flat, eflat = kv.double().view(15, w), ekv.double().view(6, w)
    for bi in range(b):
        for si in range(s_q):
            toks = [flat[i] for pos, i in enumerate(ind[bi, si].tolist()) if 0 <= i < 15 and pos < length[bi]]
            toks += [eflat[i] for pos, i in enumerate(eind[bi, si].tolist()) if 0 <= i < 6 and pos < elength[bi]]
            for h in range(h_q):
                qv = q[bi, si, h].double()
                scores = [float(qv @ k) * scale for k in toks]
                top = max(scores)
                l_sum = sum(math.exp(x - top) for x in scores)
                want_lse = top + math.log(l_sum)
                want = sum(math.exp(x - want_lse) * k[:512] for x, k in zip(scores, toks))
                want = want / (1 + math.exp(float(sink[h]) - want_lse))
                assert abs(float(lse[bi, h, si]) - want_lse) < 1e-5, (bi, si, h)
                torch.testing.assert_close(out[bi, si, h], want, atol=1e-9, rtol=1e-9)
