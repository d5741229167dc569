"""The public entry point, :func:`sparse_decode`, with FlashMLA's argument names and checks."""
from __future__ import annotations

import math

import torch

from . import _runtime
from .layout import D_QK, TOKEN_BYTES

IMPLS = ("auto", "mma", "simt", "reference")
MAX_HEADS = 128


def _fail(arg: str, msg: str):
    raise ValueError(f"{arg}: {msg}")


def check_cache(k_cache, arg: str = "k_cache") -> None:
    """Raise ValueError naming ``arg`` unless ``k_cache`` is a MODEL1 cache tensor."""
    if not isinstance(k_cache, torch.Tensor):
        _fail(arg, f"expected a torch.Tensor, got {type(k_cache).__name__}")
    if k_cache.dtype not in (torch.float8_e4m3fn, torch.uint8):
        _fail(arg, f"expected dtype torch.float8_e4m3fn or torch.uint8, got {k_cache.dtype}")
    if k_cache.dim() != 4:
        _fail(arg, f"expected rank 4 [num_blocks, P, 1, {TOKEN_BYTES}], got rank {k_cache.dim()}")
    nb, p, hk, nbytes = k_cache.shape
    if hk != 1 or nbytes != TOKEN_BYTES or nb < 1 or p < 1:
        _fail(arg, f"expected shape [num_blocks >= 1, P >= 1, 1, {TOKEN_BYTES}], got {tuple(k_cache.shape)}")
    if k_cache.stride(3) != 1:
        _fail(arg, f"the last dim must be contiguous (stride 1), got stride {k_cache.stride(3)}")
    if nb > 1 and k_cache.stride(0) < p * TOKEN_BYTES:
        _fail(arg, f"page stride too small: stride(0) = {k_cache.stride(0)} bytes < P*{TOKEN_BYTES} = {p * TOKEN_BYTES}")
    n = (nb - 1) * k_cache.stride(0) + p * TOKEN_BYTES
    if k_cache.storage_offset() + n > k_cache.untyped_storage().nbytes():
        _fail(arg, "the tensor's pages reach past the end of its storage")


def _check_indices(ind, arg, b, s_q, device):
    if not isinstance(ind, torch.Tensor):
        _fail(arg, f"expected a torch.Tensor, got {type(ind).__name__}")
    if ind.dtype != torch.int32:
        _fail(arg, f"expected dtype torch.int32, got {ind.dtype}")
    if ind.dim() != 3:
        _fail(arg, f"expected rank 3 [b, s_q, topk], got rank {ind.dim()}")
    if ind.shape[0] != b or ind.shape[1] != s_q:
        _fail(arg, f"batch/s_q mismatch: expected [{b}, {s_q}, topk] to match q, got {tuple(ind.shape)}")
    if ind.shape[2] < 1:
        _fail(arg, "topk must be >= 1")
    if ind.device != device:
        _fail(arg, f"device mismatch: on {ind.device}, q is on {device}")


def _check_length(t, arg, b, device):
    if not isinstance(t, torch.Tensor):
        _fail(arg, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        _fail(arg, f"expected dtype torch.int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != b:
        _fail(arg, f"expected shape [b] = [{b}], got {tuple(t.shape)}")
    if t.device != device:
        _fail(arg, f"device mismatch: on {t.device}, q is on {device}")


def check_inputs(q, k_cache, indices, softmax_scale=None, attn_sink=None, topk_length=None,
                 extra_k_cache=None, extra_indices=None, extra_topk_length=None, impl="auto"):
    """Every argument check of the SPEC; raises ValueError naming the argument."""
    if impl not in IMPLS:
        _fail("impl", f"expected one of {IMPLS}, got {impl!r}")
    if not isinstance(q, torch.Tensor):
        _fail("q", f"expected a torch.Tensor, got {type(q).__name__}")
    if q.dtype != torch.bfloat16:
        _fail("q", f"expected dtype torch.bfloat16, got {q.dtype}")
    if q.dim() != 4:
        _fail("q", f"expected rank 4 [b, s_q, h_q, {D_QK}], got rank {q.dim()}")
    b, s_q, h_q, d = q.shape
    if d != D_QK:
        _fail("q", f"expected head dim {D_QK}, got {d}")
    if b < 1 or s_q < 1:
        _fail("q", f"expected b >= 1 and s_q >= 1, got shape {tuple(q.shape)}")
    if not 1 <= h_q <= MAX_HEADS:
        _fail("q", f"expected 1 <= h_q <= {MAX_HEADS}, got {h_q}")
    dev = q.device
    check_cache(k_cache, "k_cache")
    if k_cache.device != dev:
        _fail("k_cache", f"device mismatch: on {k_cache.device}, q is on {dev}")
    _check_indices(indices, "indices", b, s_q, dev)
    if softmax_scale is not None:
        if isinstance(softmax_scale, (torch.Tensor, bool)) or not isinstance(softmax_scale, (int, float)):
            _fail("softmax_scale", f"expected a Python float, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            _fail("softmax_scale", f"expected a finite float > 0, got {softmax_scale!r}")
    if attn_sink is not None:
        if not isinstance(attn_sink, torch.Tensor):
            _fail("attn_sink", f"expected a torch.Tensor, got {type(attn_sink).__name__}")
        if attn_sink.dtype != torch.float32:
            _fail("attn_sink", f"expected dtype torch.float32, got {attn_sink.dtype}")
        if attn_sink.dim() != 1 or attn_sink.shape[0] != h_q:
            _fail("attn_sink", f"expected shape [h_q] = [{h_q}], got {tuple(attn_sink.shape)}")
        if attn_sink.device != dev:
            _fail("attn_sink", f"device mismatch: on {attn_sink.device}, q is on {dev}")
    if topk_length is not None:
        _check_length(topk_length, "topk_length", b, dev)
    has_extra = [x is not None for x in (extra_k_cache, extra_indices)]
    if any(has_extra) and not all(has_extra):
        _fail("extra_k_cache" if not has_extra[0] else "extra_indices",
              "extra_k_cache and extra_indices must be given together")
    if extra_topk_length is not None and extra_indices is None:
        _fail("extra_topk_length", "given without extra_k_cache and extra_indices")
    if extra_k_cache is not None:
        check_cache(extra_k_cache, "extra_k_cache")
        if extra_k_cache.device != dev:
            _fail("extra_k_cache", f"device mismatch: on {extra_k_cache.device}, q is on {dev}")
        _check_indices(extra_indices, "extra_indices", b, s_q, dev)
        if extra_topk_length is not None:
            _check_length(extra_topk_length, "extra_topk_length", b, dev)


def resolve_impl(impl: str, device: torch.device) -> str:
    """``"auto"`` is the MMA kernel on a GPU and the reference on the CPU interpreter."""
    if impl != "auto":
        return impl
    if device.type == "cuda" or _runtime.INTERPRET:
        return "mma" if _available("mma") else ("simt" if _available("simt") else "reference")
    return "reference"


def _available(name: str) -> bool:
    from . import kernels

    return name in kernels.AVAILABLE


def sparse_decode(q, k_cache, indices, *, softmax_scale=None, attn_sink=None, topk_length=None,
                  extra_k_cache=None, extra_indices=None, extra_topk_length=None, impl="auto"):
    """Sparse MLA decode over the MODEL1 FP8 paged cache (FlashMLA's semantics).

    Args:
        q: ``[b, s_q, h_q, 512]`` bf16 queries.
        k_cache: ``[num_blocks, P, 1, 584]`` float8_e4m3fn (or uint8) MODEL1 cache.
        indices: ``[b, s_q, topk]`` int32 token indices ``block*P + offset``; any index
            outside ``[0, num_blocks*P)`` is invalid and never read.
        softmax_scale: defaults to ``512**-0.5``.
        attn_sink: ``[h_q]`` fp32, one sink logit per head.
        topk_length: ``[b]`` int32; positions ``>= topk_length[b]`` are invalid.
        extra_k_cache, extra_indices, extra_topk_length: a second cache (its own P) that
            shares the softmax.
        impl: ``"auto"``, ``"mma"``, ``"simt"`` or ``"reference"``.

    Returns:
        ``out`` ``[b, s_q, h_q, 512]`` bf16 and ``lse`` ``[b, h_q, s_q]`` fp32 (natural log,
        without the sink; ``+inf`` for a query with no valid token, whose ``out`` is 0).
    """
    check_inputs(q, k_cache, indices, softmax_scale, attn_sink, topk_length,
                 extra_k_cache, extra_indices, extra_topk_length, impl)
    impl = resolve_impl(impl, q.device)
    args = (q, k_cache, indices, softmax_scale, attn_sink, topk_length,
            extra_k_cache, extra_indices, extra_topk_length)
    if impl == "reference":
        from .reference import sparse_decode_reference

        return sparse_decode_reference(*args, dtype=torch.float32)
    if not _available(impl):
        raise NotImplementedError(f"impl={impl!r} is not implemented yet; available: "
                                  f"{['reference', *_kernels_available()]}")
    from . import kernels

    return kernels.AVAILABLE[impl](*args)


def _kernels_available():
    from . import kernels

    return list(kernels.AVAILABLE)
