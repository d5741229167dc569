"""The flat work list (mla.schedule) and the kernels' copy of it (mla.kernels.common.share_bounds):
every token tile of every query is assigned exactly once, whatever the shapes and lengths; a
query is split only where a share ends; the combine's records name exactly the split queries.
The kernels' schedule runs here in Triton's interpreter, in a probe kernel; the decode itself on
odd shapes is held to the reference at the end."""
import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla
import triton
import triton.language as tl
from mla import schedule
from mla.kernels import combine
from mla.kernels.common import piece, share_bounds, write_share_record
from mla.validate import make_case, run_case

from conftest import DEVICE


def _check_cover(units, pieces, programs, share):
    """Every unit of every query in exactly one piece; each program's pieces contiguous and within
    its share; a query split exactly when it has more than one piece."""
    got = {q: [] for q in range(len(units))}
    for pc in pieces:
        assert 0 <= pc.lo < pc.hi <= units[pc.q]
        got[pc.q].append((pc.lo, pc.hi))
    for q, spans in got.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == units[q], (q, spans)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (q, spans)
    for pc in pieces:
        assert pc.split == (len(got[pc.q]) > 1)
    by_program = {}
    for pc in pieces:
        by_program.setdefault(pc.program, []).append(pc)
    start = [sum(units[:q]) for q in range(len(units))]
    total = sum(units)
    sizes = []
    for p, mine in by_program.items():
        flat = [(start[pc.q] + pc.lo, start[pc.q] + pc.hi) for pc in mine]
        if share:
            assert (flat[0][0], flat[-1][1]) == (p * share, min((p + 1) * share, total))
        else:
            n = min(programs, total)
            assert (flat[0][0], flat[-1][1]) == (p * total // n, (p + 1) * total // n)
        sizes.append(flat[-1][1] - flat[0][0])
        assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))
        # the slots of a program's split pieces: its first query's is 2p, any other's 2p + 1
        assert [pc.slot for pc in mine] == [2 * p] + [2 * p + 1] * (len(mine) - 1)
        assert sum(pc.split for pc in mine[1:-1]) == 0       # only the first and last can be split
    if not share:                                            # balanced: shares differ by at most one unit
        assert max(sizes) - min(sizes) <= 1 and max(sizes) == -(-total // programs)


@settings(max_examples=300, deadline=None)
@given(units=st.lists(st.integers(1, 40), min_size=1, max_size=60), programs=st.integers(1, 140),
       share=st.integers(0, 80))
def test_the_work_list_assigns_every_tile_exactly_once(units, programs, share):
    pieces = schedule.work_list(units, programs, share)
    used = {pc.program for pc in pieces}
    if share == 0:
        assert used == set(range(min(programs, sum(units))))     # the first programs, each with work
    else:
        assert used == set(range(math.ceil(sum(units) / share)))
    _check_cover(units, pieces, programs, share)
    n_q, per = len(units), units[0]
    if units == [per] * n_q:                                   # the closed form the launch rule uses
        assert schedule.splits_a_query(n_q, per, programs, share) == any(pc.split for pc in pieces)


def test_a_query_with_no_valid_token_still_has_a_unit():
    assert schedule.query_units(0, 0, 64) == (0, 1)
    assert schedule.query_units(65, 0, 64) == (2, 2)
    assert schedule.query_units(128, 1024, 64, unit=2) == (2, 9)      # 2 + 16 tiles in 128-token units


@pytest.mark.parametrize("n_q,units,programs,want", [
    (128, 32, 132, (128, 32)),    # DSA b128: one whole query a program, no combine (as the record ran)
    (256, 32, 132, (128, 64)),    # DSA b256: two whole queries a program
    (1, 32, 132, (32, 1)),        # DSA b1: one tile a program, 32 programs
    (8, 32, 132, (128, 2)),       # DSA b8: 128 programs of 2 tiles
    (296, 32, 132, (132, 72)),    # b148, s_q 2: the equal cut, not three waves of whole queries
    (32, 10, 132, (128, 0)),      # V4-CSA b32: each query in four balanced pieces (3, 2, 3, 2 tiles),
                                  # one a program: no program holds two pieces
])
def test_the_cut_follows_the_cost_model(n_q, units, programs, want):
    assert schedule.choose_cut(n_q, units, programs) == want


@settings(max_examples=200, deadline=None)
@given(n_q=st.integers(1, 300), units=st.integers(1, 64), programs=st.integers(1, 140))
def test_the_chosen_cut_fits_the_programs_and_is_no_worse_than_the_equal_cut(n_q, units, programs):
    got = schedule.choose_cut(n_q, units, programs)
    assert 1 <= got[0] <= programs
    per = [units] * n_q
    equal = math.ceil(n_q * units / programs)
    assert schedule.modelled_time(per, *got) <= schedule.modelled_time(per, programs, equal)


def test_the_cost_model_counts_pieces_splits_and_the_combine():
    # two queries of 4 units, one share of 8: one program, two whole pieces, no combine
    assert schedule.modelled_time([4, 4], 1, 8) == 8 + 2 * schedule.PIECE_TILES
    # shares of 3: a program holds at most 3 units in two pieces, both split; the combine runs
    assert schedule.modelled_time([4, 4], 3, 3) == (3 + 2 * schedule.PIECE_TILES + 2 * schedule.SPLIT_TILES
                                                    + schedule.COMBINE_TILES)
    # balanced over 3 programs: shares of 2, 3, 3 units; the middle one holds two split pieces
    assert schedule.modelled_time([4, 4], 3) == (3 + 2 * schedule.PIECE_TILES + 2 * schedule.SPLIT_TILES
                                                 + schedule.COMBINE_TILES)
    assert [(pc.program, pc.q, pc.lo, pc.hi) for pc in schedule.work_list([4, 4], 3)] == [
        (0, 0, 0, 2), (1, 0, 2, 4), (1, 1, 0, 1), (2, 1, 1, 4)]


# ------------------------------------------------------------------------------------------------
# The kernels' copy of the work list, in a probe kernel under the interpreter
# ------------------------------------------------------------------------------------------------

#: pieces a probe program may write
MAX_PIECES = 64


@triton.jit
def _probe_kernel(len_ptr, elen_ptr, out_ptr, rec_ptr, n_q, s_q, topk, etopk, share, num_programs,
                  BLOCK_N: tl.constexpr, UNIT: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr,
                  HAS_ELEN: tl.constexpr, ROWS: tl.constexpr, MAX: tl.constexpr):
    """Each program writes its pieces (q, lo, hi, split, slot) as the decode kernels find them,
    and its record for the combine."""
    p = tl.program_id(0)
    rows = None
    if ROWS > 0:
        rows = tl.arange(0, ROWS)
    p_last, x0, x1, q0, c, q_end, c_last, u_last = share_bounds(p, n_q, s_q, share, num_programs, topk, len_ptr, 1,
                                                               etopk, elen_ptr, 1, rows, BLOCK_N, UNIT, HAS_LEN,
                                                               HAS_EXTRA, HAS_ELEN)
    write_share_record(rec_ptr, p, p_last, x0, x1, q0, c, q_end, c_last, u_last, n_q, num_programs)
    k = 0
    for q in range(q0, q_end):
        lo, hi, split, _t1, _n1, _n2, units = piece(q, c, x0, x1, s_q, topk, len_ptr, 1, etopk, elen_ptr, 1, BLOCK_N,
                                                    UNIT, HAS_LEN, HAS_EXTRA, HAS_ELEN)
        row = out_ptr + (p * MAX + k) * 6
        tl.store(row + 0, q)
        tl.store(row + 1, lo)
        tl.store(row + 2, hi)
        tl.store(row + 3, split.to(tl.int32))
        tl.store(row + 4, 2 * p + (q != q0).to(tl.int32))
        tl.store(row + 5, units)
        c += units
        k += 1


def _kernel_pieces(b, s_q, topk, etopk, lengths, elengths, programs, share, unit, rows):
    block_n = 16
    lt = torch.tensor(lengths or [0], dtype=torch.int32)
    et = torch.tensor(elengths or [0], dtype=torch.int32)
    out = torch.full((programs, MAX_PIECES, 6), -7, dtype=torch.int32)
    rec = torch.full((3 * programs + b * s_q,), -7, dtype=torch.int32)
    _probe_kernel[(programs,)](lt, et, out, rec, b * s_q, s_q, topk, etopk, share, programs, BLOCK_N=block_n,
                               UNIT=unit, HAS_LEN=lengths is not None, HAS_EXTRA=etopk > 0,
                               HAS_ELEN=elengths is not None, ROWS=rows, MAX=MAX_PIECES)
    pieces = [(p, *map(int, r[:5])) for p in range(programs) for r in out[p] if r[0] != -7]
    units = {}
    for p in range(programs):
        for r in out[p]:
            if r[0] != -7:
                units[int(r[0])] = int(r[5])
    return pieces, rec[:3 * programs].view(programs, 3).tolist(), rec[3 * programs:].tolist(), units


def _expected_units(b, s_q, topk, etopk, lengths, elengths, unit):
    """Each query's units and its token tiles of both caches, counted here from the lengths."""
    units, tiles = [], []
    for q in range(b * s_q):
        n1 = topk if lengths is None else min(topk, max(lengths[q // s_q], 0))
        n2 = 0 if not etopk else (etopk if elengths is None else min(etopk, max(elengths[q // s_q], 0)))
        units.append(schedule.query_units(n1, n2, 16, unit)[1])
        tiles.append(-(-n1 // 16) + -(-n2 // 16))
    return units, tiles


@settings(max_examples=25, deadline=None)
@given(data=st.data(), b=st.integers(1, 9), s_q=st.integers(1, 3), topk=st.integers(1, 100),
       etopk=st.sampled_from([0, 1, 37]), programs=st.integers(1, 12), unit=st.sampled_from([1, 2]),
       rows=st.sampled_from([0, 4, 16]))
def test_the_kernels_cut_the_work_list_as_the_host_does(data, b, s_q, topk, etopk, programs, unit, rows):
    """With lengths (each from 0 to past topk, prefix sums taken ``rows`` query rows at a time, or
    in the call of its own) or without (any share size, or balanced), the probe's pieces are the host's work
    list, and each program's record names the split query whose first piece it holds; with fewer
    query rows than programs, each query row's record names the program of its first piece if
    the query is split, else -1 (and with more, none is written)."""
    lengths = data.draw(st.one_of(st.none(), st.lists(st.integers(-1, topk + 5), min_size=b, max_size=b)))
    elengths = None
    if etopk:
        elengths = data.draw(st.one_of(st.none(), st.lists(st.integers(0, etopk + 3), min_size=b, max_size=b)))
    has_len = lengths is not None or elengths is not None
    units, tiles = _expected_units(b, s_q, topk, etopk, lengths, elengths, unit)
    share = 0 if has_len else data.draw(st.integers(0, 2 * max(units)))
    want = schedule.work_list(units, programs, share)
    grid = programs if share == 0 else math.ceil(sum(units) / share)
    got, rec, by_query, got_units = _kernel_pieces(b, s_q, topk, etopk, lengths, elengths, grid, share, unit, rows)
    # the kernels' pieces are in tiles: a unit is UNIT tiles, and the last stops at the query's end
    assert got == [(pc.program, pc.q, pc.lo * unit, min(pc.hi * unit, tiles[pc.q]), int(pc.split), pc.slot)
                   for pc in want]
    assert all(got_units[q] == units[q] for q in got_units)
    firsts = {}
    for pc in want:
        if pc.split:
            firsts.setdefault(pc.q, pc)
    last = {q: max(pc.program for pc in want if pc.q == q) for q in firsts}
    expected = [[-1, 0, 0] for _ in range(grid)]
    for q, pc in firsts.items():
        expected[pc.program] = [q, last[q], pc.slot]
    assert rec == expected
    n_q = b * s_q
    if n_q < grid:
        assert by_query == [firsts[q].program if q in firsts else -1 for q in range(n_q)]
    else:
        assert by_query == [-7] * n_q


# ------------------------------------------------------------------------------------------------
# The decode on the schedule's edge cases
# ------------------------------------------------------------------------------------------------

SCHEDULE_CASES = {
    "b3, a share ending mid-query": (dict(b=3, s_q=1, h_q=4, topk=70, page=16), 4),
    "b1 s_q2, lengths, fewer rows than shares": (dict(b=1, s_q=2, h_q=3, topk=90, page=8, extra_topk=20,
                                                      lengths=True), 5),
    "b74 s_q2, one tile each": (dict(b=74, s_q=2, h_q=2, topk=9, page=8, sink_inf=False), None),
    "b257, lengths 0 and full": (dict(b=257, s_q=1, h_q=1, topk=20, page=4, lengths=True), None),
    "b148, all invalid": (dict(b=148, s_q=1, h_q=2, topk=17, page=16, invalid_frac=1.0), 7),
    "both caches at P 2, lengths": (dict(b=5, s_q=2, h_q=3, topk=33, page=2, extra_topk=40, extra_page=2,
                                         lengths=True, empty_query=True), 6),
    "lengths, more programs than units": (dict(b=3, s_q=1, h_q=2, topk=60, page=8, lengths=True), 11),
}


@pytest.mark.parametrize("name", list(SCHEDULE_CASES))
def test_the_decode_holds_on_the_schedules_edge_cases(name, device):
    kw, programs = SCHEDULE_CASES[name]
    case = make_case(**kw, device=device, seed=len(name))
    if "lengths 0 and full" in name:
        case["topk_length"][: kw["b"] // 2] = kw["topk"]
        case["topk_length"][kw["b"] // 2:] = 0
        case["topk_length"][-1] = kw["topk"]
    plan = mla.plan(**case, impl="mma", programs=programs)
    for buf in plan.workspace[:2]:      # poisoned partials: a slot the combine reads unwritten shows
        if buf is not None:
            buf.fill_(float("nan"))
    out_ok, lse_ok = run_case(functools.partial(mla.sparse_decode, plan=plan), case)
    assert out_ok.ok and lse_ok.ok, f"{plan}: {out_ok} | {lse_ok}"


@pytest.mark.parametrize("name", ["b3, a share ending mid-query", "b1 s_q2, lengths, fewer rows than shares",
                                  "both caches at P 2, lengths"])
def test_the_combine_runs_a_program_per_row_where_rows_are_fewer_than_shares(name):
    """Fewer query rows than shares: a combine program per query row, which finds its pieces
    through the row's record; else a program per share (most of them empty at small b)."""
    kw, programs = SCHEDULE_CASES[name]
    n_q = kw["b"] * kw["s_q"]
    grid, meta = combine.launch_params(programs, n_q, kw["h_q"], True, True)
    assert meta["BY_QUERY"] == (n_q < programs)
    assert grid == ((n_q if n_q < programs else programs), kw["h_q"])
    assert combine.launch_params(programs, n_q, kw["h_q"], True, False)[0][0] == n_q    # uniform splits


@pytest.fixture
def device():
    return DEVICE
