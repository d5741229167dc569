"""The SPEC's semantics of sparse MLA decode, in plain PyTorch.

This is the oracle every kernel is validated against (in float64) and the "plain PyTorch"
implementation of ``impl="reference"`` (in float32). It gathers and dequantizes only the
selected tokens, and it never syncs the host, so it can be captured in a CUDA graph too.
"""
from __future__ import annotations

import math

import torch

from .layout import cache_layout, gather_tokens


def _gather_valid(k_cache, indices, length, dtype):
    """Dequantized selected tokens ``[b, s_q, topk, d_qk]`` (zeros where invalid) and the mask."""
    b, s_q, topk = indices.shape
    n_tokens = k_cache.shape[0] * k_cache.shape[1]
    valid = (indices >= 0) & (indices < n_tokens)
    if length is not None:
        pos = torch.arange(topk, device=indices.device)
        valid &= pos.view(1, 1, topk) < length.view(b, 1, 1)
    safe = torch.where(valid, indices, torch.zeros_like(indices))
    kv = gather_tokens(k_cache, safe).to(dtype)
    # 0 * NaN is NaN: a masked token must contribute an exact zero, whatever its bytes hold.
    kv = torch.where(valid[..., None], kv, torch.zeros((), dtype=dtype, device=kv.device))
    return kv, valid


def sparse_decode_reference(q, k_cache, indices, softmax_scale=None, attn_sink=None,
                            topk_length=None, extra_k_cache=None, extra_indices=None,
                            extra_topk_length=None, *, dtype=torch.float64, batch_chunk=None,
                            out_dtype=torch.bfloat16):
    """Reference sparse decode. Arguments as :func:`mla.sparse_decode` (not re-checked here),
    either layout: q ``[b, s_q, h_q, d_qk]`` with the cache's d_qk (512 MODEL1, 576 V3.2).

    Returns ``out`` bf16 ``[b, s_q, h_q, 512]`` (V is a token's first 512 columns: MODEL1's
    whole latent, V3.2's nope part) and ``lse`` float32 ``[b, h_q, s_q]``. The scale defaults to
    ``d_qk**-0.5``, as FlashMLA's. ``dtype`` is the compute precision; ``out_dtype`` the dtype of
    ``out`` (bf16 as the API; validation keeps the unrounded float64); ``batch_chunk`` bounds the
    memory of the gather.
    """
    b, s_q, h_q, d_qk = q.shape
    d_v = cache_layout(k_cache).d_v
    scale = d_qk ** -0.5 if softmax_scale is None else float(softmax_scale)
    if batch_chunk is None:
        per_b = s_q * (indices.shape[-1] + (0 if extra_indices is None else extra_indices.shape[-1]))
        batch_chunk = max(1, (1 << 28) // max(1, per_b * d_qk * torch.finfo(dtype).bits // 8))
    outs, lses = [], []
    for lo in range(0, b, batch_chunk):
        hi = min(b, lo + batch_chunk)
        sl = slice(lo, hi)
        kv, valid = _gather_valid(k_cache, indices[sl], None if topk_length is None else topk_length[sl], dtype)
        if extra_k_cache is not None:
            kv2, valid2 = _gather_valid(extra_k_cache, extra_indices[sl],
                                        None if extra_topk_length is None else extra_topk_length[sl], dtype)
            kv, valid = torch.cat([kv, kv2], 2), torch.cat([valid, valid2], 2)
        qc = q[sl].to(dtype)
        scores = torch.einsum("bshd,bstd->bsht", qc, kv) * scale
        scores = scores.masked_fill(~valid[:, :, None, :], -math.inf)
        lse = torch.logsumexp(scores, dim=-1)                           # [b, s, h]; -inf if empty
        empty = ~valid.any(-1)[:, :, None]                               # [b, s, 1]
        lse_safe = torch.where(empty, torch.zeros_like(lse), lse)
        p = torch.exp(scores - lse_safe[..., None])                      # exp(-inf) = 0
        out = torch.einsum("bsht,bstd->bshd", p, kv[..., :d_v])
        if attn_sink is not None:
            sink = attn_sink.to(dtype).view(1, 1, h_q)
            factor = 1.0 / (1.0 + torch.exp(sink - lse_safe))
            out = out * torch.where(empty, torch.ones_like(factor), factor)[..., None]
        out = torch.where(empty[..., None], torch.zeros_like(out), out)
        lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
        outs.append(out.to(out_dtype))
        lses.append(lse.permute(0, 2, 1).float())
    return torch.cat(outs, 0), torch.cat(lses, 0)


def sparse_prefill_reference(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, *,
                             dtype=torch.float64, out_dtype=torch.bfloat16, chunk=None):
    """Reference sparse prefill (FlashMLA's ``flash_mla_sparse_fwd``), arguments as
    :func:`mla.sparse_prefill` (not re-checked here): ``q [s_q, h_q, d_qk]``, ``kv [s_kv, 1,
    d_qk]``, ``indices [s_q, 1, topk]``; V is the first ``d_v`` columns of ``kv``.

    A position is valid when its index is in ``[0, s_kv)`` and, with ``topk_length``, it comes
    before ``topk_length[s]``. Over the valid positions, scores = q.k * sm_scale; ``max_logits``
    is their max and ``lse`` their logsumexp (natural log of the scaled scores, without the
    sink); ``out`` = softmax @ V times ``1 / (1 + exp(sink - lse))``. A query head with no valid
    token gets out 0, max_logits -inf and lse +inf. Returns ``(out [s_q, h_q, d_v] out_dtype,
    max_logits [s_q, h_q] fp32, lse [s_q, h_q] fp32)``; ``dtype`` is the compute precision and
    ``chunk`` the query tokens gathered at once (it bounds the gather's memory).
    """
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    idx = indices.reshape(s_q, topk)
    if chunk is None:
        chunk = max(1, (1 << 28) // max(1, topk * d_qk * torch.finfo(dtype).bits // 8))
    pos = torch.arange(topk, device=idx.device)
    kv2 = kv.reshape(s_kv, d_qk)
    outs, maxes, lses = [], [], []
    for lo in range(0, s_q, chunk):
        hi = min(s_q, lo + chunk)
        valid = (idx[lo:hi] >= 0) & (idx[lo:hi] < s_kv)                          # [n, topk]
        if topk_length is not None:
            valid &= pos.view(1, topk) < topk_length[lo:hi].view(-1, 1)
        safe = torch.where(valid, idx[lo:hi], torch.zeros_like(idx[lo:hi])).long()
        k = kv2[safe].to(dtype)                                                    # [n, topk, d_qk]
        # 0 * NaN is NaN: a masked token must contribute an exact zero, whatever its row holds.
        k = torch.where(valid[..., None], k, torch.zeros((), dtype=dtype, device=k.device))
        scores = torch.einsum("shd,std->sht", q[lo:hi].to(dtype), k) * float(sm_scale)
        scores = scores.masked_fill(~valid[:, None, :], -math.inf)
        m = scores.amax(-1)                                                        # -inf where empty
        lse = torch.logsumexp(scores, -1)
        empty = ~valid.any(-1)[:, None].expand(-1, h_q)
        lse_safe = torch.where(empty, torch.zeros_like(lse), lse)
        out = torch.einsum("sht,std->shd", torch.exp(scores - lse_safe[..., None]), k[..., :d_v])
        if attn_sink is not None:
            out = out / (1.0 + torch.exp(attn_sink.to(dtype).view(1, h_q) - lse_safe))[..., None]
        outs.append(torch.where(empty[..., None], torch.zeros_like(out), out).to(out_dtype))
        maxes.append(m.float())
        lses.append(torch.where(empty, torch.full_like(lse, math.inf), lse).float())
    return torch.cat(outs), torch.cat(maxes), torch.cat(lses)
