"""Deliberately broken decodes, each a classic kernel mistake, and the correct code they come
from: the harness (:mod:`mla.validate`) must catch every one (chapter 6's gallery, and
tests/test_properties.py). Written in PyTorch, in float32, with the signature of
:func:`mla.sparse_decode`, so that it is the mistake that is caught, not a difference in code."""
from __future__ import annotations

import functools
import math

import torch

from mla.layout import D_QK, gather_tokens


def _broken_decode(q, k_cache, indices, softmax_scale=None, attn_sink=None, topk_length=None,
                   extra_k_cache=None, extra_indices=None, extra_topk_length=None, *,
                   mask_scores=True, zero_masked_v=True, clamp_only=False, sink_per_split=False,
                   sink_in_lse=False, naive_empty=False, round_toward_zero=False):
    """The reference's algorithm in float32 with one mistake switched on (see :data:`BROKEN`)."""
    scale = D_QK ** -0.5 if softmax_scale is None else float(softmax_scale)
    kvs, valids = [], []
    for cache, ind, ln in ((k_cache, indices, topk_length), (extra_k_cache, extra_indices, extra_topk_length)):
        if cache is None:
            continue
        n = cache.shape[0] * cache.shape[1]
        valid = (ind >= 0) & (ind < n)
        if ln is not None:
            valid &= torch.arange(ind.shape[-1], device=ind.device).view(1, 1, -1) < ln.view(-1, 1, 1)
        safe = ind.long().clamp(0, n - 1)                      # every index inside the cache
        kv = gather_tokens(cache, safe).float()                # reads the clamped tokens' bytes
        if clamp_only:
            valid = torch.ones_like(valid)                     # ... and uses them as if valid
        if zero_masked_v:
            kv = torch.where(valid[..., None], kv, torch.zeros((), device=kv.device))
        kvs.append(kv)
        valids.append(valid)
    kv, valid = torch.cat(kvs, 2), torch.cat(valids, 2)
    s = torch.einsum("bshd,bstd->bsht", q.float(), kv) * scale
    if mask_scores:
        s = s.masked_fill(~valid[:, :, None, :], -math.inf)

    def softmax_part(sc, v):
        lse = torch.logsumexp(sc, -1)
        p = torch.exp(sc - lse[..., None]) if naive_empty else torch.exp(sc - torch.nan_to_num(lse, neginf=0.0)[..., None])
        return torch.einsum("bsht,bstd->bshd", p, v), lse

    sink = None if attn_sink is None else attn_sink.float().view(1, 1, -1)
    if sink_per_split:                                         # split-K, sink applied per split
        half = max(1, kv.shape[2] // 2)
        parts = [softmax_part(s[..., :half], kv[:, :, :half]), softmax_part(s[..., half:], kv[:, :, half:])]
        if sink is not None:
            parts = [(o * (1 / (1 + torch.exp(sink - lse)))[..., None], lse) for o, lse in parts]
        lse = torch.logaddexp(parts[0][1], parts[1][1])
        lse_safe = torch.nan_to_num(lse, neginf=0.0)
        out = sum(torch.nan_to_num(torch.exp(l_ - lse_safe))[..., None] * o for o, l_ in parts)
    else:
        out, lse = softmax_part(s, kv)
        if sink is not None:
            out = out * (1 / (1 + torch.exp(sink - torch.nan_to_num(lse, neginf=0.0))))[..., None]
    empty = torch.isneginf(lse) if not naive_empty else torch.zeros_like(lse, dtype=torch.bool)
    out = torch.where(empty[..., None], torch.zeros_like(out), out)
    lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
    if sink_in_lse and sink is not None:
        lse = torch.logaddexp(lse, sink)
    if round_toward_zero:                                      # bf16 by dropping the low 16 bits
        bits = out.float().contiguous().view(torch.int32) >> 16
        return bits.to(torch.int16).view(torch.bfloat16), lse.permute(0, 2, 1).contiguous()
    return out.bfloat16(), lse.permute(0, 2, 1).contiguous()


#: Broken variants of the decode, each a classic kernel mistake, with the signature of
#: :func:`mla.sparse_decode`. The harness must flag every one.
BROKEN = {
    "no mask (clamps invalid indices)": functools.partial(_broken_decode, clamp_only=True),
    "masks scores, not V (0*NaN)": functools.partial(_broken_decode, zero_masked_v=False),
    "sink before the combine": functools.partial(_broken_decode, sink_per_split=True),
    "lse includes the sink": functools.partial(_broken_decode, sink_in_lse=True),
    "no empty-query guard": functools.partial(_broken_decode, naive_empty=True),
    "bf16 rounded toward zero": functools.partial(_broken_decode, round_toward_zero=True),
}
#: The correct float32 version of the same code (so the mistakes, not the code, are caught).
CORRECT_F32 = functools.partial(_broken_decode)
