"""The work list of a call, as FlashMLA's tile scheduler has it: every query row's token tiles
(the main cache's, then the extra cache's) laid end to end, cut into shares that differ by at
most one unit (or, where that is cheaper, every ``share`` units), one share per persistent program. A query is split only where a share ends, and only split queries are
combined.

The kernels compute the cut themselves, from the shapes and, where ``topk_length`` or
``extra_topk_length`` is given, from the lengths on the device (:func:`mla.kernels.common.share_bounds`):
no host sync, so the call stays capturable. This module is the same work list on the host:
the reference the tests hold the kernels to, and the cost model that picks the cut when
every query has the same number of tiles (no lengths), where it is known before the call.

A program's time, in token tiles: the tiles of its share, plus a fixed cost per piece (a query
or part of one: load Q, drain the pipeline, store O) and per split piece (its partial output
written and read back by the combine); a call with split queries pays the combine's launch and
the kernel boundary once. The constants are fits to the H200 record (chapter 4 shows them).
"""
from __future__ import annotations

import dataclasses
import functools

#: fixed cost of one piece of a query in a program, in token tiles (Q in, O out, the pipeline)
PIECE_TILES = 2
#: extra cost of a split piece: its fp16 partial output written and read back by the combine
SPLIT_TILES = 1
#: the combine kernel's launch and boundary, paid once by a call with any split query
COMBINE_TILES = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def query_units(n_main: int, n_extra: int, block_n: int, unit: int = 1) -> tuple[int, int]:
    """(token tiles of the main cache, schedule units) of a query with ``n_main`` and
    ``n_extra`` valid positions: tiles of ``block_n`` tokens, ``unit`` tiles per schedule unit,
    and at least one unit (a query with no valid token still has its output written)."""
    tiles_main = cdiv(n_main, block_n)
    return tiles_main, max(1, cdiv(tiles_main + cdiv(n_extra, block_n), unit))


@dataclasses.dataclass(frozen=True)
class Piece:
    """Units ``[lo, hi)`` of query ``q``, in program ``program``; ``split`` when the query has
    other pieces, whose partial output then goes to slot ``slot`` for the combine."""

    program: int
    q: int
    lo: int
    hi: int
    split: bool
    slot: int


def share_range(p: int, total: int, num_programs: int, share: int = 0) -> tuple[int, int]:
    """Units ``[x0, x1)`` of program ``p``'s share of ``total`` units: cut every ``share`` units,
    or (``share`` 0) balanced over ``P = min(num_programs, total)`` programs, program p taking
    ``[floor(p*total/P), floor((p+1)*total/P))`` so that shares differ by at most one unit (and
    none is empty but those past the work, which a query's pieces never straddle)."""
    if share:
        return p * share, min((p + 1) * share, total)
    n = min(num_programs, total)
    return min(p * total // n, total), min((p + 1) * total // n, total)


def work_list(units: list[int], num_programs: int, share: int = 0) -> list[Piece]:
    """The pieces of the flat schedule: queries of ``units`` units each, laid end to end, cut
    every ``share`` units into ``cdiv(total, share)`` programs, or (``share`` 0) into
    ``num_programs`` balanced shares (:func:`share_range`), as the kernels do when the lengths
    are on the device. A program's first query's partial goes to slot ``2p``, any other split
    piece (its last query's) to ``2p + 1``."""
    total = sum(units)
    programs = cdiv(total, share) if share else num_programs
    starts, c = [], 0
    for u in units:
        starts.append(c)
        c += u
    pieces, q = [], 0
    for p in range(programs):
        x0, x1 = share_range(p, total, num_programs, share)
        if x0 >= x1:
            continue
        while starts[q] + units[q] <= x0:
            q += 1
        first = q
        for j in range(first, len(units)):
            if starts[j] >= x1:
                break
            lo, hi = max(x0 - starts[j], 0), min(x1 - starts[j], units[j])
            pieces.append(Piece(p, j, lo, hi, lo > 0 or hi < units[j], 2 * p + (j != first)))
    return pieces


def splits_a_query(n_q: int, units: int, num_programs: int, share: int = 0) -> bool:
    """Whether the cut of :func:`work_list` splits any of ``n_q`` queries of ``units`` units
    each: whether a share ends inside a query."""
    total = n_q * units
    if share:
        return share % units != 0 and share < total
    return any(share_range(p, total, num_programs)[0] % units for p in range(1, min(num_programs, total)))


def span(pieces: list[Piece]) -> dict:
    """A program's cost in tiles of the model above, keyed by program."""
    cost: dict = {}
    for pc in pieces:
        cost[pc.program] = cost.get(pc.program, 0) + (pc.hi - pc.lo) + PIECE_TILES + SPLIT_TILES * pc.split
    return cost


def modelled_time(units: list[int], num_programs: int, share: int = 0) -> float:
    """The model's time of a call cut as :func:`work_list` cuts it: the slowest program, plus
    the combine where any query is split."""
    pieces = work_list(units, num_programs, share)
    return max(span(pieces).values()) + COMBINE_TILES * any(p.split for p in pieces)


@functools.lru_cache(maxsize=4096)
def choose_cut(n_q: int, units: int, programs: int) -> tuple[int, int]:
    """(programs, share) for ``n_q`` queries of ``units`` units each on at most ``programs``
    persistent programs, by the model. It weighs cuts every ``share`` units (whole queries per
    program, which needs no combine; each query cut into ``m`` pieces; the least share that fits
    the programs) and balanced cuts (``share`` 0, :func:`share_range`: each query into ``m``
    pieces on ``n_q * m`` programs, or all the work over all the programs), and returns the
    cheapest; on a tie, the fewest programs, then the fixed share."""
    total = n_q * units
    least = cdiv(total, programs)
    shares = {cdiv(n_q, programs) * units, least}
    shares.update(cdiv(units, m) for m in range(2, units + 1) if cdiv(units, m) >= least)
    candidates = {(cdiv(total, s), s) for s in shares} | {(programs, 0)}
    candidates.update((n_q * m, 0) for m in range(1, min(units, programs // n_q) + 1))
    per = [units] * n_q
    return min(candidates, key=lambda c: (modelled_time(per, *c), c[0], c[1] == 0))
