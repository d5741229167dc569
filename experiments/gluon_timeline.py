"""Probe: a measured timeline of the Gluon kernel's chain (heads as M), from an instrumented build.

Chapter 4 draws the chain of one tile schematically. This probe builds a copy of
:mod:`mla.kernels.gluon_sm90` with a timer read after each step of the consumer warpgroups' tile
loop (:func:`~mla.kernels.gluon_sm90.consumers.consumer_heads`) and of the producer's
(:func:`~mla.kernels.gluon_sm90.ring._produce`), for the first ``--tiles`` tiles of every
program. The shipped package is not touched: its four modules are copied into a temporary
package with the edits below applied, and each edit asserts that the text it edits is in the
shipped source once, so that the probe fails loudly when the kernel changes.

The timer: ``%clock64``, the SM's cycle counter, read once per step (one ``CS2R``). Its
resolution is one cycle and every warpgroup of a program runs on one SM, so the steps of the
three lanes are comparable with one another. ``%globaltimer`` (ns, one clock for all SMs) is read
only where each lane opens and closes: the two reads turn the lane's cycles into ns (its span
is the whole program, so a coarse tick of that timer costs little accuracy) and place the
programs against one another. Thread 0 of each warpgroup writes (lane = ``%tid.x / 128``:
consumer warpgroups 0 and 1, then the producer's warpgroup), into an int64 buffer
``[programs, 3 lanes, HEAD + tiles * SLOTS]`` passed as an extra argument.

``--aot`` (no GPU) compiles the instrumented kernel for sm_90a beside the shipped one and reports
the stamps it holds, registers, spills and both tile loops' instruction counts; run it with
each Triton (``PYTHONPATH=/path/to/triton-3.6`` for the GPU image's). Without ``--aot`` (a Hopper
GPU): DSA b = 128 through ``mla``'s launch path, the instrumented output checked against the
shipped kernel's and the float64 reference, both kernels timed (CUDA graph, median), then one
launch whose stamps are kept.

    python experiments/gluon_timeline.py --aot [--out OUT.json]
    python experiments/gluon_timeline.py --out $OUT/gluon_timeline.json [--tiles 6] [--programs 0,1,66]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import pathlib
import re
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHIPPED = ROOT / "mla" / "kernels" / "gluon_sm90"
#: the instrumented copy's package name
PACKAGE = "gluon_sm90_stamped"

#: the lanes, in the order of their rows (``%tid.x // 128``: the default partition's two
#: warpgroups, then the producer partition's one)
LANES = ("consumer warpgroup 0", "consumer warpgroup 1", "producer")
#: a lane row's header: SM id, globaltimer and clock64 where the lane opens, then where it closes
HEADER = ("smid", "globaltimer_open", "clock_open", "globaltimer_close", "clock_close")
#: unwritten slots hold this (the buffer is filled with it before the kept launch)
UNSET = -1

# Each stamp point: (where, the text of the line it goes before or after, the step it ends as
# (name, kind), or None for the stamp that opens the tile). A step runs from the stamp before
# it to its own; ``kind`` is the schematic's colour (chapter 4), "wait" and "barrier" are the
# chain's stalls. Each text must be on exactly one line of its loop.
CONSUMER_STAMPS = (
    ("before", "_c, vs, _r, _s = tile_rows(", None),
    ("before", "mbarrier.wait(ready.index(st)", ("mask indices", "index")),
    ("after", "mbarrier.wait(ready.index(st)", ("wait ready", "wait")),
    ("after", "cta_barrier()          # both warpgroups", ("barrier", "barrier")),
    ("after", "_store_tile(k_smem, nb, sb, rope, OUT)", ("decode", "decode")),
    ("after", "mbarrier.arrive(empty.index(st))   # every consumer thread", ("fence, barrier, arrive empty", "barrier")),
    ("after", "s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))", ("S", "S")),
    ("after", "= softmax_step(", ("softmax", "softmax")),
    ("after", "o = o * gl.convert_layout(alpha", ("P store, O rescale", "P")),
    ("before", "o_tok = warpgroup_mma(p_smem, k_smem, o, is_async=True)", ("fence, barrier", "barrier")),
    ("after", "o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))", ("P.V", "PV")),
)
PRODUCER_STAMPS = (
    ("before", "mbarrier.wait(empty.index(st)", None),
    ("after", "mbarrier.wait(empty.index(st)", ("wait empty", "wait")),
    ("after", "_copy_tile((nope_r.index(st)", ("copy", "copy")),
    ("after", "async_copy.mbarrier_arrive(ready.index(st)", ("arrive ready", "copy")),
    ("before", "j += 1", ("next tile's rows", "index")),
)
#: stamp slots per tile in a lane's row (the consumer's count; the producer leaves the rest unset)
SLOTS = max(len(CONSUMER_STAMPS), len(PRODUCER_STAMPS))
#: which stamps each lane takes
LANE_STAMPS = {LANES[0]: CONSUMER_STAMPS, LANES[1]: CONSUMER_STAMPS, LANES[2]: PRODUCER_STAMPS}


def steps(stamps) -> list[dict]:
    """The steps a lane's stamps bound, in order: ``{"name", "kind"}``."""
    return [{"name": s[2][0], "kind": s[2][1]} for s in stamps if s[2] is not None]


def row_length(tiles: int) -> int:
    """int64 slots in one lane's row for ``tiles`` stamped tiles."""
    return len(HEADER) + tiles * SLOTS


# --------------------------------------------------------------------------------------------
# The instrumented build
# --------------------------------------------------------------------------------------------

def _asm(reads) -> str:
    """PTX that reads the special registers ``reads`` in order and, where ``$2`` is not 0, stores
    them as u64 at ``$1``, ``$1 + 8`` ..; returns (``$0``) the last one."""
    lines = ["{", ".reg .pred p;", ".reg .b32 s;", ".reg .b64 v<%d>;" % len(reads)]
    for i, reg in enumerate(reads):
        lines += ["mov.u32 s, %smid;", f"cvt.u64.u32 v{i}, s;"] if reg == "%smid" else [f"mov.u64 v{i}, {reg};"]
    lines.append("setp.ne.u32 p, $2, 0;")
    lines += [f"@p st.global.u64 [$1+{8 * i}], v{i};" for i in range(len(reads))]
    return "\n".join(lines + [f"mov.u64 $0, v{len(reads) - 1};", "}"])


STAMPS_MODULE = '''"""The timeline probe's stamps (written by experiments/gluon_timeline.py): thread 0 of each
warpgroup stores the SM's clock (and, where a lane opens and closes, the SM id and the global
timer) into its lane's row of the stamp buffer. The thread's row and whether it writes are
computed outside the stamps' assembly, so that the compiler computes them once."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

HEAD = gl.constexpr({head})
SLOTS = gl.constexpr({slots})
LANES = gl.constexpr({lanes})
CLOCK = gl.constexpr({clock!r})
OPEN = gl.constexpr({open!r})
CLOSE = gl.constexpr({close!r})


@gluon.jit
def program_row(stamp_ptr, p, tiles):
    """Program ``p``'s rows of the stamp buffer."""
    return stamp_ptr + p * (LANES * (HEAD + tiles * SLOTS))


@gluon.jit
def _lane(row, tiles):
    """This thread's lane row of the program's rows (lane = its warpgroup, ``%tid.x // 128``) and
    whether it writes there (1 for thread 0 of the warpgroup, else 0)."""
    tid = gl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)
    lane = tid >> 7
    return row + lane * (HEAD + tiles * SLOTS), ((tid & 127) == 0).to(gl.int32) * (lane < LANES).to(gl.int32)


@gluon.jit
def stamp(row, tiles, j, k: gl.constexpr):
    """Slot ``k`` of tile ``j``: the clock now, if ``j < tiles`` (nothing where ``row`` is None)."""
    if row is not None:
        lane_row, writes = _lane(row, tiles)
        on = writes * (j < tiles).to(gl.int32)
        gl.inline_asm_elementwise(CLOCK, "=l,l,r", [lane_row + (HEAD + j * SLOTS + k), on], dtype=gl.int64,
                                  is_pure=False, pack=1)


@gluon.jit
def stamp_open(row, tiles):
    """The lane's header as it opens: SM id, global timer, clock."""
    if row is not None:
        lane_row, writes = _lane(row, tiles)
        gl.inline_asm_elementwise(OPEN, "=l,l,r", [lane_row, writes], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def stamp_close(row, tiles):
    """The lane's header as it closes: global timer, clock."""
    if row is not None:
        lane_row, writes = _lane(row, tiles)
        gl.inline_asm_elementwise(CLOSE, "=l,l,r", [lane_row + 3, writes], dtype=gl.int64, is_pure=False, pack=1)
'''


def _edit(src: str, old: str, new: str, what: str) -> str:
    """``src`` with its one ``old`` replaced by ``new``; asserts that ``old`` is there once."""
    n = src.count(old)
    assert n == 1, f"{what}: the shipped text {old!r} is there {n} times, not once: the kernel changed"
    return src.replace(old, new)


def _function(src: str, name: str) -> str:
    """The text of top-level function ``name`` in ``src``, from its decorator to the next one."""
    start = src.index(f"\ndef {name}(")
    start = src.rindex("\n@", 0, start) + 1
    end = src.find("\n\n\n@", start)
    return src[start:] if end < 0 else src[start:end + 1]


def _in_function(src: str, name: str, edit) -> str:
    """``src`` with function ``name``'s text replaced by ``edit(text)``."""
    text = _function(src, name)
    return _edit(src, text, edit(text), name)


def _open_and_close(text: str) -> str:
    """A partition function's text with its lane's header stamps: after its docstring, and at
    its end (after its loop over the queries)."""
    doc_end = text.index('"""', text.index('"""') + 3) + 4
    return (text[:doc_end] + "    stamp_open(stamp_row, stamp_tiles)\n" + text[doc_end:].rstrip("\n")
            + "\n    stamp_close(stamp_row, stamp_tiles)\n")


def _stamp_loop(text: str, head: str, tail: str, stamps, what: str) -> str:
    """A function's text with its tile loop (from the line ``head`` to the line ``tail``, each
    there once) stamped: each point of ``stamps`` as a ``stamp`` call before or after the one
    loop line that holds its text, at that line's indent."""
    start = text.index(head) if text.count(head) == 1 else None
    assert start is not None, f"{what}: the loop {head.strip()!r} is not there once"
    end = text.index(tail, start)
    lines = text[start:end].split("\n")
    marks = {}
    for k, (where, needle, _step) in enumerate(stamps):
        hits = [i for i, line in enumerate(lines) if needle in line]
        assert len(hits) == 1, f"{what}: {needle!r} is on {len(hits)} lines of the loop, not one: the kernel changed"
        i = hits[0]
        if where == "after":             # a one-line statement: the stamp goes on the next line
            assert lines[i].count("(") == lines[i].count(")"), f"{what}: {needle!r} continues on the next line"
        marks.setdefault(i if where == "before" else i + 1, []).append(k)
    out = []
    for i, line in enumerate(lines + [""]):
        for k in marks.get(i, ()):
            ref = lines[i] if i < len(lines) and lines[i].strip() else lines[i - 1]
            indent = ref[:len(ref) - len(ref.lstrip())]
            out.append(f"{indent}stamp(stamp_row, stamp_tiles, j, {k})")
        out.append(line)
    return text[:start] + "\n".join(out[:-1]) + text[end:]


def _stamp_params(text: str, old: str) -> str:
    return _edit(text, old, old[:-2] + ", stamp_row=None, stamp_tiles=0):", "signature")


def instrumented_sources() -> dict:
    """The instrumented package's modules, by file name: the shipped ones with the stamps."""
    src = {p.name: p.read_text() for p in SHIPPED.glob("*.py")}
    assert set(src) == {"__init__.py", "cluster.py", "compat.py", "consumers.py", "kernel.py", "ring.py"}, sorted(src)
    imports = "from .stamps import program_row, stamp, stamp_close, stamp_open\n"

    ring = _edit(src["ring.py"], "from .compat import cp_async\n", "from .compat import cp_async\n" + imports,
                 "ring.py")
    ring = _in_function(ring, "_produce", lambda t: _stamp_loop(
        _stamp_params(t, "LP: gl.constexpr, V32: gl.constexpr = False):"),
        "    for ti in range(lo, lo + ", "    return j\n", PRODUCER_STAMPS,
        "_produce"))
    ring = _in_function(ring, "producer", lambda t: _open_and_close(_edit(
        _stamp_params(t, "             RING_TILES: gl.constexpr, V32: gl.constexpr = False):"),
        "                     RING_TILES, LP, V32)\n", "                     RING_TILES, LP, V32, stamp_row, stamp_tiles)\n",
        "producer")))

    cons = _edit(src["consumers.py"], "from .compat import cta_barrier, reinterpret\n",
                 "from .compat import cta_barrier, reinterpret\n" + imports, "consumers.py")
    cons = _in_function(cons, "consumer_heads", lambda t: _open_and_close(_stamp_loop(
        _stamp_params(t, "STAGES: gl.constexpr, HEADS: gl.constexpr, V32: gl.constexpr = False):"),
        "        for ti in range(lo, hi):\n", "            j += 1\n", CONSUMER_STAMPS, "consumer_heads")))

    kern = _edit(src["kernel.py"], "from .compat import cta_barrier, reinterpret\n",
                 "from .compat import cta_barrier, reinterpret\n" + imports, "kernel.py")
    kern = _edit(kern, '"share", "num_programs"])', '"share", "num_programs", "stamp_tiles"])', "kernel.py")
    kern = _edit(kern, "    n_q, s_q, h_q, sm_scale_log2, share, num_programs,\n",
                 "    n_q, s_q, h_q, sm_scale_log2, share, num_programs, stamp_ptr, stamp_tiles,\n", "kernel.py")
    kern = _edit(kern, "    p = gl.program_id(1)\n",
                 "    p = gl.program_id(1)\n    stamp_row = program_row(stamp_ptr, p, stamp_tiles)\n", "kernel.py")
    kern = _edit(kern, "ALIGN, STAGES, HEADS, V32)),\n            (producer, (",
                 "ALIGN, STAGES, HEADS, V32, stamp_row, stamp_tiles)),\n            (producer, (", "kernel.py")
    kern = _edit(kern, "STAGES, PW, 1, V32)),\n", "STAGES, PW, 1, V32, stamp_row, stamp_tiles)),\n", "kernel.py")

    out = {name: text.replace("from ..", "from mla.kernels.") for name, text in
           {**src, "ring.py": ring, "consumers.py": cons, "kernel.py": kern}.items()}
    out["stamps.py"] = STAMPS_MODULE.format(
        head=len(HEADER), slots=SLOTS, lanes=len(LANES), clock=_asm(["%clock64"]),
        open=_asm(["%smid", "%globaltimer", "%clock64"]), close=_asm(["%globaltimer", "%clock64"]))
    return out


def build():
    """The instrumented package, imported (its ``kernel.gluon_decode_kernel`` takes two more
    arguments after ``num_programs``: ``stamp_ptr``, the int64 buffer, and ``stamp_tiles``)."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    folder = pathlib.Path(tempfile.mkdtemp(prefix="gluon_timeline_")) / PACKAGE
    folder.mkdir()
    for name, text in instrumented_sources().items():
        (folder / name).write_text(text)
    sys.path.insert(0, str(folder.parent))
    try:
        return importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(folder.parent))


# --------------------------------------------------------------------------------------------
# Ahead of time (no GPU)
# --------------------------------------------------------------------------------------------

#: the extra arguments' types, for the ahead-of-time compile
STAMP_TYPES = {"stamp_ptr": "*i64", "stamp_tiles": "i32"}


def _ops_per_loop(sass: str, ops: tuple) -> list:
    """:func:`mla.aot.sass_loops` of the innermost loops that issue any of ``ops``, their count
    in ``"tensor_core"`` (``("LDGSTS",)``: the producer's cp.async loop)."""
    from mla import aot

    saved, aot.TENSOR_OPS = aot.TENSOR_OPS, ops
    try:
        return aot.sass_loops(sass)
    finally:
        aot.TENSOR_OPS = saved


def compile_report(kernel, types: dict | None = None) -> dict:
    """One heads-as-M build of ``kernel`` for sm_90a: registers, spill bytes, both partitions'
    tile loops (the consumer's, which issues wgmma; the producer's, which issues cp.async), the
    reads of each timer in the whole kernel, and its threads."""
    from mla import aot
    from mla.kernels import gluon_sm90

    v = aot.gluon_variant(loops=True, asm=("ptx", "llir"))
    saved, gluon_sm90.gluon_decode_kernel = gluon_sm90.gluon_decode_kernel, kernel   # aot looks it up by name
    try:
        r = aot._compile_in_process(v["kernel"], 90, v["constexprs"], v["num_warps"], v["num_stages"],
                                    want_asm=tuple(v["asm"]), types=types, loops=True)
    finally:
        gluon_sm90.gluon_decode_kernel = saved
    ptx, llir = r.pop("ptx"), r.pop("llir")
    sass = aot._ptxas_usage(ptx, 90, want_sass=True)[2]
    threads = re.search(r'"nvvm.reqntid"="(\d+)"', llir)
    producer = [{"cp_async" if k == "tensor_core" else k: n for k, n in loop.items()}
                for loop in _ops_per_loop(sass, ("LDGSTS",))]
    consumer = r.pop("loops")
    return {**r, "consumer_loops": consumer, "producer_loops": producer,
            "clock_reads": len(re.findall(r"SR_CLOCKLO", sass)),
            "globaltimer_reads": len(re.findall(r"SR_GLOBALTIMERLO", sass)),
            "threads": int(threads.group(1)) if threads else None}


def run_aot() -> dict:
    """The shipped and the instrumented kernel compiled for sm_90a, the record of both."""
    import triton

    from mla.bench import code_commit
    from mla.kernels import gluon_sm90

    shipped = compile_report(gluon_sm90.gluon_decode_kernel)
    stamped = compile_report(build().gluon_decode_kernel, STAMP_TYPES)
    return {"about": "Dev probe (no GPU): the Gluon kernel, heads as M (sink, lengths and extra cache on), "
                     "compiled ahead of time for sm_90a as shipped and with the timeline's stamps "
                     f"({len(CONSUMER_STAMPS)} per consumer tile, {len(PRODUCER_STAMPS)} per producer tile, "
                     "a header where each lane opens and closes)",
            "triton": triton.__version__, "commit": code_commit(ROOT), "shipped": shipped, "stamped": stamped,
            "stamps_in_source": {"consumer_tile": len(CONSUMER_STAMPS), "producer_tile": len(PRODUCER_STAMPS),
                                 "per_lane_header": 2}}


def check_aot(rec: dict) -> list[str]:
    """What is wrong with an ``--aot`` record, as sentences (empty: nothing): the stamps all in
    the code, the producer on the warps whose lane the stamps assume, and no spill the stamps
    added (the kernel's spill bytes and its loops' spill instructions no higher than shipped)."""
    bad = []
    s, t = rec["shipped"], rec["stamped"]
    want = len(CONSUMER_STAMPS) + len(PRODUCER_STAMPS) + 4     # each loop's stamps, and two headers a partition
    if t["clock_reads"] != want:
        bad.append(f"{t['clock_reads']} clock reads in the stamped kernel, expected {want}")
    if t["globaltimer_reads"] != 4 or s["clock_reads"] or s["globaltimer_reads"]:
        bad.append(f"global timer reads: stamped {t['globaltimer_reads']} (expected 4), "
                   f"shipped {s['globaltimer_reads']}")
    if t["threads"] != 128 * len(LANES):
        bad.append(f"{t['threads']} threads, not one warpgroup a lane ({128 * len(LANES)})")
    if t["spill_bytes"] > s["spill_bytes"]:
        bad.append(f"spill bytes {s['spill_bytes']} -> {t['spill_bytes']}")
    for key in ("consumer_loops", "producer_loops"):
        if len(t[key]) != len(s[key]):
            bad.append(f"{key}: {len(s[key])} loops shipped, {len(t[key])} stamped")
        for a, b in zip(s[key], t[key]):
            if b["spill_loads"] > a["spill_loads"] or b["spill_stores"] > a["spill_stores"]:
                bad.append(f"{key}: spill loads/stores {a['spill_loads']}/{a['spill_stores']} -> "
                           f"{b['spill_loads']}/{b['spill_stores']}")
    return bad


# --------------------------------------------------------------------------------------------
# The stamps as a record (no GPU needed: tests feed it synthetic rows)
# --------------------------------------------------------------------------------------------

def program_timeline(rows, program: int) -> dict:
    """One program's stamps (``rows``: its three lane rows of the buffer, int64 as lists) as the
    record's entry: its SM, ns per clock cycle (from the consumer lane 0's global-timer span), its
    start on the global timer, and per lane per tile each step's ``[start, end]`` in ns from the
    program's first stamp. A tile whose stamps are not all written ends the lane's list."""
    head = {lane: dict(zip(HEADER, row[:len(HEADER)])) for lane, row in zip(LANES, rows)}
    h0 = head[LANES[0]]
    if UNSET in h0.values() or h0["clock_close"] <= h0["clock_open"]:
        raise ValueError(f"program {program}: consumer warpgroup 0's header is not written: {h0}")
    ns_per_cycle = (h0["globaltimer_close"] - h0["globaltimer_open"]) / (h0["clock_close"] - h0["clock_open"])
    smids = {h["smid"] for h in head.values()}
    if len(smids) != 1:
        raise ValueError(f"program {program}: its lanes report SMs {sorted(smids)}")
    tiles_per_row = (len(rows[0]) - len(HEADER)) // SLOTS
    clock0 = min(h["clock_open"] for h in head.values())
    lanes = {}
    for lane, row in zip(LANES, rows):
        stamps, names = LANE_STAMPS[lane], [s["name"] for s in steps(LANE_STAMPS[lane])]
        tiles = []
        for t in range(tiles_per_row):
            slots = row[len(HEADER) + t * SLOTS:][:len(stamps)]
            if UNSET in slots:
                break
            ns = [round((c - clock0) * ns_per_cycle, 1) for c in slots]
            tiles.append({name: [ns[k], ns[k + 1]] for k, name in enumerate(names)})
        lanes[lane] = {"open_ns": round((head[lane]["clock_open"] - clock0) * ns_per_cycle, 1),
                       "close_ns": round((head[lane]["clock_close"] - clock0) * ns_per_cycle, 1), "tiles": tiles}
    return {"program": program, "sm": smids.pop(), "ns_per_cycle": round(ns_per_cycle, 5),
            "globaltimer_open": min(h["globaltimer_open"] for h in head.values()), "lanes": lanes}


def check_timeline(doc: dict) -> list[str]:
    """What is wrong with a timeline record, as sentences (empty: nothing): every program has the
    three lanes, each step a ``[start, end]`` with start <= end, each lane's steps in order (a
    step starts where the one before it ended), and the record's step names are its lanes'."""
    bad = []
    want = {lane: [s["name"] for s in doc["steps"][lane]] for lane in LANES} if "steps" in doc else {}
    for prog in doc.get("programs", []):
        p = prog.get("program")
        if set(prog.get("lanes", {})) != set(LANES):
            bad.append(f"program {p}: lanes {sorted(prog.get('lanes', {}))}, not {list(LANES)}")
            continue
        for lane, entry in prog["lanes"].items():
            last = -math.inf
            for t, tile in enumerate(entry["tiles"]):
                if want and list(tile) != want[lane]:
                    bad.append(f"program {p}, {lane}, tile {t}: steps {list(tile)}, not {want[lane]}")
                for name, (a, b) in tile.items():
                    if not a <= b:
                        bad.append(f"program {p}, {lane}, tile {t}, {name}: ends before it starts ({a} > {b})")
                    if a < last:
                        bad.append(f"program {p}, {lane}, tile {t}, {name}: starts before the step before it ended")
                    last = b
    return bad


# --------------------------------------------------------------------------------------------
# On the GPU
# --------------------------------------------------------------------------------------------

class Stamped:
    """The instrumented kernel where ``mla``'s launch looks the shipped one up: ``[grid](*args,
    **constexprs)`` launches it with the stamp buffer appended. It returns no compiled kernel, so
    that a :class:`mla.dispatch.BoundLaunch` never binds it for its direct path (which would drop
    the two arguments): every launch takes Triton's path."""

    def __init__(self, kernel, stamps, tiles: int):
        self.kernel, self.stamps, self.tiles = kernel, stamps, tiles

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **constexprs):
            launch(*args, stamp_ptr=self.stamps, stamp_tiles=self.tiles, **constexprs)
        return run


@contextlib.contextmanager
def stamped_kernel(stamps, tiles: int):
    """Inside the block, ``mla``'s Gluon launches run the instrumented kernel into ``stamps``."""
    from mla.kernels.gluon_sm90 import kernel as shipped

    saved = shipped.gluon_decode_kernel
    shipped.gluon_decode_kernel = Stamped(build().kernel.gluon_decode_kernel, stamps, tiles)
    try:
        yield
    finally:
        shipped.gluon_decode_kernel = saved


def _globaltimer_step(values) -> int:
    """The largest tick that all these global-timer reads are multiples of, past their minimum
    (how coarse the timer was on this card)."""
    base = min(values)
    return math.gcd(*[int(v - base) for v in values]) if len(values) > 1 else 0


def run_gpu(out: str, tiles: int, programs: list, rounds: int = 2) -> dict:
    import mla  # noqa: F401  (first: it may turn Triton's interpreter on)
    import torch

    from mla import bench
    from mla.configs import GluonConfig
    from mla.layout import fail
    from mla.validate import check_against_reference

    t_start = time.time()
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev) != (9, 0):
        sys.exit(f"gluon_timeline: needs a Hopper GPU (sm_90), this is {torch.cuda.get_device_name(dev)}")
    shape = next(s for s in bench.spec_shapes() if s.name == "DSA" and s.b == 128)
    case = bench.Case(shape, dev)
    call = case.caller("mma", config=GluonConfig("heads as M"))
    launch = call.plan.launch
    n_prog = launch.programs
    if any(not 0 <= p < n_prog for p in programs):
        fail("--programs", f"the launch has programs 0 .. {n_prog - 1}, got {programs}")
    out_ref, lse_ref = (t.clone() for t in call(0))
    stamps = torch.full((n_prog, len(LANES), row_length(tiles)), UNSET, dtype=torch.int64, device=dev)
    times = {"shipped": [], "stamped": []}
    for _ in range(rounds):                       # the two interleaved, each a CUDA graph's median
        times["shipped"].append(round(bench.time_graph(case, call), 2))
        with stamped_kernel(stamps, tiles):
            times["stamped"].append(round(bench.time_graph(case, call), 2))
    with stamped_kernel(stamps, tiles):
        for i in range(3):                        # warm-up launches, then the one kept
            call(i + 1)
        stamps.fill_(UNSET)
        torch.cuda.synchronize()
        out_s, lse_s = call(0)
        torch.cuda.synchronize()
    raw = stamps.cpu().tolist()
    ref_out, ref_lse = mla.sparse_decode_reference(case.q, case.cache, case.index_sets[0], **case.kwargs(0),
                                                   out_dtype=torch.float64)
    c_out, c_lse = check_against_reference(out_s, lse_s, ref_out, ref_lse)
    heads = [r[0][:len(HEADER)] for r in raw]          # each program's consumer warpgroup 0 header
    problems = [f"program {p}: consumer warpgroup 0's header is not written" for p, h in enumerate(heads)
                if UNSET in h]
    timer_reads = [h[i] for h in heads if UNSET not in h for i in (1, 3)]
    t_open = min(timer_reads[::2])
    kept = []
    for p in programs:
        try:
            kept.append(program_timeline(raw[p], p))
        except ValueError as e:       # keep the raw stamps and the timings all the same
            problems.append(str(e))
    doc = {
        "about": "A measured timeline of the Gluon kernel's chain, heads as M (experiments/gluon_timeline.py): "
                 "per program, lane and tile, each step's start and end in ns from the program's first stamp, "
                 f"for the first {tiles} tiles of every program of one launch (the programs listed here kept); "
                 "%clock64 per step (written by thread 0 of each warpgroup, so warps 0, 4 and 8), turned into "
                 "ns by consumer warpgroup 0's %globaltimer span. raw: each kept program's three lane rows as "
                 "written, int64 (the header's fields, then per tile its stamps, a tile's first stamp opening "
                 "its first step; -1 where nothing was written); all_programs: every program's SM and span on "
                 "the global timer, ns from the first program's start.",
        "provenance": bench.provenance(bench.ceilings(dev)),
        "shape": {"name": shape.name, "b": shape.b, "s_q": shape.s_q, "h_q": shape.h_q, "topk": shape.topk,
                  "page": shape.page, "pool_bytes": case.cache.untyped_storage().nbytes()},
        "launch": {"label": launch.label, "programs": n_prog, "share": launch.share},
        "tiles": tiles, "lanes": list(LANES), "header": list(HEADER),
        "steps": {lane: steps(LANE_STAMPS[lane]) for lane in LANES},
        "us_graph": times,
        "stamped_over_shipped": round(min(times["stamped"]) / min(times["shipped"]), 4),
        "check": {"bitwise_same_as_shipped": bool(torch.equal(out_s, out_ref) and torch.equal(lse_s, lse_ref)),
                  "out_ok": bool(c_out.ok), "lse_ok": bool(c_lse.ok), "out_cos_diff": c_out.cos_diff,
                  "lse_cos_diff": c_lse.cos_diff},
        "globaltimer_step_ns": _globaltimer_step(timer_reads),
        "all_programs": [{"program": p, "sm": h[0], "open_ns": h[1] - t_open, "close_ns": h[3] - t_open}
                         for p, h in enumerate(heads) if UNSET not in h],
        "programs": kept,
        "raw": {str(p): raw[p] for p in programs},
        "seconds": round(time.time() - t_start, 1),
    }
    doc["problems"] = problems + check_timeline(doc)
    pathlib.Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: doc[k] for k in ("us_graph", "stamped_over_shipped", "check", "globaltimer_step_ns",
                                          "problems", "seconds")}, indent=1))
    return doc


def _programs(text: str) -> list:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of program numbers, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"program numbers are 0 or more, got {text!r}")
    return out


def _tiles(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 32:
        raise argparse.ArgumentTypeError(f"1 to 32 tiles (a DSA query has 32), got {n}")
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aot", action="store_true", help="compile ahead of time for sm_90a (no GPU) and report")
    ap.add_argument("--out", help="where the record goes (JSON): by default $OUT/gluon_timeline.json on the GPU; "
                                  "with --aot it is printed, and written here if given")
    ap.add_argument("--tiles", type=_tiles, default=6, help="tiles stamped per program (default 6)")
    ap.add_argument("--programs", type=_programs, default=[0, 1, 66],
                    help="programs whose stamps the record keeps, comma-separated (default 0,1,66)")
    a = ap.parse_args(argv)
    if a.aot:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            sys.exit("gluon_timeline --aot: Triton was imported with its interpreter on; run it as a script")
        os.environ["TRITON_INTERPRET"] = "0"      # compiled, not interpreted: before Triton is imported
        rec = run_aot()
        rec["problems"] = check_aot(rec)
        text = json.dumps(rec, indent=1)
        if a.out:
            pathlib.Path(a.out).write_text(text + "\n")
        print(text)
        return 1 if rec["problems"] else 0
    import mla

    if mla.INTERPRET:
        sys.exit("gluon_timeline: needs a Hopper GPU (or --aot)")
    out = a.out or os.path.join(os.environ.get("OUT", "."), "gluon_timeline.json")
    doc = run_gpu(out, a.tiles, a.programs)
    return 1 if doc["problems"] or not doc["check"]["out_ok"] or not doc["check"]["lse_ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
