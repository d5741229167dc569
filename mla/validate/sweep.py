"""Checking calls against the reference: one case (:func:`check`), many impls over many cases
(:func:`sweep`, :func:`sweep_rows`), their summary and table, and :func:`validate`."""
from __future__ import annotations

import functools
import io
import math
import time
from dataclasses import dataclass

import torch

from ..api import sparse_decode
from ..reference import sparse_decode_reference
from .cases import (CaseSpec, _as_spec, _fill_unreferenced, _valid_positions, cache_span, odd_cases, poison_allocator,
                    quick_cases)
from .compare import LSE_ABS, LSE_COS, LSE_REL, OUT_ABS, OUT_COS, OUT_REL, Closeness, check_against_reference

def run_case(fn, case: dict) -> tuple[Closeness, Closeness]:
    """Call ``fn(**case)`` (outputs poisoned first) and compare with the float64 reference."""
    q = case["q"]
    b, s_q, h_q, d = q.shape
    poison_allocator(b * s_q * h_q * d * 8, q.device)
    out, lse = fn(**case)
    ref_out, ref_lse = sparse_decode_reference(**case, out_dtype=torch.float64)
    return check_against_reference(out, lse, ref_out, ref_lse)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _impl_fns(impls) -> dict:
    """{name: fn} from a name, a list of names and/or callables, or a dict."""
    if isinstance(impls, dict):
        return dict(impls)
    if isinstance(impls, str) or callable(impls):
        impls = [impls]
    out = {}
    for x in impls:
        if isinstance(x, str):
            out[x] = functools.partial(sparse_decode, impl=x)
        elif callable(x):
            out[_unique(_fn_name(x), out)] = x
        else:
            raise TypeError(f"impls: expected names or callables, got {type(x).__name__}")
    return out


def _fn_name(fn) -> str:
    if isinstance(fn, functools.partial):
        if "impl" in fn.keywords:
            return str(fn.keywords["impl"])
        return _fn_name(fn.func)
    return getattr(fn, "__name__", type(fn).__name__)


def _unique(name: str, taken) -> str:
    n, i = name, 2
    while n in taken:
        n, i = f"{name} ({i})", i + 1
    return n


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _clone_cache(cache: torch.Tensor) -> torch.Tensor:
    """A copy with the same shape and strides (the stride padding included)."""
    return cache_span(cache).clone().as_strided(cache.shape, cache.stride()).view(cache.dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if a.element_size() in ints and a.is_contiguous() and b.is_contiguous():
        return torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))
    return bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and torch.equal(a.isnan(), b.isnan()))


def unreferenced_invariant(fn, case: dict, out: torch.Tensor, lse: torch.Tensor) -> bool:
    """Call ``fn`` again on copies of the caches whose unreferenced bytes hold zeros instead of
    NaN; True iff it returns the same (out, lse) bit for bit. A call that reads any byte it
    must not (an invalid index, a position past a length, another token, the padding) can be
    caught this way even when it never turns the NaN into a visible NaN."""
    alt = dict(case)
    for ck, ik, lk in (("k_cache", "indices", "topk_length"), ("extra_k_cache", "extra_indices", "extra_topk_length")):
        if case.get(ck) is None:
            continue
        c = _clone_cache(case[ck])
        _fill_unreferenced(c, _valid_positions(case[ik], case.get(lk)), 0, 0, 0x7F, 0)   # zeros; finite scales (UE8M0 2**0, float32 3.4e38)
        alt[ck] = c
    q = case["q"]
    poison_allocator(q.numel() * 8, q.device)
    out2, lse2 = fn(**alt)
    _sync(q.device)
    return _same_bits(out, out2) and _same_bits(lse, lse2)


def _where(idx, dims) -> str:
    return "-" if idx is None else " ".join(f"{d}{i}" for d, i in zip(dims, idx))


def _num(x):
    """A JSON-safe float: inf and nan as strings."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)


ROW_COLUMNS = ["case", "impl", "b", "s_q", "h_q", "topk", "page", "extra_topk", "extra_page", "lengths", "sink",
               "empty_query", "invalid_frac", "ok", "n_bad", "out_bad", "lse_bad", "out_max_abs", "out_max_rel",
               "out_excess", "out_worst_at", "out_worst_got", "out_worst_ref", "out_cos", "lse_max_abs", "lse_max_rel",
               "lse_excess", "lse_worst_at", "lse_worst_got", "lse_worst_ref", "lse_cos", "dtype_ok", "nan_count",
               "leak_ok", "seconds", "crashed", "error"]


def _spec_fields(spec: CaseSpec) -> dict:
    return dict(case=spec.name, b=spec.b, s_q=spec.s_q, h_q=spec.h_q, topk=spec.topk, page=spec.page,
                extra_topk=spec.extra_topk, extra_page=spec.extra_page if spec.extra_topk else None,
                lengths=spec.lengths, sink=spec.sink_kind, empty_query=spec.empty_query,
                invalid_frac=spec.invalid_frac)


def _error_row(spec, name, msg, seconds=None) -> dict:
    row = dict.fromkeys(ROW_COLUMNS)
    row.update(_spec_fields(spec), impl=name, ok=False, seconds=seconds, crashed=True, error=msg)
    return row


def _check(spec: CaseSpec, name: str, fn, case: dict, ref, leak_check: bool) -> dict:
    dev = case["q"].device
    t0 = time.perf_counter()
    try:
        q = case["q"]
        poison_allocator(q.numel() * 8, dev)
        out, lse = fn(**case)
        _sync(dev)
        secs = time.perf_counter() - t0
        co, cl = check_against_reference(out, lse, *ref)
        dtype_ok = out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        nan_count = int(torch.isnan(out).sum()) + int(torch.isnan(lse).sum())
        leak_ok = unreferenced_invariant(fn, case, out, lse) if leak_check else None
    except Exception as e:  # noqa: BLE001  (a crash is a failure of that case, reported)
        if dev.type == "cuda":
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                pass
        return _error_row(spec, name, f"{type(e).__name__}: {str(e)[:400]}", time.perf_counter() - t0)
    ok = co.ok and cl.ok and dtype_ok and nan_count == 0 and leak_ok is not False
    notes = []
    if not dtype_ok:
        notes.append(f"dtypes out {out.dtype}, lse {lse.dtype} (want bfloat16, float32)")
    for c in (co, cl):
        if c.note:
            notes.append(f"{c.name}: {c.note}")
    if leak_ok is False:
        notes.append("result depends on unreferenced bytes")
    row = _spec_fields(spec)
    row.update(impl=name, ok=ok, n_bad=co.n_bad + cl.n_bad, out_bad=co.n_bad, lse_bad=cl.n_bad,
               out_max_abs=co.worst_abs, out_max_rel=co.worst_rel_past_abs, out_excess=co.worst_excess,
               out_worst_at=_where(co.worst_index, "bshc"), out_worst_got=co.worst_value, out_worst_ref=co.worst_ref,
               out_cos=co.cos_diff, lse_max_abs=cl.worst_abs, lse_max_rel=cl.worst_rel_past_abs,
               lse_excess=cl.worst_excess, lse_worst_at=_where(cl.worst_index, "bhs"), lse_worst_got=cl.worst_value,
               lse_worst_ref=cl.worst_ref, lse_cos=cl.cos_diff,
               dtype_ok=dtype_ok, nan_count=nan_count, leak_ok=leak_ok, seconds=secs, crashed=False,
               error="; ".join(notes) or None)
    return row


def check(fn, case, device=None, *, leak_check: bool = True, name: str | None = None) -> dict:
    """Validate one call of ``fn`` on one case (a :class:`CaseSpec` or its fields as a dict):
    one row of :func:`sweep`, as a dict (``row["ok"]``)."""
    return sweep_rows({name or _fn_name(fn): fn}, [case], device, progress=False,
                      leak_check=leak_check)[0]


def _progress(total, enabled):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:           # tqdm is optional
        return None
    return tqdm(total=total, desc="mla.validate", leave=False)


def sweep_rows(impls, cases, device=None, *, progress: bool = True, leak_check: bool = True,
               batch_chunk: int | None = None) -> list[dict]:
    """:func:`sweep` as a list of row dicts (needs neither pandas nor tqdm)."""
    fns = _impl_fns(impls)
    device = torch.device(device) if device is not None else _default_device()
    specs = [_as_spec(c, i) for i, c in enumerate(cases)]
    rows = []
    bar = _progress(len(specs) * len(fns), progress)
    for spec in specs:
        if bar is not None:
            bar.set_postfix_str(spec.name[:40])
        t0 = time.perf_counter()
        try:
            case = spec.make(device)
            ref = sparse_decode_reference(**case, out_dtype=torch.float64, batch_chunk=batch_chunk)
            _sync(device)
        except Exception as e:  # noqa: BLE001
            msg = f"case setup: {type(e).__name__}: {str(e)[:400]}"
            rows += [_error_row(spec, n, msg, time.perf_counter() - t0) for n in fns]
            if bar is not None:
                bar.update(len(fns))
            continue
        for name, fn in fns.items():
            rows.append(_check(spec, name, fn, case, ref, leak_check))
            if bar is not None:
                bar.update(1)
        del case, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if bar is not None:
        bar.close()
    return rows


def sweep(impls, cases, device=None, *, progress: bool = True, leak_check: bool = True,
          batch_chunk: int | None = None):
    """Run every impl on every case and check it; returns a pandas DataFrame with one row per
    (case, impl) (columns :data:`ROW_COLUMNS`; :func:`sweep_rows` gives the same rows as dicts).

    ``impls``: a name (``"mma"``: :func:`mla.sparse_decode` with that ``impl``), a callable
    with the signature of :func:`mla.sparse_decode`, a list of those, or ``{name: fn}``.
    ``cases``: :class:`CaseSpec` objects (or dicts of their fields). Each case's inputs are built
    once on ``device`` (default: the GPU if there is one) and its float64 reference computed
    once; then every impl is called with its output memory poisoned (a tqdm bar counts the
    calls). A crash is a failed row with the message in ``error``. Row fields: ``ok``;
    ``n_bad`` (elements outside tolerance); ``out_max_abs`` (largest |err|), ``out_max_rel``
    (largest relative error among elements past the absolute allowance: passes when
    < 2.01/128), ``out_excess`` (the worst element's error over its allowance: passes when < 1)
    and ``out_worst_at`` (its index, ``b s h c``), the same for lse (index ``b h s``);
    ``nan_count``; ``leak_ok`` (:func:`unreferenced_invariant`, None when not run); ``seconds``
    (the call, compilation included)."""
    import pandas as pd

    return pd.DataFrame(sweep_rows(impls, cases, device, progress=progress, leak_check=leak_check,
                                   batch_chunk=batch_chunk), columns=ROW_COLUMNS)


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _rows(x) -> list[dict]:
    """Rows as dicts, from a DataFrame or a list; pandas' NaN placeholders become None."""
    recs = x.to_dict("records") if hasattr(x, "to_dict") else list(x)
    return [{k: (None if _missing(v) else (v.item() if hasattr(v, "item") else v)) for k, v in r.items()} for r in recs]


def summary(rows) -> dict:
    """The sweep (a DataFrame or rows) in numbers, JSON-safe: cases, rows, failures (must be 0),
    crashes, the worst errors over all rows, the NaN-leak checks, per impl, the failed rows."""
    rows = _rows(rows)

    def as_float(x):
        try:
            return float(x)          # rows that went through JSON hold "inf" / "nan" as strings
        except (TypeError, ValueError):
            return None

    def worst(col, sub=rows):
        v = [f for f in (as_float(r.get(col)) for r in sub) if f is not None and f == f]
        return _num(max(v)) if v else None

    per_impl = {}
    for impl in dict.fromkeys(r["impl"] for r in rows):
        sub = [r for r in rows if r["impl"] == impl]
        per_impl[impl] = {"rows": len(sub), "failures": sum(not r["ok"] for r in sub),
                          "worst_out_abs": worst("out_max_abs", sub), "worst_out_excess": worst("out_excess", sub),
                          "worst_out_cos": worst("out_cos", sub),
                          "worst_lse_abs": worst("lse_max_abs", sub), "worst_lse_excess": worst("lse_excess", sub),
                          "worst_lse_cos": worst("lse_cos", sub)}

    def why(r):
        if r.get("error"):
            return r["error"]
        return (f"out bad {_fmt(r['out_bad'], 'd')} (worst at {r['out_worst_at']}), cosine diff {_fmt(r.get('out_cos'))}, "
                f"lse bad {_fmt(r['lse_bad'], 'd')}, cosine diff {_fmt(r.get('lse_cos'))}, "
                f"NaN {_fmt(r['nan_count'], 'd')}, leak check {'failed' if r['leak_ok'] is False else 'ok'}")

    return {
        "cases": len({r["case"] for r in rows}), "rows": len(rows), "impls": list(per_impl),
        "failures": sum(not r["ok"] for r in rows), "crashes": sum(bool(r.get("crashed")) for r in rows),
        "worst_out_abs": worst("out_max_abs"), "worst_out_rel": worst("out_max_rel"),
        "worst_out_excess": worst("out_excess"), "worst_out_cos": worst("out_cos"),
        "worst_lse_abs": worst("lse_max_abs"), "worst_lse_rel": worst("lse_max_rel"),
        "worst_lse_excess": worst("lse_excess"), "worst_lse_cos": worst("lse_cos"),
        "tolerances": {"out_abs": OUT_ABS, "out_rel": OUT_REL, "out_cos": OUT_COS, "lse_abs": LSE_ABS,
                       "lse_rel": LSE_REL, "lse_cos": LSE_COS},
        "nan_leak_checks": {"rows_checked_for_nan": sum(r.get("nan_count") is not None for r in rows),
                            "rows_with_nan": sum((r.get("nan_count") or 0) > 0 for r in rows),
                            "unreferenced_invariance_run": sum(r.get("leak_ok") is not None for r in rows),
                            "unreferenced_invariance_failed": sum(r.get("leak_ok") is False for r in rows)},
        "per_impl": per_impl, "failed": [f"{r['case']} / {r['impl']}: {why(r)}" for r in rows if not r["ok"]],
    }


def _fmt(x, spec=".2g"):
    if _missing(x):
        return "-"
    if isinstance(x, str):
        return x
    if spec == "d":
        return str(int(x))
    return format(float(x), spec)


_TABLE_COLUMNS = ("case", "impl", "ok", "out bad", "out max|err|", "out worst/allow", "out worst at", "out cos/allow",
                  "lse bad", "lse worst/allow", "lse worst at", "lse cos/allow", "NaN", "leak", "s", "note")


def _cos_share(x, tol):
    return "-" if _missing(x) else _fmt(abs(float(x)) / tol)


def _table_cells(r) -> list[str]:
    leak = {True: "ok", False: "LEAK"}.get(r["leak_ok"], "-")
    return [str(r["case"]), str(r["impl"]), "ok" if r["ok"] else "FAIL", _fmt(r["out_bad"], "d"),
            _fmt(r["out_max_abs"]), _fmt(r["out_excess"]), _fmt(r["out_worst_at"]), _cos_share(r.get("out_cos"), OUT_COS),
            _fmt(r["lse_bad"], "d"), _fmt(r["lse_excess"]), _fmt(r["lse_worst_at"]), _cos_share(r.get("lse_cos"), LSE_COS),
            _fmt(r["nan_count"], "d"), leak, _fmt(r["seconds"], ".2f"), (r["error"] or "")[:80]]


def table(rows, title: str = "mla.validate", max_rows: int | None = None, width: int = 200,
          failures_first: bool = True) -> str:
    """Render a sweep (a DataFrame or rows) as a table, failures first; returns the text (print
    it). "worst/allow" is the worst element's error over its allowance (it passes below 1);
    "at" is its index (out: ``b s h c``, lse: ``b h s``); "cos/allow" the cosine difference over
    FlashMLA's bound (it passes at 1 or below). Uses rich when it is installed."""
    rows = _rows(rows)
    s = summary(rows)
    if failures_first:
        rows = sorted(rows, key=lambda r: bool(r["ok"]))
    if max_rows is not None:
        rows = rows[:max_rows]
    head = (f"{title}: {s['rows']} runs ({s['cases']} cases x {len(s['impls'])} impls), "
            f"{s['failures']} failed")
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:           # rich is optional: plain columns
        cells = [list(_TABLE_COLUMNS)] + [_table_cells(r) for r in rows]
        w = [max(len(c[i]) for c in cells) for i in range(len(_TABLE_COLUMNS))]
        return "\n".join([head] + ["  ".join(c[i].ljust(w[i]) for i in range(len(w))) for c in cells]) + "\n"
    t = Table(title=head, title_justify="left")
    for col in _TABLE_COLUMNS:
        t.add_column(col, justify="left" if col in ("case", "impl", "out worst at", "lse worst at", "note")
                     else "right", overflow="fold")
    style = {"ok": "[green]ok[/green]", "FAIL": "[bold red]FAIL[/bold red]", "LEAK": "[bold red]LEAK[/bold red]"}
    for r in rows:
        t.add_row(*[style.get(c, escape(c)) if i in (2, 13) else escape(c) for i, c in enumerate(_table_cells(r))])
    con = Console(width=width, record=True, file=io.StringIO(), force_terminal=False, force_jupyter=False)
    con.print(t)
    return con.export_text()


@dataclass
class Report:
    """What :func:`validate` returns: ``ok``, the ``rows`` (``df``: as a pandas DataFrame), the
    ``summary``, and a printable table (``print(report)``)."""

    rows: list
    title: str = "mla.validate"

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.rows)

    @property
    def df(self):
        import pandas as pd

        return pd.DataFrame(self.rows, columns=ROW_COLUMNS)

    @property
    def summary(self) -> dict:
        return summary(self.rows)

    def __str__(self):
        s = self.summary
        lines = [table(self.rows, self.title)]
        lines.append(f"{'PASS' if self.ok else 'FAIL'}: {s['rows']} runs, {s['failures']} failed; worst out error "
                     f"{_fmt(s['worst_out_excess'])} of its allowance, worst lse {_fmt(s['worst_lse_excess'])}; "
                     f"worst cosine diff out {_fmt(s['worst_out_cos'])} (bound {OUT_COS:g}), lse "
                     f"{_fmt(s['worst_lse_cos'])} (bound {LSE_COS:g})")
        lines += [f"  {f}" for f in s["failed"][:20]]
        return "\n".join(lines)

    __repr__ = __str__


def validate(fn, cases=None, device=None, *, progress: bool = True, leak_check: bool = True,
             name: str | None = None) -> Report:
    """Validate ``fn`` (the signature of :func:`mla.sparse_decode`) against the float64 reference
    on ``cases`` (default: :func:`odd_cases` on a GPU, :func:`quick_cases` on the CPU).
    ``fn`` may also be an impl name, a list, or a dict, as in :func:`sweep`. Returns a
    :class:`Report`: ``report.ok``, ``print(report)``, ``report.df``. Needs only torch (pandas,
    rich and tqdm are used when installed)."""
    device = torch.device(device) if device is not None else _default_device()
    if cases is None:
        cases = odd_cases() if device.type == "cuda" else quick_cases()
    impls = {name: fn} if (name and callable(fn)) else fn
    return Report(sweep_rows(impls, cases, device, progress=progress, leak_check=leak_check))
