"""Validation of a sparse prefill (FlashMLA's ``flash_mla_sparse_fwd``): fresh random inputs shaped
like FlashMLA's test cases, with NaN in every kv row that must not be read, checked against the
float64 reference with FlashMLA's prefill tolerances."""
from __future__ import annotations

import torch

from ..reference import sparse_prefill_reference
from .cases import invalid_values, poison_allocator
from .compare import Closeness, check_prefill_against_reference


def make_prefill_case(s_q=4, s_kv=128, topk=64, h_q=16, d_qk=512, *, sink=True, lengths=False, empty_frac=0.0,
                      invalid_frac=0.0, value_scale=0.1, sm_scale=0.5, strided=True, device="cpu", seed=0) -> dict:
    """The keyword arguments of one call of ``flash_mla_sparse_fwd`` (q, kv, indices, sm_scale,
    attn_sink, topk_length), drawn as FlashMLA's test draws them: q and kv N(0, 1) times
    ``value_scale`` plus one small offset each, ``sm_scale`` 0.5; each query token's indices
    distinct tokens of ``[0, s_kv)`` in random order, and where topk > s_kv the positions past
    them invalid, of every kind (-1, int32 min and max, s_kv, a large index); ``invalid_frac``
    of the other positions invalid too and ``empty_frac`` of the query tokens with no valid
    position at all. ``sink``: one fp32 logit per head, a quarter of them +inf and a quarter
    -inf. ``lengths``: a ``topk_length`` per token in ``[0, topk]``. Every kv row that no valid
    position names (past a token's length included) is NaN. ``strided`` hands q, kv and the
    indices over as views into larger buffers, as FlashMLA's ``non_contiguousify`` does."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h_q, d_qk, generator=g) * value_scale + (torch.rand((), generator=g) - 0.5) * value_scale
    kv = torch.randn(s_kv, 1, d_qk, generator=g) * value_scale + (torch.rand((), generator=g) - 0.5) * value_scale
    kinds = torch.tensor(invalid_values(s_kv) + [s_kv + 114514], dtype=torch.int32)
    width = max(s_kv, topk)
    idx = torch.argsort(torch.rand(s_q, width, generator=g), dim=1)[:, :topk].to(torch.int32)
    bad = (idx >= s_kv) | (torch.rand(s_q, topk, generator=g) < invalid_frac)
    bad |= (torch.rand(s_q, generator=g) < empty_frac)[:, None]
    idx = torch.where(bad, kinds[torch.randint(0, len(kinds), (s_q, topk), generator=g)], idx)
    kw = {"sm_scale": float(sm_scale), "attn_sink": None, "topk_length": None}
    if sink:
        s = torch.randn(h_q, generator=g)
        r = torch.rand(h_q, generator=g)
        kw["attn_sink"] = torch.where(r < 0.25, float("inf"), torch.where(r > 0.75, float("-inf"), s)).to(device)
    used = idx
    if lengths:
        length = torch.randint(0, topk + 1, (s_q,), generator=g, dtype=torch.int32)
        kw["topk_length"] = length.to(device)
        used = torch.where(torch.arange(topk)[None, :] < length[:, None], idx, -1)
    keep = torch.zeros(s_kv, dtype=torch.bool)
    u = used[(used >= 0) & (used < s_kv)].long()
    keep[u] = True
    kv[~keep] = float("nan")
    tensors = {"q": q.bfloat16(), "kv": kv.bfloat16(), "indices": idx.view(s_q, 1, topk)}
    for name, t in tensors.items():
        if strided:      # a view into a buffer one larger in every dim and 128 wider in the last, as FlashMLA's
            big = torch.zeros([n + 1 for n in t.shape[:-1]] + [t.shape[-1] + 128], dtype=t.dtype)
            big[tuple(slice(0, n) for n in t.shape)] = t
            t = big.to(device)[tuple(slice(0, n) for n in t.shape)]
        kw[name] = t.to(device)
    return kw


def run_prefill_case(fn, case: dict, value_scale: float = 0.1) -> tuple[Closeness, Closeness, Closeness]:
    """Call ``fn(**case) -> (out, max_logits, lse)`` (the output allocator poisoned with NaN
    first) and compare with the float64 reference: FlashMLA's checks of out, max_logits and lse
    (:func:`mla.validate.check_prefill_against_reference`), dtypes and shapes included; for data
    of ``value_scale`` (that of :func:`make_prefill_case`) the logits' absolute bound grows with
    their terms, ``(value_scale / 0.1)**2``."""
    q = case["q"]
    s_q, h_q, _ = q.shape
    poison_allocator(s_q * h_q * 512 * 2, q.device)
    out, max_logits, lse = fn(**case)
    ref = sparse_prefill_reference(case["q"], case["kv"], case["indices"], case["sm_scale"],
                                   attn_sink=case.get("attn_sink"), topk_length=case.get("topk_length"),
                                   out_dtype=torch.float64)
    res = check_prefill_against_reference(out, max_logits, lse, *ref, logit_scale=max(1.0, (value_scale / 0.1) ** 2))
    for got, dtype, r in zip((out, max_logits, lse), (torch.bfloat16, torch.float32, torch.float32), res):
        if got.dtype != dtype:
            r.ok, r.note = False, f"dtype {got.dtype}, expected {dtype}"
    return res
