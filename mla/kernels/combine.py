"""The split-K combine: merge the partial results of a split query into its output.

Each piece of a split query writes its heads' partial output, normalised by its own sum, and
the lse of its tokens in log2 units (-inf for a piece with no valid token). The combine weights
the partials by ``2**(lse_piece - max)``, which is one softmax over all the pieces' tokens, and
applies the sink, which must see the whole softmax (a sink applied per piece would count it once
per piece). Only split queries are combined: a whole query's output is the decode's.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import DIM, LN2, finish_softmax, sink_factor, to_bf16

#: warps of the combine's launch, whose programs take one head each (eight heads a program in the
#: work list's grid was tried and rejected: results/h200/mma_versions.json, "combine 8 heads")
NUM_WARPS = 2
#: software-pipeline stages of the loop over pieces (its loads issued ahead of their use)
NUM_STAGES = 3


@triton.jit
def _slot(i, first_slot, p, FLAT: tl.constexpr):
    """The partial slot of piece ``i`` of a split query: in the work list (FLAT), the first
    piece's slot, then slot ``2j`` of each later program ``j``; in the uniform split, ``p + i``."""
    if FLAT:
        return tl.where(i == 0, first_slot, 2 * (p + i))
    return p + i


@triton.jit
def pieces_of(rec_ptr, p, num_splits, FLAT: tl.constexpr, BY_QUERY: tl.constexpr):
    """Program ``p``'s split query and its pieces (see :func:`combine_kernel`): (the query row,
    or -1 where the program has none; its pieces; the first piece's slot; the base of
    :func:`_slot`)."""
    if BY_QUERY:
        start = tl.load(rec_ptr + 3 * num_splits + p)
        first = tl.maximum(start, 0)
        tok = tl.where(start >= 0, p, -1)
        n_pieces = tl.load(rec_ptr + 3 * first + 1) - first + 1
        first_slot = tl.load(rec_ptr + 3 * first + 2)
        base_slot = first
    elif FLAT:
        tok = tl.load(rec_ptr + 3 * p)
        n_pieces = tl.load(rec_ptr + 3 * p + 1) - p + 1
        first_slot = tl.load(rec_ptr + 3 * p + 2)
        base_slot = p
    else:
        tok = p
        n_pieces = num_splits
        first_slot = 0
        base_slot = p * num_splits
    return tok, n_pieces, first_slot, base_slot


@triton.jit
def store_query(acc, wsum, m, tok, b, s_idx, head, s_q, h_q, out_ptr, lse_ptr, sink_ptr, sink_stride,
                HAS_SINK: tl.constexpr):
    """The end of a query's merge for one head: ``acc`` and ``wsum``, the weighted sum of its
    pieces' partials and of their weights relative to the running maximum ``m`` (log2 units),
    to query row ``tok``'s output (sink applied; 0 for a query with no valid token) and its lse
    (natural log; +inf there), at batch ``b`` and position ``s_idx``, which the caller computes
    before its loop (after it, ptxas keeps the row out of the uniform registers)."""
    c = tl.arange(0, DIM)
    empty, wsafe, lse2 = finish_softmax(wsum, tl.where(m == float("-inf"), 0.0, m))
    lse = lse2 * LN2
    out = acc / wsafe
    if HAS_SINK:
        out = out * sink_factor(tl.load(sink_ptr + head * sink_stride), lse, empty)
    out = tl.where(empty, 0.0, out)
    tl.store(out_ptr + (tok.to(tl.int64) * h_q + head) * DIM + c, to_bf16(out))
    tl.store(lse_ptr + (b * h_q + head) * s_q + s_idx, tl.where(empty, float("inf"), lse))


@triton.jit(do_not_specialize=["s_q", "h_q", "num_splits"])
def combine_kernel(po_ptr, plse_ptr, rec_ptr, out_ptr, lse_ptr, sink_ptr, sink_stride, s_q, h_q, num_splits,
                   HAS_SINK: tl.constexpr, FLAT: tl.constexpr, BY_QUERY: tl.constexpr = 0):
    """Merge the partials of one split query for one head; apply the sink. FLAT
    (the work list of ``num_splits`` shares): program ``p`` takes the split query whose first
    piece share ``p`` holds (its record, written by the decode: none, and the program returns,
    where share ``p`` starts no split query); with BY_QUERY, program ``q`` takes query row ``q``
    if it is split, through the program of its first piece that the decode wrote for it. Else
    program ``q`` takes query row ``q``'s ``num_splits`` uniform pieces.

    One pass over the pieces with a running maximum (the online softmax over pieces). No load
    waits on another: a piece with no valid token has lse -inf, so weight 0, and a zero partial
    (the decode writes every piece's), so that its partial is read unmasked."""
    p = tl.program_id(0)
    head = tl.program_id(1)
    tok, n_pieces, first_slot, base_slot = pieces_of(rec_ptr, p, num_splits, FLAT, BY_QUERY)
    if tok >= 0:
        b = tok // s_q
        s_idx = tok - b * s_q
        c = tl.arange(0, DIM)
        m = float("-inf")
        wsum = 0.0
        acc = tl.zeros([DIM], tl.float32)
        for i in range(0, n_pieces):
            row = _slot(i, first_slot, base_slot, FLAT).to(tl.int64) * h_q + head
            lse = tl.load(plse_ptr + row)
            o = tl.load(po_ptr + row * DIM + c).to(tl.float32)
            m_new = tl.maximum(m, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            scale = tl.exp2(m - m_safe)
            w = tl.exp2(lse - m_safe)
            wsum = wsum * scale + w
            acc = acc * scale + w * o
            m = m_new
        store_query(acc, wsum, m, tok, b, s_idx, head, s_q, h_q, out_ptr, lse_ptr, sink_ptr, sink_stride, HAS_SINK)


def launch_params(programs: int, n_q: int, h_q: int, has_sink: bool, flat: bool) -> tuple:
    """(grid, constexpr and launch keywords) of the combine, one program per head of each: for the work
    list (``flat``) of ``programs`` shares, a program per share, or per query row where there are
    fewer query rows than shares (most shares then start no split query, and an empty program
    costs more than the lookup); for uniform splits, a program per query row."""
    by_query = flat and n_q < programs
    rows = programs if flat and not by_query else n_q
    return (rows, h_q), dict(HAS_SINK=has_sink, FLAT=int(flat), BY_QUERY=int(by_query), num_warps=NUM_WARPS,
                             num_stages=NUM_STAGES)
