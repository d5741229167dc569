"""The split-K combine: merge the partial results of a query token's splits into its output.

Each split of the decode kernels writes its heads' partial output, normalised by its own sum,
and the lse of its tokens in log2 units (-inf for a split with no valid token). The combine
weights the partials by ``2**(lse_split - max)``, which is one softmax over all the splits'
tokens, and applies the sink, which must see the whole softmax (a sink applied per split would
count it once per split).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import DIM, LN2, finish_softmax, sink_factor, to_bf16

#: heads per program and warps of the combine's launch
BLOCK_HC = 1
NUM_WARPS = 4


@triton.jit(do_not_specialize=["num_splits"])  # one variant for every split count
def combine_kernel(po_ptr, plse_ptr, out_ptr, lse_ptr, sink_ptr, s_q, h_q, num_splits,
                   HAS_SINK: tl.constexpr, BLOCK_HC: tl.constexpr):
    """Merge the split partials of BLOCK_HC heads of one query token; apply the sink."""
    tok = tl.program_id(0)
    hb = tl.program_id(1)
    b = tok // s_q
    s_idx = tok - b * s_q
    heads = hb * BLOCK_HC + tl.arange(0, BLOCK_HC)
    hmask = heads < h_q
    c = tl.arange(0, DIM)
    base = tok.to(tl.int64) * num_splits * h_q
    m = tl.full([BLOCK_HC], float("-inf"), tl.float32)
    for sp in range(0, num_splits):
        m = tl.maximum(m, tl.load(plse_ptr + base + sp * h_q + heads, mask=hmask, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wsum = tl.zeros([BLOCK_HC], tl.float32)
    acc = tl.zeros([BLOCK_HC, DIM], tl.float32)
    for sp in range(0, num_splits):
        row = base + sp * h_q + heads
        w = tl.exp2(tl.load(plse_ptr + row, mask=hmask, other=float("-inf")) - m_safe)
        o = tl.load(po_ptr + row[:, None] * DIM + c[None, :], mask=hmask[:, None] & (w[:, None] > 0),
                    other=0.0).to(tl.float32)
        wsum += w
        acc += w[:, None] * o
    empty, wsafe, lse2 = finish_softmax(wsum, m_safe)
    lse = lse2 * LN2
    out = acc / wsafe[:, None]
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
        out = out * sink_factor(sink, lse, empty)[:, None]
    out = tl.where(empty[:, None], 0.0, out)
    tl.store(out_ptr + (tok.to(tl.int64) * h_q + heads)[:, None] * DIM + c[None, :],
             to_bf16(out), mask=hmask[:, None])
    tl.store(lse_ptr + (b * h_q + heads) * s_q + s_idx, tl.where(empty, float("inf"), lse), mask=hmask)


def launch_params(n_tokens: int, h_q: int, has_sink: bool) -> tuple:
    """(grid, constexpr and launch keywords) of the combine for ``n_tokens`` query tokens."""
    return (n_tokens, (h_q + BLOCK_HC - 1) // BLOCK_HC), dict(HAS_SINK=has_sink, BLOCK_HC=BLOCK_HC, num_warps=NUM_WARPS)
