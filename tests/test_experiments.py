"""Every module in experiments/ still imports against the package: each probe script prints its
usage with ``--help`` and exits 0 without a GPU (the work sits under ``__main__``), and the
library modules (no ``__main__``) import in-process. Some probes' CPU halves are tested here too:
the GPU validation's arguments, and the Gluon timeline's instrumented build, its ahead-of-time
check, its record and the book's figure of it (on synthetic stamps)."""
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
#: modules that other code imports (tests, notebooks), not scripts: no ``__main__``, no ``--help``
LIBRARIES = ("broken_decodes", "autotune_demos", "autotune_mla")
SCRIPTS = sorted(p.stem for p in EXPERIMENTS.glob("*.py") if p.stem != "__init__" and p.stem not in LIBRARIES)


def test_the_lists_cover_the_folder():
    assert SCRIPTS, "no probe scripts found in experiments/"
    for name in LIBRARIES:
        assert (EXPERIMENTS / f"{name}.py").is_file(), name


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_help(name):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, f"experiments/{name}.py", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"experiments/{name}.py --help exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip(), f"experiments/{name}.py --help printed nothing"
    assert "usage:" in r.stdout, r.stdout


@pytest.mark.parametrize("name", LIBRARIES)
def test_library_imports(name):
    mod = importlib.import_module(f"experiments.{name}")
    assert mod.__doc__


def test_the_gpu_validations_bf16_variant_reaches_the_kernel(monkeypatch):
    """scripts/gpu_validation.py's "mma-bf16" probe launches the tl.dot kernel with bf16 operands
    (its plan's launches hold the constexprs it changes), not the shipped fp16 ones."""
    import triton.language as tl

    from mla import dispatch
    from mla.validate import make_case

    gv = _gpu_validation()
    seen = []

    class Recording:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw)

    monkeypatch.setattr(dispatch.tl_dot, "tl_dot_decode_kernel", Recording())
    c = make_case(b=1, s_q=1, h_q=4, topk=16, page=16, sink=False, seed=1, device=DEVICE)
    gv._bf16_operands(c["q"], c["k_cache"], c["indices"])
    assert seen and all(kw["DOT"] is tl.bfloat16 for kw in seen)


def _gpu_validation():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_validation", ROOT / "scripts" / "gpu_validation.py")
    gv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gv)
    return gv


def test_the_gpu_validation_refuses_an_unknown_impl(capsys):
    with pytest.raises(SystemExit) as e:
        _gpu_validation().main(["--impls", "mma-tl,nonsense", "--device", "cpu"])
    assert e.value.code == 2
    assert "--impls: nonsense" in capsys.readouterr().err


def test_the_gpu_validation_runs_only_the_named_impls(tmp_path):
    """--impls: the counted rows are those impls' only, and the summary says which ran."""
    import json

    rc = _gpu_validation().main(["--quick", "--device", "cpu", "--impls", "reference,mma-tl", "--workers", "1",
                                 "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "validation.json").read_text())
    assert doc["summary"]["impls"] == ["reference", "mma-tl"]
    assert {r["impl"] for r in doc["records"]} == {"reference", "mma-tl"}
    assert rc == 0 and doc["summary"]["failures"] == 0


def test_the_gpu_validation_runs_v32_cases_on_every_impl_but_the_gluon_forms_it_lacks():
    """The Gluon kernel reads DeepSeek-V3.2's cache heads as M only, the portable Gluon kernel and
    the cluster form not at all: their other forced impls skip V3.2's cases (no row, no error),
    every other impl runs them; MODEL1's cases run every impl."""
    import dataclasses
    import time

    import mla.validate as mv

    gv = _gpu_validation()
    v32, model1 = mv.v32_cases()[0], mv.odd_cases()[0]
    assert gv.impls_for(v32, gv.COUNTED) == tuple(n for n in gv.COUNTED if n not in gv.GLUON_PORTABLE
                                                  and n != "mma-wgmma-cluster"
                                                  and (n not in gv.GLUON or n == "mma-wgmma"))
    assert "mma-wgmma" in gv.COUNTED and "mma-wgmma-t16" in gv.COUNTED
    assert gv.impls_for(model1, gv.COUNTED) == gv.COUNTED
    tiny = dataclasses.replace(v32, b=1, s_q=1, h_q=2, topk=24, page=8, num_blocks=None)
    rows, skipped = gv._work(([dataclasses.asdict(tiny)], ("reference", "mma-wgmma-t16", "mma-tl"), time.time() + 600,
                              False, 0, "cpu"))
    assert not skipped and [r["impl"] for r in rows] == ["reference", "mma-tl"]
    assert all(r["ok"] for r in rows), rows


# --------------------------------------------------------------------------------------------
# experiments/gluon_timeline.py: the Gluon kernel's chain, stamped
# --------------------------------------------------------------------------------------------

def _timeline():
    from experiments import gluon_timeline

    return gluon_timeline


#: the synthetic stamps' clock: 2 cycles a ns
_CYCLES_PER_NS = 2


def _synthetic_rows(tl, tiles: int, smid: int = 7, step_ns: int = 100, stamped: int | None = None) -> list:
    """One program's three lane rows: each lane opens at 1000 ns, each step lasts ``step_ns`` (the
    second consumer warpgroup's 10 ns more), 40 ns between tiles; only the first ``stamped`` tiles
    written (the rest left unset, as past ``--tiles``)."""
    clock0, timer0 = 1_000_000, 5_000_000_000
    rows = []
    for lane in tl.LANES:
        row = [tl.UNSET] * tl.row_length(tiles)
        extra = 10 if lane == tl.LANES[1] else 0
        t = 1000
        for j in range(tiles if stamped is None else stamped):
            for k in range(len(tl.LANE_STAMPS[lane])):
                row[len(tl.HEADER) + j * tl.SLOTS + k] = clock0 + _CYCLES_PER_NS * t
                t += step_ns + extra
            t += 40 - step_ns - extra
        close = t + 5000
        row[:len(tl.HEADER)] = [smid, timer0 + 1000, clock0 + _CYCLES_PER_NS * 1000, timer0 + close,
                                clock0 + _CYCLES_PER_NS * close]
        rows.append(row)
    return rows


def _synthetic_doc(tl, tiles: int = 3) -> dict:
    return {"shape": {"name": "DSA", "b": 128, "s_q": 1, "h_q": 64, "topk": 2048, "page": 64},
            "provenance": {"gpu": "NVIDIA H100"}, "launch": {"programs": 2, "label": "synthetic"},
            "tiles": tiles, "lanes": list(tl.LANES), "stamped_over_shipped": 1.03,
            "steps": {lane: tl.steps(tl.LANE_STAMPS[lane]) for lane in tl.LANES},
            "programs": [tl.program_timeline(_synthetic_rows(tl, tiles, smid=3 + p), p) for p in (0, 1)]}


def test_the_timeline_probe_stamps_the_shipped_loops_and_nothing_else():
    """The instrumented package is the shipped one plus the stamps: each stamp point lands once
    in its loop, in order (consumer_heads' 11 after the loop's steps, _produce's 5), each partition
    opens and closes its lane once, and the functions it does not instrument are the shipped text."""
    tl = _timeline()
    shipped = {p.name: p.read_text() for p in tl.SHIPPED.glob("*.py")}
    src = tl.instrumented_sources()
    assert set(src) == set(shipped) | {"stamps.py"}
    for name, fn, stamps in (("consumers.py", "consumer_heads", tl.CONSUMER_STAMPS), ("ring.py", "_produce",
                                                                                       tl.PRODUCER_STAMPS)):
        text = tl._function(src[name], fn)
        calls = re.findall(r"stamp\(stamp_row, stamp_tiles, j, (\d+)\)", text)
        assert calls == [str(k) for k in range(len(stamps))], calls
        # without the stamp lines and the new parameters, the function is the shipped one
        bare = re.sub(r"\n *stamp(_open|_close)?\(stamp_row, stamp_tiles(, j, \d+)?\)", "", text)
        assert bare.replace(", stamp_row=None, stamp_tiles=0", "") == tl._function(shipped[name], fn)
    ring = tl._function(src["ring.py"], "producer")
    assert ring.count("stamp_open(") == 1 and ring.count("stamp_close(") == 1
    for name, fn in (("consumers.py", "consumer_tokens"), ("consumers.py", "_consumer_pair_loop"),
                     ("ring.py", "producer_one"), ("ring.py", "tile_rows")):
        assert tl._function(src[name], fn) == tl._function(shipped[name], fn), fn
    # the stamps come after the step they end: the wait's stamp is the line after the wait
    heads = tl._function(src["consumers.py"], "consumer_heads").splitlines()
    i = next(i for i, line in enumerate(heads) if "mbarrier.wait(ready" in line)
    assert heads[i - 1].strip() == "stamp(stamp_row, stamp_tiles, j, 1)"
    assert heads[i + 1].strip() == "stamp(stamp_row, stamp_tiles, j, 2)"


def test_the_timeline_probe_fails_loudly_when_the_kernel_changes(tmp_path, monkeypatch):
    """An edit whose text is no longer in the shipped source stops the build with an assertion
    that says the kernel changed (here: the consumer loop's S wait written another way)."""
    tl = _timeline()
    for p in tl.SHIPPED.glob("*.py"):
        text = p.read_text()
        if p.name == "consumers.py":
            text = text.replace("s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))",
                                "s = warpgroup_mma_wait(0, deps=(s_tok,))")
        (tmp_path / p.name).write_text(text)
    monkeypatch.setattr(tl, "SHIPPED", tmp_path)
    with pytest.raises(AssertionError, match="the kernel changed"):
        tl.instrumented_sources()


@pytest.mark.slow
def test_the_timeline_probe_compiles_for_sm90_without_new_spills(tmp_path):
    """``--aot`` (no GPU) compiles the shipped and the stamped kernel for sm_90a: the stamped one
    reads the clock 20 times (11 consumer and 5 producer stamps, and where each of the two
    partitions opens and closes), the global timer 4 times, runs 3 warpgroups (one lane each),
    keeps both tile loops and their wgmma and cp.async counts, and spills no more than shipped."""
    out = tmp_path / "aot.json"
    # the Triton on PYTHONPATH, if any, is the one compiled with (Triton 3.6's: PYTHONPATH=/path/to/it)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "experiments/gluon_timeline.py", "--aot", "--out", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import json

    rec = json.loads(out.read_text())
    s, t = rec["shipped"], rec["stamped"]
    assert rec["problems"] == []
    assert (t["clock_reads"], t["globaltimer_reads"], t["threads"]) == (20, 4, 384)
    assert (s["clock_reads"], s["globaltimer_reads"]) == (0, 0)
    for key, ops in (("consumer_loops", "tensor_core"), ("producer_loops", "cp_async")):
        assert len(s[key]) == len(t[key]) == 1, (s[key], t[key])
        (a,), (b,) = s[key], t[key]
        assert a[ops] == b[ops] > 0
        assert a["instructions"] < b["instructions"]
        assert b["spill_loads"] <= a["spill_loads"] and b["spill_stores"] <= a["spill_stores"]
    assert t["spill_bytes"] <= s["spill_bytes"]


def test_the_aot_check_flags_a_stamp_that_spills():
    tl = _timeline()
    loop = {"instructions": 800, "tensor_core": 36, "spill_loads": 0, "spill_stores": 0}
    ploop = {"instructions": 160, "cp_async": 22, "spill_loads": 0, "spill_stores": 0}
    shipped = {"spill_bytes": 0, "consumer_loops": [loop], "producer_loops": [ploop], "clock_reads": 0,
               "globaltimer_reads": 0, "threads": 384}
    stamped = {**shipped, "clock_reads": 20, "globaltimer_reads": 4,
               "consumer_loops": [{**loop, "instructions": 880}]}
    assert tl.check_aot({"shipped": shipped, "stamped": stamped}) == []
    spilled = {**stamped, "spill_bytes": 8, "consumer_loops": [{**loop, "spill_loads": 2}]}
    bad = tl.check_aot({"shipped": shipped, "stamped": spilled})
    assert len(bad) == 2 and "spill bytes 0 -> 8" in bad[0] and "0/0 -> 2/0" in bad[1], bad
    assert tl.check_aot({"shipped": shipped, "stamped": {**stamped, "clock_reads": 19}})


def test_the_timeline_record_turns_cycles_into_ns_per_step():
    """A program's rows (synthetic: 2 cycles a ns, steps of 100 ns, 40 ns between tiles) become
    its SM, ns per cycle from the header's two timer reads, and per lane and tile each step's
    [start, end] in ns from the program's first stamp; a lane's list ends at its first tile with
    an unset stamp."""
    tl = _timeline()
    prog = tl.program_timeline(_synthetic_rows(tl, tiles=4, stamped=2), 5)
    assert prog["program"] == 5 and prog["sm"] == 7
    assert prog["ns_per_cycle"] == pytest.approx(1 / _CYCLES_PER_NS)
    assert set(prog["lanes"]) == set(tl.LANES)
    wg0 = prog["lanes"]["consumer warpgroup 0"]
    assert len(wg0["tiles"]) == 2
    first = wg0["tiles"][0]
    assert list(first) == [s["name"] for s in tl.steps(tl.CONSUMER_STAMPS)]
    assert first["mask indices"] == [0.0, 100.0] and first["wait ready"] == [100.0, 200.0]
    assert first["P.V"] == [900.0, 1000.0]
    second = wg0["tiles"][1]["mask indices"]
    assert second == [1040.0, 1140.0]                        # 40 ns after the tile before it
    assert prog["lanes"]["consumer warpgroup 1"]["tiles"][0]["wait ready"] == [110.0, 220.0]
    producer = prog["lanes"]["producer"]["tiles"][0]
    assert list(producer) == ["wait empty", "copy", "arrive ready", "next tile's rows"]
    assert producer["next tile's rows"] == [300.0, 400.0]


def test_the_timeline_record_refuses_rows_it_cannot_read():
    tl = _timeline()
    rows = _synthetic_rows(tl, tiles=2)
    rows[0][:len(tl.HEADER)] = [tl.UNSET] * len(tl.HEADER)
    with pytest.raises(ValueError, match="header is not written"):
        tl.program_timeline(rows, 0)
    rows = _synthetic_rows(tl, tiles=2)
    rows[2][0] = 99
    with pytest.raises(ValueError, match="SMs"):
        tl.program_timeline(rows, 0)


def test_the_timeline_check_finds_steps_out_of_order():
    tl = _timeline()
    doc = _synthetic_doc(tl)
    assert tl.check_timeline(doc) == []
    tile = doc["programs"][1]["lanes"]["producer"]["tiles"][1]
    tile["copy"] = [tile["copy"][1], tile["copy"][0]]
    bad = tl.check_timeline(doc)
    assert any("program 1, producer, tile 1, copy: ends before it starts" in b for b in bad), bad
    del doc["programs"][0]["lanes"]["consumer warpgroup 1"]
    assert any("program 0: lanes" in b for b in tl.check_timeline(doc))


def test_the_stamped_kernel_launches_with_the_stamp_buffer_and_is_never_bound():
    """``Stamped[grid](*args, **constexprs)`` passes the stamp buffer and tile count on and returns
    no compiled kernel (so mla's BoundLaunch keeps launching it through Triton)."""
    tl = _timeline()
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, args, kw)) or "compiled"

    buffer = object()
    assert tl.Stamped(Kernel(), buffer, 6)[(1, 2)](1, 2, HEADS=64) is None
    assert seen == [((1, 2), (1, 2), {"stamp_ptr": buffer, "stamp_tiles": 6, "HEADS": 64})]


def test_the_timeline_probe_refuses_bad_arguments(capsys):
    tl = _timeline()
    for argv in (["--tiles", "0"], ["--programs", "a,b"], ["--programs", "-1"]):
        with pytest.raises(SystemExit) as e:
            tl.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--tiles" in err and "--programs" in err
    if not torch.cuda.is_available():           # the GPU mode without a GPU says so
        with pytest.raises(SystemExit, match="needs a Hopper GPU"):
            tl.main([])


def test_the_timeline_figure_draws_a_synthetic_record():
    """bookpage.timeline_figure: three lanes (producer on top), a box per stamped step, the stalls
    hatched, a legend and a title that names the program, its SM and the stamps' cost; a program
    the record does not keep is refused. bookpage.timeline_steps: the median step lengths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    sys.path.insert(0, str(ROOT / "notebooks"))
    import bookpage

    tl = _timeline()
    doc = _synthetic_doc(tl, tiles=3)
    fig = bookpage.timeline_figure(doc, program=1)
    (ax,) = fig.axes
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    n_steps = 3 * (2 * len(tl.steps(tl.CONSUMER_STAMPS)) + len(tl.steps(tl.PRODUCER_STAMPS)))
    assert len(boxes) == n_steps
    stalls = [p for p in boxes if p.get_hatch()]
    kinds = [s["kind"] for lane in tl.LANES for s in tl.steps(tl.LANE_STAMPS[lane])]
    assert len(stalls) == 3 * sum(k in bookpage.TIMELINE_STALLS for k in kinds)
    assert [t.get_text() for t in ax.get_yticklabels()] == list(reversed(bookpage.TIMELINE_LANES.values()))
    assert max(p.get_x() + p.get_width() for p in boxes) == pytest.approx(
        doc["programs"][1]["lanes"]["consumer warpgroup 1"]["tiles"][-1]["P.V"][1] / 1e3)
    assert "µs" in ax.get_xlabel()
    title = " ".join(ax.get_title(loc="left").split())
    assert "program 1 of 2 (SM 4)" in title and "1.03x the shipped kernel's time" in title, title
    assert fig.legends and len(fig.legends[0].get_texts()) == len(set(kinds)) + 1
    plt.close(fig)
    with pytest.raises(ValueError, match="keeps programs"):
        bookpage.timeline_figure(doc, program=66)
    steps = bookpage.timeline_steps(doc, program=0)
    wg1 = steps[steps.lane == "consumer warpgroup 1"]
    assert (wg1["median ns"] == 110.0).all() and len(wg1) == len(tl.steps(tl.CONSUMER_STAMPS))
