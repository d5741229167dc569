"""The page plumbing every chapter shares, in one place: the first cell's set-up (``SMALL``, the
device, the repository on ``sys.path``), text, tables and source for the page, values glued into
the prose, and the H200 record's facts (its ceilings and ridge, FlashMLA's times) read from
``results/h200/`` by one function each.

A chapter imports it in a folded cell::

    from bookpage import *          # noqa: F403
    SMALL, DEV = setup(SMALL)
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import io
import json
import math
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # experiments/ (not packaged) imports from the repository
    sys.path.insert(0, str(ROOT))

with contextlib.redirect_stdout(io.StringIO()) as _import_note:
    import mla  # noqa: E402  (before triton: with no GPU it turns Triton's interpreter on)

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from IPython.display import Markdown, display  # noqa: E402
from pygments import highlight  # noqa: E402
from pygments.formatters import HtmlFormatter  # noqa: E402
from pygments.lexers import PythonLexer  # noqa: E402

import mla.validate as mv  # noqa: E402
from mla import bench  # noqa: E402

#: the committed H200 records, and the probes and sweeps behind them
RESULTS = ROOT / "results" / "h200"
RUNS = RESULTS / "runs"
#: the page's text width, in characters
WIDTH = 78

__all__ = ["ROOT", "RESULTS", "RUNS", "WIDTH", "setup", "say", "wrap", "show", "source", "glue", "load",
           "host_rows", "same_package_code", "record", "ceilings", "flashmla_us", "fmt", "display", "Markdown", "pd",
           "torch", "mla", "bench", "math"]


def setup(small=None):
    """The first cell's work: ``SMALL`` resolved (None: small shapes when there is no CUDA GPU),
    the device, and one line saying where the chapter runs (with ``import mla``'s interpreter
    notice, if it gave one, wrapped to the page). Returns ``(SMALL, DEV)``."""
    if small is None:
        small = not torch.cuda.is_available()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for line in _import_note.getvalue().splitlines():
        say(line, indent="")
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "the CPU, through Triton's interpreter"
    say(f"SMALL = {small}: running on {where} (torch {torch.__version__}, triton {triton.__version__}).", indent="")
    return bool(small), dev


def say(*lines, indent="    "):
    """Print each line wrapped to the page; continuations indented."""
    for line in lines:
        print(textwrap.fill(str(line), WIDTH, subsequent_indent=indent, break_long_words=False,
                            break_on_hyphens=False))


def wrap(text, width=WIDTH - 2, indent=4) -> str:
    """Each line of ``text`` folded to the page, continued deeper indented."""
    out = []
    for line in str(text).splitlines():
        lead = " " * (len(line) - len(line.lstrip()) + indent)
        out.append(textwrap.fill(line, width, subsequent_indent=lead, break_long_words=False,
                                 break_on_hyphens=False))
    return "\n".join(out)


def fmt(x, digits=3) -> str:
    """A number as the page prints it: an integer exactly (a count), a float to ``digits``
    significant figures without trailing zeros (12,385.2 us prints as 12,400, 0.0900 as 0.09), no
    exponent for numbers of ordinary size, thousands grouped; blank for a missing value."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if x == 0:
        return "0"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    mag = math.floor(math.log10(abs(x)))
    if mag < -4 or mag >= 7:
        mantissa, exponent = f"{x:.{digits - 1}e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{exponent}"
    x = round(x, digits - 1 - mag)
    decimals = max(0, digits - 1 - mag)
    text = f"{x:,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def show(df, caption=None, digits=3, formats=None):
    """Display a table without pandas' row numbers: numbers to ``digits`` significant figures
    (:func:`fmt`), missing values blank; ``formats`` {column: format string or function} for the
    columns that need another form; ``caption`` above it. It displays the table itself, wherever
    it is called in a cell."""
    formats = dict(formats or {})
    cols = {c: formats.get(c, functools.partial(fmt, digits=digits)) for c in df.columns}
    style = df.style.hide(axis="index").format(cols, na_rep="").set_table_attributes('class="dataframe"')
    display(style.set_caption(caption) if caption else style)


class _Source:
    """Highlighted source that keeps the code's own line breaks: a line longer than the page
    scrolls sideways inside the listing rather than wrapping, so that every line break a reader
    sees is one in the file. (Wrapped at the page's 78 characters, the package's longer lines
    broke into continuations that read like lines of their own.)"""

    def __init__(self, code):
        self.code = code

    def __repr__(self):
        return self.code

    def _repr_html_(self):
        html = highlight(self.code, PythonLexer(), HtmlFormatter())
        return html.replace("<pre>", '<pre style="white-space: pre; overflow-x: auto">', 1)


def source(*objs):
    """The source of functions, classes or kernels of ``mla`` (a ``@triton.jit`` or ``@gluon.jit``
    kernel keeps its Python function in ``.fn``), highlighted, one after another: what runs, not
    a copy."""
    for obj in objs:
        display(_Source(inspect.getsource(getattr(obj, "fn", obj))))


def glue(name, value, text=None):
    """Make ``value`` available to the chapter's prose as ``{glue:text}`name``` (myst-nb's glue)
    and return it. ``text`` is how it reads (default :func:`fmt`). Outside a book build (papermill
    on a machine without myst-nb) it only returns the value."""
    try:
        from myst_nb import glue as _glue
    except ImportError:
        return value
    _glue(name, text if text is not None else fmt(value), display=False)
    return value


def load(name: str, card: str = "h200") -> dict:
    """A committed record by file name: the top-level records (``bench.json``,
    ``validation.json``, ``mma_versions.json``) or a probe or sweep under ``runs/``, of the H200
    or of another card's folder (``card``, :func:`mla.bench.gpu_slug` of its name)."""
    top = ROOT / "results" / card
    for folder in (top, top / "runs"):
        path = folder / name
        if path.exists():
            return json.loads(path.read_text())
    raise FileNotFoundError(f"{name}: not in {top} or {top / 'runs'}")


@functools.lru_cache(maxsize=None)
def record() -> dict:
    """The H200 benchmark record, ``results/h200/bench.json``."""
    return load("bench.json")


def host_rows(name: str, card: str = "h200"):
    """The table a ``python -m mla.bench --host`` run printed (a text file under a card's
    ``runs/``, its first line the run's provenance) as rows: shape, b, us with a plan and without
    one; the commit its first line names in ``attrs["commit"]``."""
    rows, text = [], (ROOT / "results" / card / "runs" / name).read_text()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 5 and cells[1].isdigit():
            rows.append({"shape": cells[0], "b": int(cells[1]), "us with a plan": float(cells[3]),
                         "us without a plan": float(cells[4])})
    df = pd.DataFrame(rows)
    df.attrs["commit"] = re.search(r"at commit ([0-9a-f]{7})", text.splitlines()[0]).group(1)
    return df


def same_package_code(commit_a: str, commit_b: str) -> bool:
    """Whether two runs' commits hold the same ``mla/`` package (a run of a results-only commit
    times the code of the one before it). False where git cannot tell: no checkout, or a commit
    it does not have."""
    a, b = (c.removesuffix("+dirty") for c in (commit_a, commit_b))
    if a == b:
        return True
    try:
        diff = subprocess.run(["git", "diff", "--quiet", a, b, "--", "mla"], cwd=ROOT, capture_output=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return diff.returncode == 0


def ceilings() -> dict:
    """The H200's ceilings as the record measured them in its run: the device-to-device copy
    (GB/s, bytes read plus written), the bf16 matrix product (TFLOP/s), and the ridge between
    them (FLOP per byte), with the run they come from. Every chapter's ceilings are these."""
    prov = record()["provenance"]
    copy, peak = prov["ceilings"]["copy_gbps"], prov["ceilings"]["matmul_tflops"]
    return {"copy_gbps": copy, "matmul_tflops": peak, "ridge": peak * 1e12 / (copy * 1e9),
            "gpu": prov["gpu"], "date": prov["date"], "commit": prov["commit"]}


def flashmla_us() -> tuple[dict, str]:
    """FlashMLA's CUDA-graph time per (shape, b) and where it comes from: the record's own
    ``flashmla`` records (timed in the same run as ours) when it has them, else the contract's
    numbers (measured elsewhere on one H200). At V4-TP8 it is FlashMLA's padded time, the V4-CSA
    one."""
    same_run = bench.flashmla_us(record()["records"])
    if same_run:
        return same_run, "FlashMLA timed in the same run"
    return dict(bench.FLASHMLA_H200_US), "FlashMLA as the contract quotes it (measured elsewhere)"


def _ratio(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def verdicts(rows, title, failures_first=True):
    """A validation sweep's rows (:func:`mla.validate.sweep`, a DataFrame or dicts) as a table for
    the page, one row per (case, impl), its verdict line as the caption. "worst / allow" is the
    worst element's error over its allowance (an element passes below 1), "cos / allow" the larger
    cosine difference over FlashMLA's bound (out's or lse's; it passes at 1 or below); "NaN, leak"
    counts NaNs in the result and says whether a second call, with zeros where nothing may be
    read, gave the same bits."""
    recs = rows.to_dict("records") if hasattr(rows, "to_dict") else list(rows)
    if failures_first:
        recs = sorted(recs, key=lambda r: bool(r["ok"]))
    s = mv.summary(recs)
    def n(k, word):
        return f"{k} {word}{'' if k == 1 else 's'}"

    head = (f"{title}: {n(s['rows'], 'run')} ({n(s['cases'], 'case')}, {n(len(s['impls']), 'impl')}), "
            f"{s['failures']} failed")

    def cos(r):
        if _ratio(r.get("out_cos")) is None:
            return None
        return max(abs(r["out_cos"]) / mv.OUT_COS, abs(r["lse_cos"]) / mv.LSE_COS)

    def nan_leak(r):
        n = _ratio(r.get("nan_count"))
        leak = {True: "same", False: "LEAK"}.get(r.get("leak_ok"), "-")
        return f"{'-' if n is None else int(n)}, {leak}"

    table = pd.DataFrame([{"case": r["case"], "impl": r["impl"], "ok": "ok" if r["ok"] else "FAIL",
                           "out worst / allow": _ratio(r.get("out_excess")),
                           "lse worst / allow": _ratio(r.get("lse_excess")), "cos / allow": cos(r),
                           "NaN, leak": nan_leak(r)} for r in recs])
    def ratio(x):                    # a ratio to an allowance: below a thousandth is "none to speak of"
        return fmt(x, 2) if x is None or math.isnan(x) or abs(x) >= 1e-3 or x == 0 else "<0.001"

    show(table, caption=head, digits=2, formats={c: ratio for c in ("out worst / allow", "lse worst / allow",
                                                                    "cos / allow")})


__all__.append("verdicts")


# --------------------------------------------------------------------------------------------
# The sweep against FlashMLA (results/h200/sweep.json): one table and one picture, used by the
# chapters of both kernels
# --------------------------------------------------------------------------------------------

#: the sweep's cache configs, in the order the heatmap's rows take them, and how the page names them
SWEEP_CONFIG_NAMES = {"DSA": "DSA", "CSA": "CSA", "HCA": "HCA-like", "long": "long"}


def sweep_ratios(impl: str = "mma", doc: dict | None = None):
    """The sweep's points as a table: :func:`mla.bench.sweep_ratios` (one row per (config, b, s_q,
    h_q) where ``impl`` and FlashMLA were both timed, in the same run), with the page's names for
    the configs and columns. ``padded`` is the record's own word (FlashMLA's row has
    ``padded_to``): FlashMLA runs 64 or 128 heads only, so at fewer heads its time is the padded
    64-head one. ``doc`` is a sweep record (default ``results/h200/sweep.json``)."""
    doc = load("sweep.json") if doc is None else doc
    names = {"config": "config", "b": "b", "s_q": "s_q", "h_q": "h_q", "lengths": "lengths", "us": "ours us",
             "us_flashmla": "FlashMLA us", "ratio": "ratio", "padded": "padded", "eager": "ours eager us",
             "eager_flashmla": "FlashMLA eager us", "kernel": "kernel", "programs": "programs"}
    df = pd.DataFrame(bench.sweep_ratios(doc, impl), columns=list(names)).rename(columns=names)
    assert (df["padded"] == (df["h_q"] < bench.FLASHMLA_HEADS[0])).all()     # padded exactly below 64 heads
    df["config"] = df["config"].map(lambda c: SWEEP_CONFIG_NAMES.get(c, c))
    return df


def _heat_panel(ax, grid, rows, cols, norm, cmap, title, fontsize=8):
    """One panel: ``grid`` a DataFrame of ratios (rows x cols, NaN where not measured), each
    cell coloured and annotated."""
    values = grid.reindex(index=rows, columns=cols).to_numpy(dtype=float)
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            v = values[i, j]
            if math.isnan(v):
                continue
            dark = abs(norm(v) - 0.5) > 0.3
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=fontsize,
                    color="white" if dark else "black")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols], fontsize=8.5)
    ax.set_yticks(range(len(rows)), [str(r) for r in rows], fontsize=8.5)
    ax.set_xticks([x - 0.5 for x in range(1, len(cols))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(rows))], minor=True)
    ax.grid(which="minor", color="white", lw=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_facecolor("0.93")                  # blank: not measured
    ax.set_title(title, fontsize=10)
    return image


def sweep_heatmap(impl: str = "mma", doc: dict | None = None, padded: bool = True, title: str | None = None):
    """The sweep as a picture: ``impl``'s time over FlashMLA's (:func:`sweep_ratios`) as a heatmap
    of b (columns) by cache config (rows), one panel per (h_q, s_q) for h_q 64 and 128 and s_q 1
    and 2, blank where a point was not measured; a diverging colour map centred at 1.0, every cell
    annotated with its ratio. With ``padded``, a panel below holds the points at fewer heads, rows
    (h_q, s_q), against FlashMLA's padded 64-head time. Returns the figure (the cell shows it)."""
    df = sweep_ratios(impl, doc)
    assert len(df), f"no sweep point has both {impl} and FlashMLA"
    cols = [b for b in bench.SWEEP_B if b in set(df.b)] + sorted(set(df.b) - set(bench.SWEEP_B))
    configs = [n for n in SWEEP_CONFIG_NAMES.values() if n in set(df.config)]
    configs += sorted(set(df.config) - set(configs))
    full = df[~df.padded]
    low = df[df.padded] if padded else df.iloc[:0]
    lo, hi = float(df.ratio.min()), float(df.ratio.max())
    reach = max(hi, 1 / lo, 1.05)            # as far below 1 as above, as factors: 0.5 as dark as 2
    norm = TwoSlopeNorm(vcenter=1.0, vmin=1 / reach, vmax=reach)
    cmap = plt.get_cmap("RdBu_r")
    panels = sorted(set(zip(full.h_q, full.s_q)))
    n_rows = math.ceil(len(panels) / 2)
    heights = [len(configs)] * n_rows + ([len(set(zip(low.h_q, low.s_q))) * 0.9] if len(low) else [])
    fig_h = 1.0 + 0.52 * sum(heights) + 0.75 * len(heights)
    fig = plt.figure(figsize=(11, fig_h))
    # the title 0.65 inch above the panels, and room for a row's axis label, however few its configs
    gs = fig.add_gridspec(len(heights), 2, height_ratios=heights, hspace=max(0.55, 1.5 / np.mean(heights)), wspace=0.08, top=1 - 0.65 / fig_h,
                          bottom=max(0.06, 0.5 / fig_h))
    image = None
    for k, (h_q, s_q) in enumerate(panels):
        ax = fig.add_subplot(gs[k // 2, k % 2])
        sub = full[(full.h_q == h_q) & (full.s_q == s_q)]
        image = _heat_panel(ax, sub.pivot(index="config", columns="b", values="ratio"), configs, cols, norm,
                            cmap, f"$h_q$ = {h_q}, $s_q$ = {s_q}")
        if k % 2:
            ax.tick_params(labelleft=False)
        else:
            ax.set_ylabel("cache config", fontsize=9)
        ax.set_xlabel("batch b (requests)", fontsize=9)
    if len(low):
        ax = fig.add_subplot(gs[n_rows, :])
        low = low.assign(row=[f"$h_q$ = {h}, $s_q$ = {s}" for h, s in zip(low.h_q, low.s_q)])
        order = [f"$h_q$ = {h}, $s_q$ = {s}" for h, s in sorted(set(zip(low.h_q, low.s_q)))]
        configs_low = sorted(set(low.config))
        image = _heat_panel(ax, low.pivot(index="row", columns="b", values="ratio"), order, cols, norm, cmap,
                            f"fewer heads, {', '.join(configs_low)} config: against FlashMLA's padded "
                            "64-head time")
        ax.set_xlabel("batch b (requests)", fontsize=9)
        ax.set_ylabel("heads, query tokens", fontsize=9)
    bar = fig.colorbar(image, ax=fig.axes, fraction=0.035, pad=0.02)
    bar.set_label("time / FlashMLA's time (below 1: faster)", fontsize=9.5)
    bar.ax.tick_params(labelsize=8.5)
    gpu = (doc or load("sweep.json"))["provenance"]["gpu"]
    fig.suptitle(title or f"impl='{impl}' over FlashMLA, CUDA-graph time per call, one run on the {gpu}",
                 fontsize=11.5)
    return fig


__all__ += ["SWEEP_CONFIG_NAMES", "sweep_ratios", "sweep_heatmap"]


# --------------------------------------------------------------------------------------------
# The measured chain of the Gluon kernel (experiments/gluon_timeline.py's record): chapter 4
# draws it beside its schematic
# --------------------------------------------------------------------------------------------

#: a step's colour by its kind: chapter 4's schematic's (its chain cell), with the two kinds the
#: measured chain adds: the barriers (the schematic's black lines) and the index loads
TIMELINE_COLOURS = {"wait": "#e9e9e9", "copy": "#f4a259", "decode": "#f6d55c", "S": "#5b8fd1",
                    "softmax": "#9d7cd8", "P": "#c9b6ee", "PV": "#3d6fb6", "barrier": "#4a4a4a",
                    "index": "#a8d5ba"}
#: the kinds that are stalls: a wait on an mbarrier, or on the other warpgroup at a barrier
TIMELINE_STALLS = ("wait", "barrier")
#: the lanes from the top of the figure down (the schematic's order), and how the page names them
TIMELINE_LANES = {"producer": "producer\n(1 warpgroup)", "consumer warpgroup 0": "consumer\nwarpgroup 0",
                  "consumer warpgroup 1": "consumer\nwarpgroup 1"}
#: what the legend calls each kind
_TIMELINE_KIND_NAMES = {"index": "index loads", "wait": "wait (mbarrier)", "barrier": "barrier",
                        "copy": "cp.async copies, arrive", "decode": "ring loads, decode",
                        "S": "S = Q·Kᵀ (wgmma, wait)", "softmax": "softmax step", "P": "P store, O rescale",
                        "PV": "P·V (wgmma, wait)"}


def _timeline_program(doc: dict, program: int) -> dict:
    for prog in doc["programs"]:
        if prog["program"] == program:
            return prog
    kept = [p["program"] for p in doc["programs"]]
    raise ValueError(f"program: the record keeps programs {kept}, not {program}")


def timeline_steps(doc: dict, program: int = 0):
    """One program's measured steps as a table: per lane and step (in the chain's order) its
    kind, median and largest length in ns over the stamped tiles, and its share of the lane's
    stamped time (a tile's first step to its last; the gaps between tiles are the rest)."""
    prog = _timeline_program(doc, program)
    rows = []
    for lane in TIMELINE_LANES:
        tiles = prog["lanes"][lane]["tiles"]
        if not tiles:
            continue
        span = tiles[-1][list(tiles[-1])[-1]][1] - tiles[0][list(tiles[0])[0]][0]
        for step in doc["steps"][lane]:
            ns = [t[step["name"]][1] - t[step["name"]][0] for t in tiles]
            rows.append({"lane": lane, "step": step["name"], "kind": step["kind"],
                         "median ns": float(np.median(ns)), "max ns": float(max(ns)),
                         "share": sum(ns) / span if span > 0 else float("nan")})
    return pd.DataFrame(rows)


def timeline_figure(doc: dict, program: int = 0, title: str | None = None):
    """One program's measured chain from a timeline record (``experiments/gluon_timeline.py``), at
    full width: one lane per partition (the producer, then consumer warpgroups 0 and 1), a box
    per step in the schematic's colours (:data:`TIMELINE_COLOURS`), stalls (:data:`TIMELINE_STALLS`)
    hatched, the lane's time between one tile's last step and the next tile's first left blank
    on its thin base line, and each tile's number over the consumers. x: us from the program's
    first stamp. Returns the figure (the cell shows it)."""
    from matplotlib.patches import Patch, Rectangle

    prog = _timeline_program(doc, program)
    fig, ax = plt.subplots(figsize=(11, 3.9))
    kinds_seen, end = set(), 0.0
    height, gap = 0.72, 0.28
    for row, lane in enumerate(reversed(list(TIMELINE_LANES))):
        y = row * (height + gap)
        entry = prog["lanes"][lane]
        kind_of = {s["name"]: s["kind"] for s in doc["steps"][lane]}
        last = [b for t in entry["tiles"] for _a, b in t.values()]
        lane_end = max(last) if last else 0.0
        ax.plot([entry["open_ns"] / 1e3, lane_end / 1e3], [y + height / 2] * 2, color="#999999", lw=0.8, zorder=1)
        for j, tile in enumerate(entry["tiles"]):
            for name, (a, b) in tile.items():
                kind = kind_of[name]
                kinds_seen.add(kind)
                stall = kind in TIMELINE_STALLS
                ax.add_patch(Rectangle((a / 1e3, y), (b - a) / 1e3, height, fc=TIMELINE_COLOURS[kind],
                                       ec="#333333" if stall else "none", lw=0.3, hatch="////" if stall else None,
                                       zorder=2))
            if lane == "consumer warpgroup 0":
                first = tile[next(iter(tile))][0]
                ax.text(first / 1e3, y + height + 0.05, f"tile {j}", fontsize=7.5, ha="left", va="bottom")
        end = max(end, lane_end)
    ax.set_yticks([row * (height + gap) + height / 2 for row in range(len(TIMELINE_LANES))],
                  list(reversed(TIMELINE_LANES.values())), fontsize=9)
    ax.set_ylim(-0.15, len(TIMELINE_LANES) * (height + gap) + 0.1)
    ax.set_xlim(0, end / 1e3 * 1.01 if end else 1)
    ax.set_xlabel("µs from the program's first stamp", fontsize=9.5)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles = [Patch(fc=TIMELINE_COLOURS[k], ec="#333333" if k in TIMELINE_STALLS else "none",
                     hatch="////" if k in TIMELINE_STALLS else None, label=_TIMELINE_KIND_NAMES.get(k, k))
               for k in TIMELINE_COLOURS if k in kinds_seen]
    handles.append(Patch(fc="white", ec="#999999", label="blank: between tiles (loop, next query)"))
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    shape, prov = doc["shape"], doc["provenance"]
    n_tiles = len(prog["lanes"]["consumer warpgroup 0"]["tiles"])
    title = title or (f"Measured: program {program} of {doc['launch']['programs']} (SM {prog['sm']}), its first "
                      f"{n_tiles} tiles, {shape['name']} b = {shape['b']} on the {prov['gpu']}; the stamped build "
                      f"took {doc['stamped_over_shipped']:.2f}x the shipped kernel's time")
    ax.set_title(textwrap.fill(title, 120), fontsize=10, loc="left")
    fig.tight_layout(rect=(0, 0.1 if len(handles) > 5 else 0.06, 1, 1))
    return fig


__all__ += ["TIMELINE_COLOURS", "TIMELINE_STALLS", "TIMELINE_LANES", "timeline_steps", "timeline_figure"]


# --------------------------------------------------------------------------------------------
# The tensor-core kernel's history (results/h200/mma_versions.json), step by step: the ladder
# the introduction opens with and chapter 4 ends with
# --------------------------------------------------------------------------------------------

#: the steps that changed the kernel, each with the versions of the log that make it up
LADDER_STEPS = (
    ("first cut: tl.dot, bf16 operands", ("v0",)),
    ("tl.dot at its best", ("v4", "v6", "v7", "v9", "v10", "v11")),
    ("first Gluon kernel: S once", ("v14", "v15")),
    ("a producer partition", ("v18", "v19", "v19b")),
    ("tokens as M", ("v20", "v20b", "v21")),
    ("Q and O as 16-byte rows", ("v22",)),
)
#: the shapes the ladder reads: the ones the log timed most, and V4-TP8, which its later steps chase
LADDER_SHAPES = (("DSA", 1), ("DSA", 128), ("V4-CSA", 128), ("V4-TP8", 32), ("V4-TP8", 128))
LADDER_NOW, LADDER_FLASHMLA = "now: the record", "FlashMLA (V4-TP8: 64 heads)"


def log_entry(tag: str, log: dict | None = None) -> dict:
    """The version log's entry whose name starts with ``tag`` (``"v14"``)."""
    log = load("mma_versions.json") if log is None else log
    (entry,) = [v for v in log["versions"] if v["version"].split()[0] == tag]
    return entry


def version_ladder(shapes=LADDER_SHAPES) -> pd.DataFrame:
    """The kernel's history as one row per step of :data:`LADDER_STEPS`, CUDA-graph us per call
    at each shape (column ``"DSA b = 128"``): the time of the step's last version that timed the
    shape (None where none did), then the record's ``impl="mma"`` (``"now: the record"``), then
    FlashMLA in the record's run (:func:`flashmla_us`; at V4-TP8 its padded 64-head time). The
    steps' times come from their own runs, not the record's."""
    log = load("mma_versions.json")
    mma = {(r["shape"], r["b"]): r["us_graph"] for r in record()["records"] if r["impl"] == "mma"}
    flash, _ = flashmla_us()
    col = {sh: f"{sh[0]} b = {sh[1]}" for sh in shapes}
    rows = []
    for what, tags in LADDER_STEPS:
        row = {"step": what}
        for sh in shapes:
            got = [t for t in (log_entry(tag, log)["us"].get(f"{sh[0]} b{sh[1]}") for tag in tags)
                   if t is not None]
            row[col[sh]] = got[-1] if got else None
        rows.append(row)
    rows.append({"step": LADDER_NOW, **{col[sh]: mma[sh] for sh in shapes}})
    rows.append({"step": LADDER_FLASHMLA, **{col[sh]: flash[sh] for sh in shapes}})
    return pd.DataFrame(rows)


__all__ += ["LADDER_STEPS", "LADDER_SHAPES", "LADDER_NOW", "LADDER_FLASHMLA", "log_entry", "version_ladder"]

#: the implementations of the validation records (``scripts/gpu_validation.py``), as a page names
#: them: the API's ``impl`` for what a call can ask for, words for the forms it forces
IMPL_NAMES = {
    "reference": "reference (PyTorch, float32)",
    "simt": "SIMT kernel",
    "mma": "mma (the launch rule's pick)",
    "mma-tl": "tl.dot kernel, forced",
    "tl_dot": "tl.dot kernel, forced",
    "mma-wgmma": "Gluon, heads as M, forced",
    "mma-wgmma-t16": "Gluon, tokens as M, 16 x 64, forced",
    "mma-wgmma-t8": "Gluon, tokens as M, 8 x 128, forced",
    "mma-wgmma-duo": "Gluon, two consumers, forced",
}


def impl_name(impl: str) -> str:
    """A record's impl as the page names it (:data:`IMPL_NAMES`; an unknown one as it is)."""
    return IMPL_NAMES.get(impl, impl)


__all__ += ["IMPL_NAMES", "impl_name"]
