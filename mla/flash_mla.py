"""FlashMLA's own call for its sparse FP8 decode, on ``mla``: code written against FlashMLA's
``get_mla_metadata`` and ``flash_mla_with_kvcache`` runs unchanged after
``import mla.flash_mla as flash_mla``, on any GPU Triton supports (and on the CPU interpreter).

The path it covers is FlashMLA's sparse decode over its two FP8 caches, DeepSeek-V4's "MODEL1"
(``d_qk`` 512, 584-byte tokens) and DeepSeek-V3.2's (``d_qk`` 576, 656-byte tokens): ``indices``
given, ``is_fp8_kvcache=True``, ``head_dim_v`` 512. Dense decode and bf16 caches are refused
with a ValueError that says so. It takes every argument the serving stacks pass, with FlashMLA's
meaning: ``out=`` (vLLM's vendored interface), a buffer written in place; ``block_table`` and
``cache_seqlens``, which the sparse decode ignores when ``indices`` is given (vLLM's sparse
backend passes dummy ones), though something that is neither a tensor nor None is still refused
by name.

As in FlashMLA, the metadata object is filled by its first call (here with a :class:`mla.Plan`)
and later calls only check that they match it; where FlashMLA asserts, this raises a ValueError
naming the mismatch. A plan depends on shapes, strides, dtypes, devices and the page stride,
never on an address, so one metadata object shared by the layers of a step, whose caches are
views of one pool at different offsets, keeps one plan, and that plan's split workspace serves
every call: the calls of one metadata object must run in order on one stream, as the layers of a
step do (make one per stream otherwise). Under ``torch.compile`` the call is the custom op
``torch.ops.mla.sparse_decode`` (it plans for itself; the metadata object is only checked for its
type), so a compiled step traces through it without a graph break.

``flash_mla_sparse_fwd``, FlashMLA's sparse prefill over a bf16 ``kv`` (d_qk 512 or 576), is
:func:`mla.sparse_prefill` under FlashMLA's signature.
"""
from __future__ import annotations

import dataclasses

import torch

from . import api
from .layout import D_V, fail


@dataclasses.dataclass
class FlashMLASchedMeta:
    """What FlashMLA's ``get_mla_metadata`` returns: filled by the first call, checked by the
    later ones. ``plan`` is the :class:`mla.Plan` that call made."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: int | None
        extra_page_block_size: int | None
        extra_topk: int | None

    have_initialized: bool = False
    config: Config | None = None
    plan: api.Plan | None = None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    """An empty :class:`FlashMLASchedMeta` (and None, as FlashMLA returns); its first use in
    :func:`flash_mla_with_kvcache` fills it. The arguments are accepted and ignored, as
    FlashMLA's are (the old interface took the sequence lengths)."""
    return FlashMLASchedMeta(), None


def _refuse_unsupported(q, k_cache, head_dim_v, num_splits, causal, is_fp8_kvcache, indices):
    if num_splits is not None:
        fail("num_splits", "must be None (FlashMLA's interface keeps it as a placeholder)")
    if indices is None:
        fail("indices", "mla.flash_mla covers FlashMLA's sparse decode only: pass indices (the dense decode with "
                        "block_table and cache_seqlens is not supported)")
    if causal:
        fail("causal", "must be False for the sparse decode (as in FlashMLA)")
    if not is_fp8_kvcache:
        fail("is_fp8_kvcache", "must be True: mla.flash_mla covers the FP8 caches only (no bf16 caches)")
    if head_dim_v != D_V:
        fail("head_dim_v", f"must be {D_V}, got {head_dim_v!r}")


def _config(q, k_cache, causal, is_fp8_kvcache, indices, extra_k_cache, extra_indices):
    return FlashMLASchedMeta.Config(
        q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2], causal, is_fp8_kvcache,
        indices.shape[-1], extra_k_cache.shape[1] if extra_k_cache is not None else None,
        extra_indices.shape[-1] if extra_indices is not None else None)


#: the config field each argument's mismatch shows in, in FlashMLA's order of checks
_FIELD_ARGS = {"b": "q", "s_q": "q", "h_q": "q", "page_block_size": "k_cache", "h_k": "k_cache",
               "causal": "causal", "is_fp8_kvcache": "is_fp8_kvcache", "topk": "indices",
               "extra_page_block_size": "extra_k_cache", "extra_topk": "extra_indices_in_kvcache"}


def _check_ignored(t, arg):
    """``block_table`` and ``cache_seqlens`` are ignored with ``indices`` (as in FlashMLA), but
    must still be what FlashMLA's signature says: a tensor or None."""
    if t is not None and not isinstance(t, torch.Tensor):
        fail(arg, f"expected a torch.Tensor or None (the sparse decode ignores it), got {type(t).__name__}")


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None, out=None):
    """FlashMLA's ``flash_mla_with_kvcache`` for the sparse FP8 path, MODEL1 or V3.2 (q's head dim,
    512 or 576, names the cache's layout): its names, order, defaults and semantics, with vLLM's
    ``out`` after them. Returns ``(out [b, s_q, h_q, 512] bf16, lse [b, h_q, s_q] fp32)``; ``out``,
    when given, is that buffer, written in place (a contiguous bf16 tensor of q's device and of
    that shape: anything else is a ValueError naming ``out``). ``block_table`` and
    ``cache_seqlens`` are ignored (``indices`` picks the tokens). ``softmax_scale`` defaults to
    ``q.shape[-1] ** -0.5``."""
    meta = tile_scheduler_metadata
    if not isinstance(meta, FlashMLASchedMeta):
        fail("tile_scheduler_metadata", "must be the FlashMLASchedMeta from mla.flash_mla.get_mla_metadata(), got "
                                        f"{type(meta).__name__}")
    if num_splits is not None or indices is None or causal or not is_fp8_kvcache or head_dim_v != D_V:
        _refuse_unsupported(q, k_cache, head_dim_v, num_splits, causal, is_fp8_kvcache, indices)
    if block_table is not None or cache_seqlens is not None:
        _check_ignored(block_table, "block_table")
        _check_ignored(cache_seqlens, "cache_seqlens")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if torch.compiler.is_compiling():
        return api.sparse_decode(q, k_cache, indices, softmax_scale=softmax_scale, attn_sink=attn_sink,
                                 topk_length=topk_length, extra_k_cache=extra_k_cache,
                                 extra_indices=extra_indices_in_kvcache, extra_topk_length=extra_topk_length, out=out)
    args = (q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices_in_kvcache,
            extra_topk_length)
    plan = meta.plan
    try:
        sig = api.signature(*args)
    except (AttributeError, TypeError, IndexError):
        sig = None
    if plan is None or sig != plan.signature:
        _refuse_unsupported(q, k_cache, head_dim_v, num_splits, causal, is_fp8_kvcache, indices)
        got = _config(q, k_cache, causal, is_fp8_kvcache, indices, extra_k_cache, extra_indices_in_kvcache) \
            if sig is not None else None
        if meta.have_initialized and got is not None and got != meta.config:
            for f in dataclasses.fields(got):
                want, have = getattr(meta.config, f.name), getattr(got, f.name)
                if want != have:
                    fail(_FIELD_ARGS[f.name], f"inconsistent with tile_scheduler_metadata: {f.name} was {want!r} at "
                                              f"its first call, this call has {have!r} (use one metadata object per "
                                              "shape, as with FlashMLA)")
        # the first call, or other caches of the same page size (another number of pages, say): plan
        # (which checks every argument)
        plan = api.plan(q, k_cache, indices, softmax_scale=softmax_scale, attn_sink=attn_sink,
                        topk_length=topk_length, extra_k_cache=extra_k_cache, extra_indices=extra_indices_in_kvcache,
                        extra_topk_length=extra_topk_length)
        meta.config, meta.plan, meta.have_initialized = got, plan, True
        sig = plan.signature
    return api.planned_call(plan, sig, *args, out, None)


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, out=None):
    """FlashMLA's sparse prefill, ``flash_mla_sparse_fwd``: its names, order, defaults and
    semantics (:func:`mla.sparse_prefill`; bad input is a ValueError naming the argument where
    FlashMLA's extension fails a check). ``q [s_q, h_q, d_qk]`` and ``kv [s_kv, 1, d_qk]`` bf16
    with d_qk 512 or 576, ``indices [s_q, 1, topk]`` int32, ``attn_sink [h_q]`` fp32,
    ``topk_length [s_q]`` int32; ``out`` (as vLLM's copy of the interface takes it) is written in
    place. Returns ``(out [s_q, h_q, 512] bf16, max_logits [s_q, h_q], lse [s_q, h_q])``, fp32, as
    FlashMLA's ``tests/ref.py`` defines them."""
    return api.sparse_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out=out)


__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd"]
