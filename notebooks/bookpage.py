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
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # experiments/ (not packaged) imports from the repository
    sys.path.insert(0, str(ROOT))

with contextlib.redirect_stdout(io.StringIO()) as _import_note:
    import mla  # noqa: E402  (before triton: with no GPU it turns Triton's interpreter on)

import pandas as pd  # noqa: E402
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
           "record", "ceilings", "flashmla_us", "fmt", "display", "Markdown", "pd", "torch", "mla", "bench",
           "math"]


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
    """Highlighted source whose long lines wrap with a hanging indent instead of scrolling."""

    def __init__(self, code):
        self.code = code

    def __repr__(self):
        return self.code

    def _repr_html_(self):
        html = highlight(self.code, PythonLexer(), HtmlFormatter(linespans="L"))
        lines = self.code.splitlines()

        def hang(m):
            line = lines[int(m.group(1)) - 1]
            n = len(line) - len(line.lstrip()) + 4
            return f'<span style="display: block; padding-left: {n}ch; text-indent: -{n}ch">'

        html = re.sub(r'<span id="L-(\d+)">', hang, html)
        return html.replace("<pre>", '<pre style="white-space: pre-wrap">', 1)


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


def load(name: str) -> dict:
    """A committed H200 record by file name: the top-level records (``bench.json``,
    ``validation.json``, ``mma_versions.json``) or a probe or sweep under ``runs/``."""
    for folder in (RESULTS, RUNS):
        path = folder / name
        if path.exists():
            return json.loads(path.read_text())
    raise FileNotFoundError(f"{name}: not in {RESULTS} or {RUNS}")


@functools.lru_cache(maxsize=None)
def record() -> dict:
    """The H200 benchmark record, ``results/h200/bench.json``."""
    return load("bench.json")


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
