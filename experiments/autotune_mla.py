"""``mla``'s own ``tl.dot`` decode kernel under ``triton.autotune``, for the autotuner chapter: the
kernel of :mod:`mla.kernels.tl_dot`, unchanged, behind a thin wrapper that adds one argument to
key on, and a launcher for the simplest call (no sink, no lengths, no extra cache, one program
per query). ``mla`` itself never autotunes (it ships its configs); this is what a caller who
autotunes it would meet. Small enough for the CPU interpreter at small shapes. Imported by the
autotuner chapter, which tunes it over a drifting batch size with both keys."""
from __future__ import annotations

from mla.tuning import bucket  # first: on a machine with no GPU mla turns Triton's interpreter on
import torch
import triton
import triton.language as tl

from mla import schedule
from mla.kernels import tl_dot
from mla.kernels.common import LOG2E, fp8_native
from mla.kernels.tl_dot import tl_dot_decode_kernel
from mla.layout import D_QK


@triton.jit
def keyed_decode_kernel(
    q_ptr, q_sb, q_ss, q_sh, out_ptr, lse_ptr, sink_ptr, sink_stride, po_ptr, plse_ptr, rec_ptr,
    kc_ptr, kc_stride, kc_P, kc_n, idx_ptr, idx_sb, idx_ss, topk, len_ptr, len_stride,
    ec_ptr, ec_stride, ec_P, ec_n, eidx_ptr, eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride,
    n_q, s_q, h_q, sm_scale_log2, share, num_programs, n_key,
    HAS_SINK: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_ELEN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_NATIVE: tl.constexpr, DOT: tl.constexpr, DV_HALVES: tl.constexpr = 1,
):
    """``mla``'s ``tl.dot`` decode kernel with one more argument, ``n_key``, that it never reads:
    it is there to be an autotune key (the bucket of ``n_q``) instead of ``n_q`` itself."""
    tl_dot_decode_kernel(
        q_ptr, q_sb, q_ss, q_sh, out_ptr, lse_ptr, sink_ptr, sink_stride, po_ptr, plse_ptr, rec_ptr,
        kc_ptr, kc_stride, kc_P, kc_n, idx_ptr, idx_sb, idx_ss, topk, len_ptr, len_stride,
        ec_ptr, ec_stride, ec_P, ec_n, eidx_ptr, eidx_sb, eidx_ss, etopk, elen_ptr, elen_stride,
        n_q, s_q, h_q, sm_scale_log2, share, num_programs,
        HAS_SINK, HAS_LEN, HAS_EXTRA, HAS_ELEN, BLOCK_H, BLOCK_N, FP8_NATIVE, DOT, DV_HALVES)


#: tokens per tile, the same in every config: the schedule's share of a program depends on it
BLOCK_N = 16
#: candidate configs: heads per program and warps (the interpreter ignores the warps)
CONFIGS = [triton.Config({"BLOCK_H": bh}, num_warps=w, num_stages=1) for bh, w in ((16, 4), (32, 4), (16, 8))]


def make_decode(key=("n_key",), configs=None, do_bench=None):
    """A fresh autotuned :func:`keyed_decode_kernel` (its own, empty, tuning cache) keyed on
    ``key``: ``("n_q",)`` the raw number of queries, ``("n_key",)`` its bucket."""
    return triton.autotune(configs=list(configs or CONFIGS), key=list(key), do_bench=do_bench)(keyed_decode_kernel)


def decode(kernel, q, k_cache, indices):
    """Sparse decode through an autotuned :func:`keyed_decode_kernel`: ``q`` [b, s_q, h_q, 512]
    bf16, ``k_cache`` the quantized paged cache, ``indices`` [b, s_q, topk] int32; no sink, no
    lengths, no extra cache. One program per query, so no query is split and no combine runs.
    Returns ``(out, lse)``."""
    b, s_q, h_q, _ = q.shape
    n_q, topk = b * s_q, indices.shape[-1]
    q, indices = q.contiguous(), indices.contiguous()
    out = torch.empty(b, s_q, h_q, D_QK, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    rec = torch.empty(4 * n_q, dtype=torch.int32, device=q.device)      # the share records (room for mla's)
    share = schedule.query_units(topk, 0, BLOCK_N)[1]                   # one whole query per program
    kc = k_cache.view(torch.uint8)
    kc_n = k_cache.shape[0] * k_cache.shape[1]
    scale = D_QK ** -0.5 * LOG2E
    grid = lambda meta: (triton.cdiv(h_q, meta["BLOCK_H"]), n_q)        # noqa: E731
    kernel[grid](
        q, *q.stride()[:3], out, lse, lse, 0, lse, lse, rec,
        kc, k_cache.stride(0), k_cache.shape[1], kc_n, indices, *indices.stride()[:2], topk, indices, 0,
        kc, k_cache.stride(0), k_cache.shape[1], kc_n, indices, *indices.stride()[:2], 0, indices, 0,
        n_q, s_q, h_q, scale, share, n_q, bucket(n_q),
        HAS_SINK=False, HAS_LEN=False, HAS_EXTRA=False, HAS_ELEN=False, BLOCK_N=BLOCK_N,
        FP8_NATIVE=fp8_native(q.device), DOT=tl_dot.OPERAND_DTYPE)
    return out, lse

