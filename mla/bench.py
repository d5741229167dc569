"""Benchmark protocol of the SPEC: ceilings, shapes, CUDA-graph and eager timing, JSON records.

``python -m mla.bench`` runs the SPEC's shapes for each impl on the GPU it finds, prints a table
and writes ``results/<gpu-slug>/<name>.json`` (``results/h200/bench.json`` on an H200). It refuses
to run under Triton's CPU interpreter: an interpreter timing means nothing.
``python -m mla.bench --compare A.json B.json`` compares two such files (no GPU needed): the ratio
of CUDA-graph times, B over A, per shape, batch and impl.
"""
from __future__ import annotations

import datetime
import functools
import io
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass

import torch

from .layout import D_QK, TOKEN_BYTES, page_stride


@dataclass(frozen=True)
class Shape:
    """One benchmark case of the SPEC."""

    name: str
    b: int
    s_q: int
    h_q: int
    topk: int
    page: int
    extra_topk: int = 0
    extra_page: int = 64

    @property
    def topk_total(self) -> int:
        return self.topk + self.extra_topk


def spec_shapes() -> list[Shape]:
    """The SPEC's production cases (FlashMLA's), in a fixed order."""
    out = [Shape("DSA", b, 1, 64, 2048, 64) for b in (1, 8, 32, 64, 128)]
    out.append(Shape("DSA s_q 2", 64, 2, 64, 2048, 64))
    out += [Shape("V4-CSA", b, 1, 64, 128, 256, 512, 64) for b in (1, 32, 128)]
    out += [Shape("V4-TP8", b, 1, 8, 128, 256, 512, 64) for b in (1, 32, 128)]
    return out


#: FlashMLA sm90 CUDA-graph time per call on one H200 (SPEC, "Where the field stands"), us.
#: At V4-TP8 FlashMLA needs 64 heads, so its time is the padded V4-CSA time.
FLASHMLA_H200_US = {("DSA", 1): 18.5, ("DSA", 8): 22.9, ("DSA", 32): 51.8, ("DSA", 64): 83.2,
                    ("DSA", 128): 127.5, ("DSA s_q 2", 64): 126.8, ("V4-CSA", 1): 13.6,
                    ("V4-CSA", 32): 25.5, ("V4-CSA", 128): 47.3, ("V4-TP8", 1): 13.6,
                    ("V4-TP8", 32): 25.5, ("V4-TP8", 128): 47.3}

#: Where the field stands (SPEC): CUDA-graph time per call, us, of other implementations at the
#: SPEC's shapes, keyed by (shape name, b). Measured elsewhere, on one H200 in Nov 2026, not by
#: this package and not in the same run as our records: the same card model, another card.
#: "plain PyTorch" is that measurement's own PyTorch code, not our ``impl="reference"``.
PEERS_H200_US = {
    "FlashMLA sm90": FLASHMLA_H200_US,
    "SGLang DSv4 Triton": {("DSA", 64): 3302.0, ("V4-CSA", 32): 559.0},
    "plain PyTorch": {("DSA", 64): 1173.0},
}

#: A random gather of 584-byte tokens on the same card model (SPEC, measured elsewhere), GB/s:
#: the bandwidth a sparse decode can actually reach, below the copy ceiling.
GATHER_H200_GBPS = (2300.0, 2850.0)


def traffic_bytes(s: Shape) -> int:
    """Bytes that must move: gathered tokens * 584 + indices + q + out + lse."""
    n_q = s.b * s.s_q
    return (n_q * s.topk_total * (TOKEN_BYTES + 4) + n_q * s.h_q * D_QK * 2 * 2 + n_q * s.h_q * 4)


def flops(s: Shape) -> int:
    """2 * b * s_q * h_q * topk_total * (512 for Q.K + 512 for P.V)."""
    return 2 * s.b * s.s_q * s.h_q * s.topk_total * 2 * D_QK


def random_cache(num_blocks: int, page: int, device, generator=None, chunk_tokens: int = 1 << 20) -> torch.Tensor:
    """A MODEL1 cache holding :func:`mla.quantize_kv` of N(0, 1) latents, as FlashMLA's tests use,
    quantized in chunks so that multi-GB pools fit in memory."""
    from .layout import empty_cache, quantize_kv

    cache = empty_cache(num_blocks, page, device=device, fill=0)
    ps = page_stride(page)
    flat = torch.as_strided(cache.view(torch.uint8), (num_blocks, ps), (cache.stride(0), 1))
    step = max(1, chunk_tokens // page)
    for lo in range(0, num_blocks, step):
        hi = min(num_blocks, lo + step)
        kv = torch.randn(hi - lo, page, D_QK, device=device, generator=generator).bfloat16()
        flat[lo:hi] = torch.as_strided(quantize_kv(kv).view(torch.uint8), (hi - lo, ps), (ps, 1))
    return cache


def random_indices(b, s_q, topk, n_tokens, device, generator=None) -> torch.Tensor:
    """Random token indices in [0, n_tokens). Drawn with replacement: over a pool of millions of
    tokens a query repeats a token with probability about topk/n_tokens (well under 0.1%)."""
    return torch.randint(0, n_tokens, (b, s_q, topk), dtype=torch.int32, device=device, generator=generator)


class Case:
    """Inputs of one shape over pools far larger than L2, with several index sets."""

    def __init__(self, s: Shape, device, pool_bytes: float = 2e9, n_sets: int = 16, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.shape = s
        nb = max(1, int(pool_bytes // page_stride(s.page)))
        self.cache = random_cache(nb, s.page, device, g)
        self.q = torch.randn(s.b, s.s_q, s.h_q, D_QK, device=device, generator=g).bfloat16()
        self.sink = torch.randn(s.h_q, device=device, generator=g)
        n = nb * s.page
        self.index_sets = [random_indices(s.b, s.s_q, s.topk, n, device, g) for _ in range(n_sets)]
        self.extra = None
        self.extra_sets = [None] * n_sets
        if s.extra_topk:
            enb = max(1, int(pool_bytes // 2 // page_stride(s.extra_page)))
            self.extra = random_cache(enb, s.extra_page, device, g)
            self.extra_sets = [random_indices(s.b, s.s_q, s.extra_topk, enb * s.extra_page, device, g)
                               for _ in range(n_sets)]

    def kwargs(self, i: int = 0) -> dict:
        kw = dict(attn_sink=self.sink)
        if self.extra is not None:
            kw.update(extra_k_cache=self.extra, extra_indices=self.extra_sets[i])
        return kw

    def call(self, fn, i: int = 0):
        return fn(self.q, self.cache, self.index_sets[i], **self.kwargs(i))


def time_graph(case: Case, fn, replays: int = 20) -> float:
    """Median us per call of a CUDA graph holding one call per index set, replayed."""
    n = len(case.index_sets)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n):          # warm-up: compile and allocate outside the capture
            case.call(fn, i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            case.call(fn, i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    del g
    return statistics.median(times)


def time_eager(case: Case, fn) -> float:
    """triton.testing.do_bench median, us, one index set after another."""
    import triton

    it = iter(range(10 ** 9))
    return triton.testing.do_bench(lambda: case.call(fn, next(it) % len(case.index_sets)),
                                   warmup=25, rep=100, return_mode="median") * 1e3


def ceilings(device="cuda") -> dict:
    """Measured on this card: device-to-device copy (bytes read + written) and bf16 matmul."""
    import triton

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: the ceilings are measured on a CUDA device, got {device}")
    x = torch.empty(int(2 ** 30), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median") * 1e-3
    copy = 2 * x.numel() / t / 1e9
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median") * 1e-3
    return {"copy_gbps": round(copy, 1), "matmul_tflops": round(2 * 8192 ** 3 / t / 1e12, 1)}


_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}
_TAIL_WORD = re.compile(r"^(\d+gb|sxm\d*|pcie|hbm\d*e?|nvl|mig|blackwell|ada|generation|server|workstation"
                        r"|edition|laptop|max|q)$")


def gpu_slug(name: str) -> str:
    """The folder a GPU's results go to: the model, without vendor, memory or form-factor words.

    "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100",
    "NVIDIA GeForce RTX 4090" -> "rtx-4090", "NVIDIA RTX 6000 Ada Generation" -> "rtx-6000".
    """
    out = []
    for w in re.split(r"[^a-z0-9]+", name.lower()):
        if not w or w in _VENDOR_WORDS:
            continue
        if _TAIL_WORD.match(w):
            break
        out.append(w)
    return "-".join(out) or "gpu"


def provenance(ceil: dict) -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001
        drv = "unknown"
    return {"gpu": props.name, "sm_count": props.multi_processor_count, "driver": drv,
            "torch": torch.__version__, "triton": triton.__version__, "commit": code_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            "ceilings": ceil, "mma_configs": _config_source()}


def code_commit(cwd=None) -> str:
    """The commit a measurement's code is: ``$MLA_COMMIT`` if set, else the checkout's short HEAD,
    with ``+dirty`` when tracked files differ from it (a working tree timed before it was
    committed, or a copy whose git metadata is older than its files), else "unknown"."""
    if os.environ.get("MLA_COMMIT"):
        return os.environ["MLA_COMMIT"]
    cwd = cwd or pathlib.Path(__file__).parent
    try:
        git = functools.partial(subprocess.run, capture_output=True, text=True, cwd=cwd, timeout=30)
        head = git(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = git(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def _config_source() -> str:
    from . import configs

    try:
        return configs.source()
    except Exception:  # noqa: BLE001
        return "unknown"


def record(s: Shape, impl: str, us_graph: float, us_eager: float | None, ceil: dict) -> dict:
    t = us_graph * 1e-6
    floor = max(traffic_bytes(s) / (ceil["copy_gbps"] * 1e9), flops(s) / (ceil["matmul_tflops"] * 1e12))
    return {"shape": s.name, "b": s.b, "s_q": s.s_q, "h_q": s.h_q, "topk": s.topk, "extra_topk": s.extra_topk,
            "page": s.page, "extra_page": s.extra_page if s.extra_topk else None, "impl": impl,
            "us_graph": round(us_graph, 2), "us_eager": None if us_eager is None else round(us_eager, 2),
            "tflops": round(flops(s) / t / 1e12, 2), "gbps": round(traffic_bytes(s) / t / 1e9, 1),
            "roofline": round(floor / t, 4)}


IMPL_NAMES = ("mma", "simt", "reference")

#: The tolerance a rerun is judged by in :func:`compare`: |ratio - 1| <= SPREAD counts as "the same".
#: In the H200 record, the same kernel and config timed twice in one run (run r4: the config sweep,
#: then the benchmark) differs by up to 3% (chapter 6 shows it); 5% leaves room for a fresh process.
SPREAD = 0.05


def _refusal() -> str:
    why = "" if torch.cuda.is_available() else "; no CUDA GPU was found, so `import mla` turned it on"
    return ("mla.bench: refusing to run under Triton's CPU interpreter (TRITON_INTERPRET=1" + why + "): "
            "an interpreter timing means nothing. Run it on a machine with a CUDA GPU. Without one, the "
            "H200 record is results/h200/bench.json (chapter 6 draws it), and "
            "`python -m mla.bench --compare A.json B.json` compares two result files.")


def _progress_bar(total: int, enabled: bool):
    try:                              # a widget in a notebook only when ipywidgets is there
        import ipywidgets  # noqa: F401
        from tqdm.auto import tqdm
    except ImportError:
        from tqdm import tqdm
    return tqdm(total=total, disable=not enabled, desc="mla.bench", unit="case")


def run(shapes=None, impls=IMPL_NAMES, out_dir="results", name="bench", pool_bytes=2e9, n_sets=16,
        eager=True, progress=True, repeat=1) -> dict:
    """Run the protocol on this GPU and write ``<out_dir>/<gpu-slug>/<name>.json``.

    Per shape one :class:`Case` (a pool of ``pool_bytes`` per cache, ``n_sets`` index sets), then per
    impl the CUDA-graph median per call (:func:`time_graph`) and, for ``mma``, the eager
    ``do_bench`` median (:func:`time_eager`). With ``repeat`` > 1 the graph is built and timed that
    many times; ``us_graph`` is the median and ``us_graph_runs`` lists them all.
    Returns the file's content plus ``path`` and, when a file was there before, ``previous`` (what
    it held: :func:`compare` it with the new one).
    """
    import mla  # turns the interpreter on where there is no GPU

    if _interpreting():
        raise RuntimeError(_refusal())
    if not torch.cuda.is_available():
        raise RuntimeError("mla.bench: no CUDA GPU found")
    shapes = list(spec_shapes() if shapes is None else shapes)
    impls = tuple(impls)
    if not shapes or not impls:
        raise ValueError("mla.bench.run: nothing to time (no shapes or no impls)")

    dev = torch.device("cuda")
    ceil = ceilings(dev)
    records = []
    bar = _progress_bar(len(shapes) * len(impls), progress)
    for s in shapes:
        bar.set_postfix_str(f"{s.name} b={s.b}: building the {pool_bytes / 1e9:g} GB pool")
        case = Case(s, dev, pool_bytes=pool_bytes, n_sets=n_sets)
        for impl in impls:
            bar.set_postfix_str(f"{s.name} b={s.b} {impl}")
            fn = lambda *a, _i=impl, **k: mla.sparse_decode(*a, **k, impl=_i)  # noqa: E731
            slow = impl != "mma"
            runs = [time_graph(case, fn, replays=5 if slow else 20) for _ in range(max(1, repeat))]
            us_e = time_eager(case, fn) if eager and not slow else None
            rec = record(s, impl, statistics.median(runs), us_e, ceil)
            if impl == "mma":             # which kernel the launch rule picked for this shape
                from .kernels.mma import launch_config

                rec["kernel"] = launch_config(s.b, s.s_q, s.h_q, s.topk + s.extra_topk, dev).kernel
            if len(runs) > 1:
                rec["us_graph_runs"] = [round(x, 2) for x in runs]
            records.append(rec)
            bar.update(1)
        del case
        torch.cuda.empty_cache()
    bar.close()
    result = {"provenance": provenance(ceil), "records": records}
    path = pathlib.Path(out_dir) / gpu_slug(result["provenance"]["gpu"]) / f"{name}.json"
    previous = None
    if path.exists():
        try:
            previous = json.loads(path.read_text())
        except ValueError:
            previous = None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    result["path"] = str(path)
    if previous is not None:
        result["previous"] = previous
    return result


def _console(width: int):
    """A rich console that only records plain text (in a notebook too, where rich would otherwise
    display the table itself)."""
    from rich.console import Console

    return Console(file=io.StringIO(), width=width, record=True, force_jupyter=False, force_terminal=False,
                   color_system=None)


def table(records, title="sparse decode, us per call (CUDA graph)") -> str:
    """A plain-text table of records (rich draws it), with FlashMLA's H200 time from the SPEC."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("shape", "b", "s_q", "h_q", "impl", "us_graph", "us_eager", "TFLOP/s", "GB/s", "roofline",
                "FlashMLA H200 us (SPEC)"):
        t.add_column(col, justify="right")
    for r in records:
        fm = FLASHMLA_H200_US.get((r["shape"], r["b"]))
        t.add_row(r["shape"], str(r["b"]), str(r["s_q"]), str(r["h_q"]), r["impl"], f"{r['us_graph']:.1f}",
                  "-" if r.get("us_eager") is None else f"{r['us_eager']:.1f}", f"{r['tflops']:.1f}",
                  f"{r['gbps']:.0f}", f"{r['roofline']:.2f}", "-" if fm is None else f"{fm}")
    con = _console(160)   # export only: the caller prints
    con.print(t)
    return con.export_text()


def load(src) -> dict:
    """A result: a path to a JSON file, the dict itself, or a bare list of records."""
    if isinstance(src, (str, os.PathLike)):
        return json.loads(pathlib.Path(src).read_text())
    if isinstance(src, dict):
        return src
    return {"records": list(src)}


def _key(r: dict) -> tuple:
    return (r["shape"], r["b"], r["s_q"], r["h_q"], r["impl"])


def compare(record_a, record_b, tol: float = SPREAD) -> list[dict]:
    """Per (shape, b, s_q, h_q, impl) present in both results: ``ratio`` = us_graph of B / us_graph
    of A (above 1: B is slower), and ``within`` = |ratio - 1| <= tol. A and B are paths, result
    dicts or lists of records; the rows follow A's order."""
    b_by_key = {_key(r): r for r in load(record_b)["records"]}
    rows = []
    for ra in load(record_a)["records"]:
        rb = b_by_key.get(_key(ra))
        if rb is None or not ra.get("us_graph") or not rb.get("us_graph"):
            continue
        ratio = rb["us_graph"] / ra["us_graph"]
        rows.append({"shape": ra["shape"], "b": ra["b"], "s_q": ra["s_q"], "h_q": ra["h_q"], "impl": ra["impl"],
                     "us_a": ra["us_graph"], "us_b": rb["us_graph"], "ratio": round(ratio, 4),
                     "within": abs(ratio - 1) <= tol + 1e-9})
    return rows


def compare_table(rows, tol: float = SPREAD, names=("A", "B")) -> str:
    """Plain text of :func:`compare`'s rows, with the geometric mean and the worst ratio; ``names``
    says what A and B are (file names, say)."""
    from rich.table import Table

    t = Table(title=f"us per call (CUDA graph): B / A, where A = {names[0]}, B = {names[1]}")
    for col in ("shape", "b", "s_q", "h_q", "impl", "A us", "B us", "B / A", f"within {tol:.0%}"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["shape"], str(r["b"]), str(r["s_q"]), str(r["h_q"]), r["impl"], f"{r['us_a']:.1f}",
                  f"{r['us_b']:.1f}", f"{r['ratio']:.3f}", "yes" if r["within"] else "NO")
    con = _console(120)
    con.print(t)
    if rows:
        gm = math.exp(statistics.fmean(math.log(r["ratio"]) for r in rows))
        worst = max(rows, key=lambda r: abs(math.log(r["ratio"])))
        out = sum(not r["within"] for r in rows)
        con.print(f"{len(rows)} cases in both; geometric mean B / A = {gm:.3f}; worst {worst['ratio']:.3f} "
                  f"({worst['shape']} b={worst['b']} {worst['impl']}); {out} outside {tol:.0%}")
    else:
        con.print("no (shape, b, s_q, h_q, impl) in both results")
    return con.export_text()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mla.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", action="append", choices=IMPL_NAMES, help="impls to time (default: all)")
    ap.add_argument("--shape", action="append",
                    help="only SPEC shapes with this name: DSA, 'DSA s_q 2', V4-CSA, V4-TP8 (repeatable)")
    ap.add_argument("--b", action="append", type=int, help="only these batch sizes (repeatable)")
    ap.add_argument("--out", default="results", help="results folder (default: results)")
    ap.add_argument("--name", default="bench", help="file name, without .json (default: bench)")
    ap.add_argument("--pool-gb", type=float, default=2.0, help="KV pool size per cache, GB (default 2)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time each CUDA graph this many times (a fresh graph each) and keep the median; "
                         "the runs go to us_graph_runs (default 1)")
    ap.add_argument("--no-eager", action="store_true", help="skip the do_bench eager timing")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--against", metavar="A.json",
                    help="after the run, compare the new file with this one (default: the file the run "
                         "replaced, if there was one)")
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                    help="only compare two result files (B over A) and exit: 0 if every case is within "
                         "--tol, 1 if not; needs no GPU")
    ap.add_argument("--tol", type=float, default=SPREAD, help=f"tolerance of a comparison (default {SPREAD})")
    a = ap.parse_args(argv)
    if a.compare:
        try:
            rows = compare(*a.compare, tol=a.tol)
        except (OSError, ValueError, KeyError) as e:
            print(f"mla.bench --compare: {e}", file=sys.stderr)
            return 2
        print(compare_table(rows, a.tol, names=tuple(a.compare)))
        if not rows:
            return 2
        return 0 if all(r["within"] for r in rows) else 1
    names = sorted({s.name for s in spec_shapes()})
    unknown = sorted(set(a.shape or ()) - set(names))
    if unknown:
        print(f"mla.bench: unknown shape {unknown}; the SPEC's shapes are {names}", file=sys.stderr)
        return 2
    shapes = [s for s in spec_shapes() if (not a.shape or s.name in a.shape) and (not a.b or s.b in a.b)]
    if not shapes:
        print(f"mla.bench: no SPEC shape matches --shape {a.shape} --b {a.b}", file=sys.stderr)
        return 2
    if _interpreting():
        print(_refusal(), file=sys.stderr)
        return 2
    try:
        res = run(shapes, tuple(a.impl or IMPL_NAMES), a.out, a.name, a.pool_gb * 1e9, eager=not a.no_eager,
                  progress=not a.no_progress, repeat=a.repeat)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    print(table(res["records"]))
    prov = res["provenance"]
    print(f"{prov['gpu']} ({prov['sm_count']} SMs), copy {prov['ceilings']['copy_gbps']:.0f} GB/s, "
          f"bf16 matmul {prov['ceilings']['matmul_tflops']:.0f} TFLOP/s; mma configs: {prov.get('mma_configs')}")
    print(f"wrote {res['path']}")
    if res.get("previous") is not None:
        lost = {_key(r) for r in res["previous"].get("records", [])} - {_key(r) for r in res["records"]}
        if lost:
            print(f"note: the file this run replaced held {len(lost)} cases this run did not time; they are "
                  "gone from it (git restores a committed record; --out or --name writes elsewhere)")
    base, base_name = (a.against, a.against) if a.against else (res.get("previous"), "replaced file")
    if base is not None:
        print(compare_table(compare(base, res, tol=a.tol), a.tol, names=(base_name, "this run")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
